"""Weights into a colocated vLLM engine: which version it serves, in which memory order, through which call.

``WeightSync`` is the bookkeeping of ``VLLMBackend`` (``vllm.py``): which version of the trainer's weights the
engine holds, and the traps around it:

- the copy goes through vLLM's supported in-place reload, ``Worker.reload_weights(weights_iterator=...,
  is_checkpoint_format=True)`` (``collective_rpc`` -> each worker). It takes checkpoint-format (HF) names and
  tensors and re-runs the platform's post-load processing. The older route, ``model_runner.model.load_weights``,
  fails on vLLM's CPU build (``'Parameter' object has no attribute 'weight_loader'``: the CPU linear method
  repacks weights after loading) and skips that processing on GPU too. Why not vLLM's newer weight-transfer
  API (``init_weight_transfer_engine`` / ``update_weights``): it is built for a trainer in another process
  (NCCL or IPC handles); colocated in one process, the iterator hands the tensors over with no serialization
  or transport (vLLM's layer-wise reload still copies them into its kernel layout);
  ``reload_weights`` has the same signature on the GPU worker (``gpu_worker.Worker``) and the CPU worker,
  which inherits it.
- after a level-2 sleep the engine's weights are gone: the next ``load`` copies even the same version;
- memory order around a sleeping engine (vLLM's own RL recipe): free the trainer's cached blocks
  (``torch.cuda.empty_cache``), wake the weights only, copy, then wake the KV cache; the prefix cache is reset
  after every copy (its entries were computed by the old weights).

``merged_weights`` streams a LoRA policy's merged weights one tensor at a time (W + B·A·scale, computed per
module as the engine's loader asks for it), instead of a deep copy of the whole model merged: at 7B the copy
is another 28 GB on the trainer's device. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
or ``external_launcher``), so the generator reaches the worker unpickled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Engine(Protocol):
    """What the backend uses of ``vllm.LLM``."""

    def generate(self, prompts: Any, sampling_params: Any, use_tqdm: bool = ...) -> list[Any]: ...

    def reset_prefix_cache(self) -> Any: ...

    def sleep(self, level: int = ...) -> Any: ...

    def wake_up(self, tags: list[str] | None = ...) -> Any: ...

    def collective_rpc(self, method: Any, timeout: float | None = ..., args: tuple = ...,
                       kwargs: dict[str, Any] | None = ...) -> list[Any]: ...


def reload_weights(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs on each vLLM worker (``collective_rpc``): vLLM's in-place reload of checkpoint-format weights."""
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


def _free_device_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trainer's cached blocks, so the engine's wake-up finds the memory


@dataclass
class WeightSync:
    """Which weights the engine serves. ``version`` is None when unknown (at start, and after a level-2
    sleep discarded them), so the next ``load`` always copies."""

    engine: Engine
    sleep_level: int = 0  # 0: never sleep; 1: offload weights to host memory; 2: discard them
    version: str | None = None
    asleep: set[str] = field(default_factory=set)  # the parts still asleep: "weights", "kv_cache"
    syncs: int = 0
    discarded: bool = False  # a level-2 sleep threw the weights away and no load has put them back
    log: list[str] = field(default_factory=list)  # what was done, in order (for tests and debugging)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> bool:
        """Make the engine serve ``weights`` (named tensors, consumed once) as ``version``; False when it
        already does."""
        if version == self.version:
            self.wake()
            return False
        self._wake("weights")  # the KV cache stays asleep while the weights are copied: less peak memory
        self.engine.collective_rpc(reload_weights, args=(weights,))
        self._wake("kv_cache")
        self.engine.reset_prefix_cache()  # cached KV entries were computed by the old weights
        self.version, self.syncs, self.discarded = version, self.syncs + 1, False
        self.log += [f"load {version}", "reset_prefix_cache"]
        return True

    def release(self) -> None:
        """Give the device memory back for the update (``sleep``); a no-op without sleep mode."""
        if not self.sleep_level or self.asleep:
            return
        self.engine.sleep(level=self.sleep_level)
        self.asleep = {"weights", "kv_cache"}
        self.log.append(f"sleep {self.sleep_level}")
        if self.sleep_level >= 2:
            self.version = None  # level 2 discards the weights: the same version must be loaded again
            self.discarded = True

    def wake(self) -> None:
        for tag in ("weights", "kv_cache"):
            self._wake(tag)

    def _wake(self, tag: str) -> None:
        if tag in self.asleep:
            _free_device_cache()
            self.engine.wake_up(tags=[tag])
            self.asleep.discard(tag)
            self.log.append(f"wake_up {tag}")


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named state of ``model`` with every LoRA adapter merged, one tensor at a time (a plain model:
    its state dict as is). Equals ``copy.deepcopy(model).merge_and_unload().state_dict()`` (test) without
    the copy; the live adapter is never touched."""
    from posttrain.modeling import is_lora

    if not is_lora(model):
        yield from ((k, v.detach()) for k, v in model.state_dict().items())
        return
    from peft.tuners.lora import LoraLayer

    base = model.base_model.model
    lora_modules = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for m in lora_modules.values():
        extra = [what for what, on in (("DoRA", any(m.use_dora.values())),
                                       ("lora_bias", any(getattr(m, "lora_bias", {}).values()))) if on]
        if extra:
            raise NotImplementedError(f"streaming merged LoRA weights with {extra[0]} is not implemented")
    # a weight tied to an adapted one (lm_head to embed_tokens): merged as peft's merge_and_unload leaves it
    tied = {m.base_layer.weight.data_ptr(): m for m in lora_modules.values()}
    for key, value in base.state_dict().items():
        if ".modules_to_save." in key or ".original_module." in key:
            raise NotImplementedError("streaming merged LoRA weights with modules_to_save is not implemented")
        if ".lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if not owner:  # not inside a LoRA-wrapped module
            shared = tied.get(value.data_ptr()) if key.endswith(".weight") else None
            yield key, _merged(shared, value) if shared is not None else value.detach()
            continue
        module = lora_modules[owner]
        yield f"{owner}.{leaf}", _merged(module, value) if leaf == "weight" else value.detach()


@torch.no_grad()
def _merged(module: Any, weight: torch.Tensor) -> torch.Tensor:
    """One LoRA-wrapped weight plus its active adapters' deltas (peft's own ``get_delta_weight``: scale,
    fan-in/fan-out layout; Linear and Embedding adapters), summed in float32 and cast back once (a bf16 base
    would otherwise round each delta first)."""
    if module.merged:  # already inside the base weight
        return weight.detach()
    out = weight.detach().to(torch.float32, copy=True)  # never the live base weight itself
    for adapter in module.active_adapters:
        if adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {}):
            out += module.get_delta_weight(adapter).float()
    return out.to(weight.dtype)
