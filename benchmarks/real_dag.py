"""The real-run profile's DAG on a Qwen2-architecture random-weight model: stage times and peak memory.

Builds a base model folder and a smaller same-tokenizer "pretrained" student (tests/realmodel.py: byte-level BPE
tokenizer trained on the shared GSM8K/MATH text, ChatML template, <|im_end|> turns), derives params from
``profiles/real-gsm8k.yaml`` (LoRA, bf16 on a GPU, gradient checkpointing; local GSM8K/MATH-500 files instead
of the hub; counts shrunk to fit), and runs the seven stages' ``run()`` in order in this process. Per stage:
wall time and peak GPU memory (``torch.cuda.max_memory_allocated``, reset before each stage); on CPU the
process's peak RSS so far. Random weights learn nothing (with a 151,936-row head they rarely emit a
token the 1,024-token tokenizer has); the point is that the path runs at this size, and what it costs.

    python benchmarks/real_dag.py --shape qwen2.5-0.5b   # on a GPU: Qwen2.5-0.5B's shape (494M parameters)
    python benchmarks/real_dag.py --shape tiny            # anywhere, in about a minute

prints a table and writes benchmarks/results/real_dag_<shape>_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from posttrain.config import parse_params  # noqa: E402
from tests.realmodel import BENCH, QWEN25_05B, save_folder  # noqa: E402

SHAPES = {
    "tiny": ({"hidden": 32, "layers": 2}, {"hidden": 16, "layers": 1}, 64),
    "qwen2.5-0.5b": (QWEN25_05B, {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 2048,
                                  "tie": True, "model_vocab": 151_936}, 256),
}
STAGES = ("curate", "sft", "rollout", "reward", "rl", "distill", "evaluate")


def params(work: Path, base: Path, student: Path, new_tokens: int, gpu: bool) -> dict:
    raw = yaml.safe_load((ROOT / "profiles" / "real-gsm8k.yaml").read_text())

    def src(name: str, fmt: str, limit: int | None) -> dict:
        return {"kind": "file", "name": name, "path": str(BENCH / f"{name}.jsonl"), "format": fmt, "limit": limit}

    raw["paths"] = {k: str(work / v) for k, v in raw["paths"].items()}
    raw["evaluate"]["models"] = {k: raw["paths"][f"{k}_model"] for k in ("base", "sft", "rl", "student_sft", "student")}
    raw["distill"]["teacher"] = raw["paths"]["rl_model"]
    raw["model"].update({"base": str(base), "dtype": "bfloat16" if gpu else "float32"})
    raw["curate"].update({"sources": [src("gsm8k_train", "gsm8k", 800)], "sft_size": 320})
    raw["curate"]["eval"] = {"source": src("gsm8k_test", "gsm8k", 100), "rows": 32}
    raw["curate"]["decontam"]["benchmarks"] = [src("math500", "math", None), src("aime24", "math", None)]
    raw["sft"].update({"phases": [{"steps": 10, "cot_frac": 1.0}], "batch_size": 32, "micro_batch_size": 16})
    raw["rollout"].update({"num_prompts": 64, "samples_per_prompt": 8})
    raw["rl"].update({"steps": 3, "prompts_per_step": 32, "samples_per_prompt": 8, "micro_batch_size": 32,
                      "kl_coef": 0.01, "dynamic_sampling": "off",
                      "select": {"min_pass_rate": 0.0, "max_pass_rate": 1.0}})
    raw["distill"].update({"student": str(student), "max_new_tokens": new_tokens, "micro_batch_size": 32})
    for phase in ("warmup", "on_policy"):
        raw["distill"][phase].update({"steps": 2, "prompts_per_step": 16, "samples_per_prompt": 4})
    raw["evaluate"].update({"samples_per_prompt": 4, "sample_prompts": 16, "ks": [1, 2, 4], "bootstrap": 200,
                            "benchmarks": [src("math500", "math", 16)]})
    for sec in (raw["rollout"], raw["rl"], raw["evaluate"]):
        sec["sampling"]["max_new_tokens"] = new_tokens
    raw["tracking"]["enabled"] = False
    raw["runtime"]["progress"] = True
    return raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    work = a.work or Path(tempfile.mkdtemp())
    base_shape, student_shape, new_tokens = SHAPES[a.shape]
    base = save_folder(work / "base-folder", vocab_size=1024, **base_shape)
    student = save_folder(work / "student-folder", vocab_size=1024, seed=1, **student_shape)
    p = parse_params(params(work, base, student, new_tokens, gpu))
    rows = []
    out = ROOT / "benchmarks" / "results" / f"real_dag_{a.shape}_{'cuda' if gpu else 'cpu'}.json"
    for name in STAGES:
        mod = __import__(f"stages.{name}", fromlist=["run", "paths"])
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        metrics = mod.run(p, *mod.paths(p))
        if gpu:
            torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                * 1024) / 2**30
        rows.append({"stage": name, "seconds": round(time.time() - t0, 1), "peak_gib": round(peak, 2),
                     "metrics": {k: v for k, v in metrics.items() if isinstance(v, int | float)}})
        print(json.dumps(rows[-1]), flush=True)
        out.write_text(json.dumps({"shape": a.shape, "stages": rows}, indent=1) + "\n")  # so far, if killed
    device = torch.cuda.get_device_name() if gpu else "cpu"
    from transformers import AutoModelForCausalLM

    n_params = sum(x.numel() for x in AutoModelForCausalLM.from_pretrained(base).parameters())
    print(f"\n{a.shape} ({n_params / 1e6:.0f}M parameters, LoRA r={p.model.lora.r}, {p.model.dtype}) on {device}")
    print(f"{'stage':10} {'seconds':>8} {'peak GiB':>9}" + ("  (GPU, max_memory_allocated)" if gpu else
                                                            "  (process peak RSS so far)"))
    for r in rows:
        print(f"{r['stage']:10} {r['seconds']:8.1f} {r['peak_gib']:9.2f}")
    out.write_text(json.dumps({"shape": a.shape, "params": n_params, "device": device, "dtype": p.model.dtype,
                               "stages": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
