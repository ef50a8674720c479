"""The memory plan (``posttrain plan``): one update step of our own code under the fake process group and fake
tensors, measured by torch's FSDPMemTracker."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, tiny_raw

from posttrain import plan
from posttrain.config import parse_params

QWEN7B = REPO / "benchmarks" / "model_configs" / "qwen2.5-7b.json"


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_the_plan_of_a_small_qwen2_at_2_ranks_shards_what_fsdp2_shards():
    raw = tiny_raw(None)
    raw["rl"]["kl_coef"], raw["distill"]["grpo_steps"] = 0.1, 0  # a KL reference: sharded as the policy is
    raw["runtime"]["distributed"]["strategy"] = "fsdp2"
    raw["distill"]["student"] = {"layers": 1}  # the teacher cut to one layer
    p = parse_params(raw)
    config = plan.load_config(REPO / "benchmarks" / "model_configs" / "qwen2.5-1.5b.json")
    config.num_hidden_layers, config.vocab_size = 2, 1024  # the 1.5B's layer shapes, two of them
    n = 2 * (1536 * (1536 + 256 * 2 + 1536) + 3 * 1536 * 8960 + 2 * 1536 + 1536 + 256 * 2) + 1024 * 1536 + 1536
    # per layer: q (1536 x 1536 + bias 1536), k and v (256 x 1536 + bias 256 each), o (1536 x 1536), the MLP's
    # three 1536 x 8960, two norms; tied embedding 1024 x 1536; the final norm 1536
    rows = {r["stage"]: r for r in plan.plan(config, p, 2, 80.0, 64)}
    gib = 2**30
    assert abs(rows["sft"]["Params"] - 4 * n / 2 / gib) < 1e-5  # fp32 masters, half on this rank
    assert abs(rows["sft"]["OptState"] - 2 * 4 * n / 2 / gib) < 1e-5  # Adam's two moments of the shard
    assert abs(rows["rl"]["Frozen model"] - 4 * n / 2 / gib) < 1e-5 and rows["sft"]["Frozen model"] == 0  # a shard
    assert abs(rows["distill"]["Frozen model"] - 4 * n / gib) < 1e-5  # the teacher, whole: it also generates
    assert all(r["verdict"] == "fits" for r in rows.values())
    assert rows["sft"]["Full copy"] == 0 < rows["rl"]["Full copy"]  # sft never makes the generation copy
    assert rows["distill"]["Params"] < 0.8 * rows["rl"]["Params"]  # one layer of two, the same embeddings
    tight = plan.plan(config, p, 2, 0.01, 64, ("sft",))[0]
    assert tight["verdict"].startswith("needs ")
    raw["rollout"]["backend"] = "vllm"  # issue 50 item 1: the engine takes the weights streamed, no full copy
    streamed, student = plan.plan(config, parse_params(raw), 2, 80.0, 64, ("rl", "distill"))
    assert streamed["Full copy"] == 0 < rows["rl"]["Full copy"] and streamed["Engine"] > 0
    assert student["Full copy"] > 0  # distill's student samples on the hf backend whatever rollout.backend says
    raw["rollout"]["backend"] = "hf"
    raw["model"]["lora"] = {"r": 8, "alpha": 16, "target_modules": "all-linear"}  # DDP: the whole base per rank
    raw["runtime"]["distributed"]["strategy"] = "ddp"
    (lora,) = plan.plan(config, parse_params(raw), 2, 80.0, 64, ("sft",))
    assert lora["strategy"] == "ddp" and abs(lora["Params"] - 4 * n / gib) < 0.01 * 4 * n / gib
    assert lora["OptState"] < 0.05 * rows["sft"]["OptState"]


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_the_fp32_trainer_sampling_under_bf16_autocast_holds_a_bf16_cast_of_each_linear_weight():
    """The hf backend samples on the trainer's fp32 masters inside the bf16 autocast region, and autocast keeps a
    cast of every linear weight it used until the region ends: 2 bytes per linear weight in the generation phase.
    None in fp32, none from FSDP2's generation copy (kept in bf16) and none for a frozen bf16 LoRA base."""
    raw = tiny_raw(None)
    raw["model"]["dtype"], raw["runtime"]["distributed"]["strategy"] = "bfloat16", "ddp"
    config = plan.load_config(REPO / "benchmarks" / "model_configs" / "qwen2.5-1.5b.json")
    config.num_hidden_layers, config.vocab_size = 2, 1024
    linear = 2 * (1536 * 1536 * 2 + 256 * 1536 * 2 + 3 * 1536 * 8960 + 1536 + 256 * 2) + 1024 * 1536
    # per layer q, o (1536 x 1536), k, v (256 x 1536), the MLP's three 1536 x 8960, the biases of q, k, v (1536,
    # 256, 256); the LM head, tied to the embedding (one tensor, cast once); norms are not linear layers
    gib = 2**30
    (rl,) = plan.plan(config, parse_params(raw), 1, 80.0, 64, ("rl",))
    assert abs(rl["Autocast cache"] - 2 * linear / gib) < 1e-6  # (the rows round to 1e-6 GiB)
    resident = rl["Params"] + rl["OptState"] + rl["Full copy"] + rl["Frozen model"] + rl["Engine"]
    assert abs(rl["Generation peak"] - resident - rl["Autocast cache"]) < 1e-5
    raw["model"]["dtype"] = "float32"
    assert plan.plan(config, parse_params(raw), 1, 80.0, 64, ("rl",))[0]["Autocast cache"] == 0
    raw["model"]["dtype"], raw["runtime"]["distributed"]["strategy"] = "bfloat16", "fsdp2"
    assert plan.plan(config, parse_params(raw), 2, 80.0, 64, ("rl",))[0]["Autocast cache"] == 0
    raw["runtime"]["distributed"]["strategy"] = "ddp"
    raw["model"]["lora"] = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
    (lora,) = plan.plan(config, parse_params(raw), 1, 80.0, 64, ("rl",))
    assert 0 < lora["Autocast cache"] < 0.02 * rl["Autocast cache"]  # the fp32 adapters only


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_the_cli_prints_the_table_and_refuses_a_wrong_stage_in_one_line(tmp_path):
    out, config, params = tmp_path / "plan.json", tmp_path / "config.json", tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text().replace("strategy: ddp", "strategy: fsdp2", 1))
    config.write_text(json.dumps({**json.loads(QWEN7B.read_text()), "num_hidden_layers": 1}))  # 7B's layer, once
    n = 3584 * (3584 + 512 * 2 + 3584) + 3584 + 512 * 2 + 3 * 3584 * 18944 + 2 * 3584 + 2 * 152064 * 3584 + 3584
    cmd = [sys.executable, "-m", "posttrain.cli", "plan", "-p", str(params), "--model",
           str(config), "--world", "8", "--seq-len", "16", "--stages", "sft", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["stage"] == "sft" and abs(row["Params"] - n * 4 / 8 / 2**30) < 1e-5
    assert "| sft | " in r.stdout
    bad = subprocess.run(cmd[:-4] + ["--stages", "sfx"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["posttrain: --stages: 'sfx': choose from "
                                                                        "sft, rl, distill"]
