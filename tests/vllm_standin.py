"""Stand-ins for vLLM in the tests that run without it (named as such): output objects with the fields of
vLLM's own (vLLM's classes are used where it is installed), ``FakeEngine``, a test double of ``vllm.LLM`` that
records calls and never generates, and ``fake_vllm``, a stand-in ``vllm`` module for ``rollout.vllm.build``.
The real engine: tests/test_vllm_engine.py."""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass
class _Logprob:  # vllm.logprobs.Logprob's fields
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class _CompletionOutput:  # vllm.outputs.CompletionOutput's fields used here
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[Any]
    finished: bool


def _classes(flat: bool = False):
    if not HAVE_VLLM:
        return _RequestOutput, _CompletionOutput, _Logprob, None
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    return RequestOutput, CompletionOutput, Logprob, FlatLogprobs if flat else None


def _output(index: int, ids: list[int], lps: list[float], reason: str, flat: bool = False) -> Any:
    _, completion, logprob, flat_cls = _classes(flat)
    if flat_cls is not None:
        per = flat_cls()
        for t, lp in zip(ids, lps, strict=True):
            per.append_fast([t], [lp], iter([1]), [None])
    else:  # one {sampled id: Logprob} per position (logprobs=0: the sampled token only)
        per = [{t: logprob(logprob=lp, rank=1, decoded_token=None)} for t, lp in zip(ids, lps, strict=True)]
    return completion(index=index, text="".join(chr(97 + t % 26) for t in ids), token_ids=ids,
                      cumulative_logprob=sum(lps), logprobs=per, finish_reason=reason,
                      stop_reason=None)


def _request(rid: str, outs: list[Any]) -> Any:
    request, *_ = _classes()
    return request(request_id=rid, prompt=None, prompt_token_ids=[1, 2, 3], prompt_logprobs=None, outputs=outs,
                   finished=True)


@dataclass
class FakeEngine:
    """A test double of ``vllm.LLM``: records every call; ``weights`` is what its model holds."""

    calls: list[str] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append("generate")
        return self.outputs

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level=1):
        self.calls.append(f"sleep {level}")
        if level >= 2:
            self.weights = {}  # level 2 discards them

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up {','.join(tags or ['all'])}")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        engine = self

        class Worker:  # vLLM's worker: the in-place reload of checkpoint-format weights
            def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
                assert is_checkpoint_format
                engine.weights.update({k: v.clone() for k, v in weights_iterator})

        self.calls.append("reload_weights")
        return [method(Worker(), *args)]



def fake_vllm(monkeypatch: Any, llm: Any, sleep: bool = True, device_type: str = "cuda") -> None:
    """Install a stand-in ``vllm`` (``LLM`` = ``llm``) and ``vllm.platforms`` for ``rollout.vllm.build``; the
    shutdown hooks it registers go to a fresh list."""
    from posttrain import distributed

    fake = types.ModuleType("vllm")
    fake.LLM = llm
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: sleep,
                                                       device_type=device_type)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)  # restored whatever the build does
    monkeypatch.setattr(distributed, "_BEFORE_SHUTDOWN", [])
