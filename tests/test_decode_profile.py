"""benchmarks/decode_profile.py: each operator falls into the category its docstring names, by its name and by
whether it ran inside the model's forward; the KV positions a forward reads come from the hf mask or vLLM's
positions."""

import importlib.util
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
spec = importlib.util.spec_from_file_location("decode_profile", REPO / "benchmarks" / "decode_profile.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize(("name", "in_forward", "cat"), [
    ("aten::mm", True, "matmul"),
    ("_C::onednn_mm", False, "matmul"),  # vLLM's LM head runs after the forward, in compute_logits
    ("aten::_scaled_dot_product_flash_attention_for_cpu", True, "attention"),
    ("_C::cpu_attention_with_kv_cache", True, "attention"),
    ("_C::cpu_attn_reshape_and_cache", True, "kv_write"),  # a KV write, though its name says attn
    ("vllm::unified_kv_cache_update", True, "kv_write"),
    ("aten::copy_", True, "kv_write"),
    ("aten::silu", True, "elementwise"),
    ("aten::mul", True, "elementwise"),
    ("aten::mul", False, "after_forward_ops"),  # a temperature scale, not a layer
    ("aten::cumsum_", False, "after_forward_ops"),
    ("## Call CompiledFxGraph fxz5 ##", True, "compiled"),
    ("aten::embedding", True, "other_forward"),
    ("decode/forward", False, "python_forward"),
    ("ProfilerStep#130", False, "python_after"),
])
def test_category(name: str, in_forward: bool, cat: str) -> None:
    assert bench.category(name, in_forward) == cat


def test_context_hf_mask_and_vllm_positions() -> None:
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # left padding: 5 real positions of 6 read
    assert bench.context({"attention_mask": mask}, ()) == (5, 6)
    pos = torch.tensor([4, 9])  # decode tokens at positions 4 and 9 read 5 + 10 cached positions
    assert bench.context({"positions": pos}, ()) == (15, 15)
    assert bench.context({}, (torch.tensor([1, 2]), pos)) == (15, 15)  # positional call


def test_profile_decode_on_the_hf_loop(tiny: dict) -> None:
    """The profiled window covers exactly ``steps`` forwards at the batch's rows, stops the generation there, and
    its categories add up to the step's wall time."""
    from conftest import tiny_model

    from posttrain.config import ModelCfg
    from posttrain.rollout import BACKENDS

    model, tok = tiny_model(ModelCfg.model_validate(tiny["model"]), 0)
    backend = BACKENDS["hf"](model, tok, 16)
    prompts = [tok("3*4=")["input_ids"], tok("12*5=")["input_ids"]]
    row = bench.profile_decode(backend, prompts, 4, 40, skip=3, steps=4)
    assert row["rows"] == [8, 8, 8, 8]  # 2 prompts x 4 samples, one decode row each
    assert row["ms"]["matmul"] > 0 and row["ms"]["attention"] > 0 and row["ms"]["python_forward"] > 0
    assert abs(sum(row["ms"].values()) - row["step_ms"]) < 0.1  # the gap closes the sum (each rounded to 0.01)
    assert row["ms"]["unprofiled_gap"] > -0.05 * row["step_ms"]  # ... and is small, not a negative hole
    real, read = row["kv_positions"][0]
    assert 0 < real <= read
