"""The weight sync of the vLLM backend against ``FakeEngine`` (a test double of ``vllm.LLM``,
tests/vllm_standin.py): versions, the memory order around sleep, the in-place reload call, LoRA streamed merged.
On the real engine: tests/test_vllm_engine.py."""

from __future__ import annotations

import math

import pytest
import torch
from vllm_standin import FakeEngine, _output, _request

from posttrain.rollout.vllm import VLLMBackend
from posttrain.rollout.vllm_sync import WeightSync, merged_weights, reload_weights


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


def _lora_model(fill: float = 0.01, targets: str | list[str] = "all-linear"):
    from posttrain.config import LoraCfg, TinyModel
    from posttrain.modeling import build_char_tokenizer, build_tiny_model, make_trainable

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tok, 0)
    model = make_trainable(model, LoraCfg(r=4, alpha=8, dropout=0.0, target_modules=targets), False)
    with torch.no_grad():  # a trained adapter: B != 0, so merging changes the weights
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_" in name:  # (peft starts embedding adapters A = 0)
                p.copy_(fill * torch.randn_like(p))
    return model, tok


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "embed_tokens"]])
def test_lora_merged_weights_stream_equals_peft_merge_and_unload_without_touching_the_adapter(targets):
    """With embeddings adapted too (found by review: their adapters live in ``lora_embedding_A`` and were left
    out without a word); the live base weights stay as they were (a first cut added the deltas into them)."""
    import copy

    from posttrain.modeling import is_lora

    model, _ = _lora_model(targets=targets)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    got = dict(merged_weights(model))
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())
    assert list(got) == list(expected)  # HF names, HF order: what the engine's loader maps
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)
    assert any(not torch.equal(got[k], model.get_base_model().state_dict()[k.replace(".weight", ".base_layer.weight")])
               for k in got if k.endswith("q_proj.weight"))  # the deltas are in
    assert is_lora(model) and not any(m.merged for m in model.modules() if hasattr(m, "merged"))
    assert torch.is_grad_enabled()  # the stream computes under no_grad without leaking it to the caller
    if "embed_tokens" in targets:
        assert not torch.equal(got["model.embed_tokens.weight"],
                               model.get_base_model().model.embed_tokens.base_layer.weight)


def test_lora_variants_the_stream_cannot_merge_are_refused_not_dropped():
    from peft import LoraConfig, get_peft_model

    from posttrain.config import TinyModel
    from posttrain.modeling import build_char_tokenizer, build_tiny_model

    base = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                            build_char_tokenizer(), 0)
    dora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match="DoRA"):
        dict(merged_weights(dora))


def test_generating_from_weights_a_level_2_sleep_discarded_is_an_error():
    eng = FakeEngine()
    backend = VLLMBackend(eng, [2], sleep_level=2)
    backend.sync.load([("a", torch.ones(1))], "v0")
    backend.release()
    from posttrain.rollout import SamplingParams

    with pytest.raises(RuntimeError, match="load_weights first"):
        backend.generate([[1, 2]], 1, SamplingParams())
    backend.sync.load([("a", torch.ones(1))], "v0")
    assert not backend.sync.discarded


def test_a_shutdown_hook_runs_once_however_often_it_is_registered(monkeypatch):
    from posttrain import distributed

    monkeypatch.setattr(distributed, "_BEFORE_SHUTDOWN", [])
    calls = []

    def hook():
        calls.append(1)

    for _ in range(3):
        distributed.before_shutdown(hook)
    assert distributed._BEFORE_SHUTDOWN == [hook]


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




def test_backend_takes_the_weights_as_a_stream_and_pulls_it_only_for_a_new_version():
    """Issue 50, item 1: under FSDP2 the engine was synced from ``Dist.plain``'s full copy of the model on every
    rank (a whole model in ``model.dtype`` beside the shards and the engine's own weights). The backend now says
    it copies weights (``samples_with_module`` False) and takes ``Dist.for_generation``'s stream of named
    tensors, one all-gathered parameter at a time; a version it already serves pulls nothing (no rank
    all-gathers: every rank skips alike)."""
    eng = FakeEngine()
    backend = VLLMBackend(eng, [0])
    pulled: list[str] = []

    def stream():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            pulled.append(name)
            yield name, torch.full((2, 3), float(len(pulled)))

    assert VLLMBackend.samples_with_module is False
    backend.load_weights(stream(), "step1")
    assert pulled == ["model.embed_tokens.weight", "lm_head.weight"]
    assert eng.weights["lm_head.weight"].tolist() == [[2.0] * 3] * 2
    backend.load_weights(stream(), "step1")
    assert len(pulled) == 2 and eng.calls.count("reload_weights") == 1
