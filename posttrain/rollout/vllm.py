"""The vLLM rollout backend: GPU workers, in the GPU environment (``make setup-gpu`` -> ``.venv-gpu``).

Imported lazily (``BACKENDS["vllm"]``): vLLM and its CUDA torch live only in the GPU environment, whose pins
conflict with prefect's. The same ``RolloutBackend`` contract as ``hf.py``:

- prompts go in as token ids (``TokensPrompt``): the chat template is applied once, by us, so vLLM never
  re-templates or adds a second BOS;
- ``SamplingParams(n, temperature, top_p, max_tokens, seed, logprobs=0, stop_token_ids=<every stop id of the
  model folder's generation_config>)``; the engine is built with ``logprobs_mode="processed_logprobs"`` (the
  recorded log-prob is of the distribution actually sampled from, after temperature/top-p, as the trainer
  scores it) and ``generation_config="vllm"`` (the folder's sampling defaults cannot silently change ours);
- out: per prompt, ``n`` completions: token ids (the stop token included iff the sequence stopped on one, as
  vLLM returns them and as the hf backend does), one sampler log-prob per token, finish reason.

Inside the RL loop (design (a) of the issue, colocated): the engine lives in the stage process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the trainer's GPU, ``enable_sleep_mode`` lets it give its memory
back during the update, and after every optimizer step ``load_weights`` copies the trainer's weights into it
(``collective_rpc`` -> the worker model's ``load_weights``, GPU to GPU, no filesystem round trip) and resets
the prefix cache (its KV entries were computed by the old weights). Why colocated: one process and one GPU
per rank, no transport to build or secure, and the weights never leave the device; a ``vllm serve`` process
with a weight-update route (design (b)) fits behind the same two methods (``generate``, ``load_weights``)
when generation must scale separately from training. ``WeightSync`` is the bookkeeping: which version of
the weights the engine holds, and the traps: after ``sleep(level=2)`` the engine's weights are gone, so
the next ``load_weights`` must run even for the same version; the prefix cache is reset after every sync.
A LoRA policy is synced merged (``modeling.save_checkpoint`` semantics: merge on a copy, never unmerge the
live adapter).

The engine is used through a small interface (``Engine``: vLLM's ``LLM`` satisfies it), so the bookkeeping
and the conversion of vLLM's own output objects are tested without a GPU (tests/test_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from posttrain.rollout.base import Completion, SamplingParams


class Engine(Protocol):
    """What the backend uses of ``vllm.LLM``."""

    def generate(self, prompts: Any, sampling_params: Any, use_tqdm: bool = ...) -> list[Any]: ...

    def reset_prefix_cache(self) -> Any: ...

    def sleep(self, level: int = ...) -> Any: ...

    def wake_up(self, tags: list[str] | None = ...) -> Any: ...

    def collective_rpc(self, method: Any, timeout: float | None = ..., args: tuple = ...,
                       kwargs: dict[str, Any] | None = ...) -> list[Any]: ...


def position_logprob(position: Any, token_id: int) -> float:
    """The sampled token's log-prob at one position of ``CompletionOutput.logprobs`` (a ``{token_id:
    Logprob}`` dict; ``FlatLogprobs`` positions read the same way)."""
    entry = position[token_id]
    return float(entry.logprob)


def to_completions(outputs: Sequence[Any], n: int) -> list[list[Completion]]:
    """vLLM ``RequestOutput`` s (one per prompt, in prompt order) -> per prompt, ``n`` ``Completion`` s.

    Every completion must carry per-token log-probs (``SamplingParams(logprobs=0)``); a missing one is a bug
    of the request, not something to paper over with zeros."""
    groups = []
    for req in outputs:
        outs = sorted(req.outputs, key=lambda o: o.index)
        if len(outs) != n:
            raise ValueError(f"request {req.request_id}: {len(outs)} completions, expected n={n}")
        group = []
        for o in outs:
            ids = [int(t) for t in o.token_ids]
            if o.logprobs is None or len(o.logprobs) != len(ids):
                raise ValueError(f"request {req.request_id}: completion {o.index} has no per-token log-probs "
                                 "(SamplingParams(logprobs=0) is required)")
            reason = o.finish_reason if o.finish_reason in ("stop", "length") else "length"
            group.append(Completion(text=o.text, token_ids=ids,
                                    logprobs=[position_logprob(p, t) for p, t in zip(o.logprobs, ids, strict=True)],
                                    finish_reason=reason))
        groups.append(group)
    return groups


@dataclass
class WeightSync:
    """Which weights the engine serves. ``version`` is None when unknown (at start, and after a level-2
    sleep discarded them), so the next ``load`` always copies."""

    engine: Engine
    sleep_level: int | None = None  # None: never sleep; 1: offload weights to CPU; 2: discard them
    version: str | None = None
    asleep: bool = False
    syncs: int = 0
    log: list[str] = field(default_factory=list)  # what was done, in order (for tests and debugging)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> bool:
        """Make the engine serve ``weights`` (named tensors) as ``version``; False when it already does."""
        self.wake()
        if version == self.version:
            return False
        named = list(weights)
        self.engine.collective_rpc(_load_weights, args=(named,))
        self.engine.reset_prefix_cache()  # cached KV entries were computed by the old weights
        self.version, self.syncs = version, self.syncs + 1
        self.log += [f"load {version}", "reset_prefix_cache"]
        return True

    def release(self) -> None:
        """Give the GPU memory back for the update (``sleep``); a no-op without sleep mode."""
        if self.sleep_level is None or self.asleep:
            return
        self.engine.sleep(level=self.sleep_level)
        self.asleep = True
        self.log.append(f"sleep {self.sleep_level}")
        if self.sleep_level >= 2:
            self.version = None  # level 2 discards the weights: the same version must be loaded again

    def wake(self) -> None:
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False
            self.log.append("wake_up")


def _load_weights(worker: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on each vLLM worker (``collective_rpc``): the model's own ``load_weights`` maps HF names to its
    fused/sharded layout."""
    worker.model_runner.model.load_weights(weights=named)


class VLLMBackend:
    """``RolloutBackend`` over a vLLM engine (see module docstring)."""

    def __init__(self, engine: Engine, stop_token_ids: list[int], stop_strings: list[str] | None = None,
                 sleep_level: int | None = None) -> None:
        self.engine = engine
        self.stop_token_ids, self.stop_strings = list(stop_token_ids), list(stop_strings or [])
        self.sync = WeightSync(engine, sleep_level)

    def request(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> tuple[list[Any], Any]:
        """vLLM's prompt and sampling objects for one call."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VSamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                             max_tokens=sampling.max_new_tokens, seed=sampling.seed, logprobs=0,
                             stop_token_ids=self.stop_token_ids, stop=self.stop_strings or None)
        return [TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sp

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        self.sync.wake()
        prompts, sp = self.request(prompt_ids, n, sampling)
        return to_completions(self.engine.generate(prompts, sp, use_tqdm=False), n)

    def load_weights(self, model: torch.nn.Module, version: str) -> None:
        """The trainer's current weights into the engine (a merged copy for a LoRA policy)."""
        self.sync.wake()
        if version == self.sync.version:
            return
        from posttrain.modeling import is_lora

        if is_lora(model):
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        self.sync.load(((k, v.detach()) for k, v in model.state_dict().items()), version)

    def release(self) -> None:
        self.sync.release()


def build(model: Any, tokenizer: Any, batch_size: int, options: Any = None) -> VLLMBackend:
    """A colocated engine on the model folder ``model`` was loaded from (``config._name_or_path``);
    ``options``: ``config.VLLMOptions`` (``rollout.vllm``; None: its defaults)."""
    import os

    from posttrain.config import VLLMOptions

    options = options or VLLMOptions()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: load_weights reaches it
    from vllm import LLM

    from posttrain.modeling import stop_ids

    folder = getattr(model.config, "_name_or_path", None) or str(model)
    engine = LLM(model=folder, tokenizer=folder, dtype="auto", seed=0, enable_sleep_mode=options.sleep_level > 0,
                 gpu_memory_utilization=options.gpu_memory_utilization, max_model_len=options.max_model_len,
                 enforce_eager=options.enforce_eager, max_num_seqs=batch_size, logprobs_mode="processed_logprobs",
                 generation_config="vllm", enable_prefix_caching=True)
    return VLLMBackend(engine, stop_ids(model, tokenizer), list(model.generation_config.stop_strings or []),
                       sleep_level=options.sleep_level or None)
