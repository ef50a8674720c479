"""checkpoint.py in one process: what a resumable checkpoint holds and what deciding to resume reads.

The distributed halves (FSDP2 shards, resume at another world size) are in ``tests/test_distributed.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain import checkpoint, modeling
from posttrain.config import LoraCfg, TinyModel

SHAPE = TinyModel(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


def _model(lora: bool, seed: int = 0) -> torch.nn.Module:
    tok = modeling.build_char_tokenizer()
    model = modeling.build_tiny_model(SHAPE, tok, 0)
    torch.manual_seed(seed)  # peft draws lora_A from torch's global generator
    return modeling.make_trainable(model, LoraCfg(r=4, alpha=8) if lora else None, False)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    """One AdamW step on a fixed batch (k picks which)."""
    ids = torch.arange(k, k + 24).reshape(2, 12) % 90 + 4
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_deciding_to_resume_reads_only_the_sidecar(tmp_path, monkeypatch):
    """Whether a checkpoint matches this run is in its meta.json: neither torch.load nor DCP runs, for a
    match or a mismatch (which moves the folder aside)."""
    model = _model(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 0)
    checkpoint.save(tmp_path / "ck", 3, "aaaa", model, opt, {"log": []})
    meta = json.loads((tmp_path / "ck" / "step_0000003" / "meta.json").read_text())
    assert meta["fingerprint"] == "aaaa" and meta["step"] == 3 and meta["world"] == 1
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran"))
    monkeypatch.setattr(checkpoint.dcp, "load", lambda *a, **k: pytest.fail("dcp.load ran"))
    assert checkpoint.find(tmp_path / "ck", "aaaa") == tmp_path / "ck" / "step_0000003"
    assert checkpoint.find(tmp_path / "ck", "bbbb") is None
    (aside,) = tmp_path.glob("ck.stale-aaaa-*")


def test_a_checkpoint_of_the_single_file_format_is_moved_aside(tmp_path):
    ck = tmp_path / "sft"
    ck.mkdir()
    torch.save({"fingerprint": "aaaa", "step": 5}, ck / "step_0000005.pt")
    assert checkpoint.find(ck, "aaaa") is None
    (aside,) = tmp_path.glob("sft.stale-format1-*")
    assert (aside / "step_0000005.pt").is_file()


def test_a_killed_save_is_not_resumed_from_and_the_newest_two_are_kept(tmp_path):
    model = _model(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 0)
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, step, "fp", model, opt, {})
    (tmp_path / ".step_0000008.partial").mkdir()  # a save killed before its rename
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000004", "step_0000006"]
    assert checkpoint.find(tmp_path, "fp").name == "step_0000006"


def test_lora_checkpoint_holds_the_adapters_and_their_moments_and_resumes_exactly(tmp_path):
    """A LoRA checkpoint holds the trainable parameters (lora_A/lora_B) and their AdamW moments only, not the
    frozen base: on this 2-layer model (adapters 10% of the parameters) it is under a third of the full
    fine-tuning checkpoint. Restored into a fresh model (other adapter init) and optimizer, the next step
    gives exactly the weights of the uninterrupted run."""
    sizes = {}
    for lora in (True, False):
        model = _model(lora)
        opt = torch.optim.AdamW(modeling.trainable_params(model), lr=1e-2)
        _step(model, opt, 0)
        path = checkpoint.save(tmp_path / str(lora), 1, "fp", model, opt, {"log": []})
        sizes[lora] = _size(path)
        msd, _ = checkpoint.model_state(model, opt)
        if lora:
            assert msd and all("lora_" in k for k in msd)
            n_trainable = sum(p.numel() for p in modeling.trainable_params(model))
            assert sum(v.numel() for v in msd.values()) == n_trainable < modeling.num_params(model) / 5
            _step(model, opt, 1)
            uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}
    print(f"checkpoint bytes: LoRA r=4 {sizes[True]:,}, full {sizes[False]:,} ({sizes[True] / sizes[False]:.1%})")
    # 10% of the parameters; DCP's per-tensor overhead (~1 KB each, 224 small tensors) weighs on a model this small
    assert sizes[True] < sizes[False] / 3

    fresh = _model(True, seed=1)  # other adapter draws: the checkpoint must overwrite them
    opt = torch.optim.AdamW(modeling.trainable_params(fresh), lr=1e-2)
    rest = checkpoint.restore(tmp_path / "True", "fp", fresh, opt)
    assert rest["step"] == 1 and rest["log"] == []
    _step(fresh, opt, 1)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, uninterrupted[k], rtol=0, atol=0, msg=k)


def test_rng_states_round_trip_through_weights_only_load(tmp_path):
    model = _model(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 0)
    torch.manual_seed(5)
    extra = {"prior": {"p": {"a": np.float64(0.5)}, "n": {"a": 2.0}}, "seen": np.arange(3)}  # numpy: as Python
    checkpoint.save(tmp_path, 1, "fp", model, opt, {"extra": extra})
    want = (torch.rand(3), np.random.rand(2).tolist(), random.random())
    rest = checkpoint.restore(tmp_path, "fp", model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert rest["extra"] == {"prior": {"p": {"a": 0.5}, "n": {"a": 2.0}}, "seen": [0, 1, 2]}
    got = (torch.rand(3), np.random.rand(2).tolist(), random.random())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


@pytest.mark.parametrize("lora", [False, True])
def test_artifacts_are_saved_in_model_dtype_and_load_back(tmp_path, lora):
    """model.dtype bfloat16: the HF folder holds bf16 weights (half the fp32 bytes; the tied head saved once) and
    says so in config.json; it loads for inference in bf16 and as fp32 masters for training, and its digest
    is stable. The model in memory is untouched. float32 (the default) writes what it always wrote."""
    tok = modeling.build_char_tokenizer()
    model = _model(lora)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modeling.save_checkpoint(model, tok, tmp_path / "fp32")
    modeling.save_checkpoint(model, tok, tmp_path / "bf16", "bfloat16")
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
    from safetensors.torch import load_file

    w32, w16 = (load_file(tmp_path / d / "model.safetensors") for d in ("fp32", "bf16"))
    assert w16.keys() == w32.keys() and {v.dtype for v in w16.values()} == {torch.bfloat16}
    assert all(torch.equal(w16[k], w32[k].to(torch.bfloat16)) for k in w32)
    size = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16")}
    assert size["bf16"] < 0.52 * size["fp32"]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    assert (tmp_path / "bf16" / "adapter").is_dir() == lora
    inference = modeling.load_model(str(tmp_path / "bf16"), "bfloat16")
    masters = modeling.load_model(str(tmp_path / "bf16"), "bfloat16", trainable=True)
    assert inference.dtype == torch.bfloat16 and masters.dtype == torch.float32
    for (k, a), b in zip(inference.named_parameters(), masters.parameters(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16)) and torch.equal(a, w16.get(k, w16["model.embed_tokens.weight"]))
    assert modeling.checkpoint_digest(tmp_path / "bf16") == modeling.checkpoint_digest(tmp_path / "bf16")
    assert modeling.checkpoint_digest(tmp_path / "bf16") != modeling.checkpoint_digest(tmp_path / "fp32")
