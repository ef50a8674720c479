"""bf16 on an x86 CPU without bf16 instructions gets one warning naming model.dtype (modeling.slow_bf16)."""

from __future__ import annotations

import logging

import pytest
import torch

from posttrain.modeling import models


@pytest.mark.parametrize(("bf16", "amx", "dtype", "device", "warned"), [
    (False, False, "bfloat16", "cpu", True),    # the AMD EPYC of docs/performance.md: bf16 at a fifth of fp32
    (True, False, "bfloat16", "cpu", False),    # AVX512-BF16
    (False, True, "bfloat16", "cpu", False),    # AMX
    (False, False, "float32", "cpu", False),
    (False, False, "bfloat16", "meta", False),  # not a CPU run
])
def test_bf16_on_a_cpu_without_bf16_instructions_is_warned(monkeypatch, caplog, bf16, amx, dtype, device, warned):
    monkeypatch.setattr(models.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        assert models.slow_bf16(dtype, device) is warned
    assert ("model.dtype" in caplog.text) is warned


def test_an_arm_cpu_is_not_judged_by_x86_flags(monkeypatch):
    monkeypatch.setattr(models.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert not models.slow_bf16("bfloat16", "cpu")


def test_load_model_checks_its_dtype(monkeypatch, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path)
    seen = []
    monkeypatch.setattr(models, "slow_bf16", lambda dtype, device: seen.append((dtype, str(device))))
    models.load_model(str(tmp_path), "bfloat16")
    assert seen == [("bfloat16", "cpu")]
