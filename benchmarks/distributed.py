"""SFT and RL step throughput: one process with N threads vs N processes (torchrun, gloo) with 1 thread each.

Runs the real stage commands (``python -m stages.sft`` / ``stages.rl``, which relaunch themselves under torchrun
when ``runtime.distributed.nproc_per_node`` > 1) on the default model (Llama, 128 hidden, 4 layers) with the
default batch sizes, and reads their own timings from ``metrics/<stage>.json`` (the training loop only, not
process start-up): SFT seconds per step and tokens/s; RL seconds per step split into generation and update.
The SFT model the RL runs start from is trained once, at world size 1.

    python benchmarks/distributed.py [--threads 2] [--sft-steps 30] [--rl-steps 6]

prints a table and writes benchmarks/results/distributed_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from posttrain.runfacts import read_metrics

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def write_params(root: Path, upstream: Path, nproc: int, threads: int, strategy: str, sft_steps: int,
                 rl_steps: int) -> Path:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["paths"] = {k: str(root / v) for k, v in raw["paths"].items()}
    for k in ("curated_dir", "sft_model", "base_model", "reward_dir", "rollout_dir"):  # shared inputs
        raw["paths"][k] = str(upstream / Path(raw["paths"][k]).relative_to(root))
    raw["runtime"].update({"train_threads": threads, "generate_threads": threads, "progress": False,
                           "distributed": {"nproc_per_node": nproc, "strategy": strategy}})
    raw["tracking"]["enabled"] = False
    raw["sft"].update({"phases": [{"steps": sft_steps, "cot_frac": 1.0}], "micro_batch_size": 32,
                       "checkpoint_every": 1000})
    raw["rollout"]["num_prompts"] = 64
    raw["rl"].update({"steps": rl_steps, "dynamic_sampling": "off", "checkpoint_every": 1000,
                      "select": {"min_pass_rate": 0.0, "max_pass_rate": 1.0}})
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    return root / "params.yaml"


def stage(name: str, params: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", f"stages.{name}", "--params", str(params)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    raw = yaml.safe_load(params.read_text())
    return read_metrics(Path(raw["paths"]["metrics_dir"]) / f"{name}.json")  # with its run facts (timings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="cores to use: N threads x 1 process vs N processes")
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--rl-steps", type=int, default=6)
    args = ap.parse_args()
    n = args.threads
    arms = [(f"1 process x {n} threads", 1, n, "ddp"), (f"{n} processes x 1 thread (ddp)", n, 1, "ddp"),
            (f"{n} processes x 1 thread (fsdp2)", n, 1, "fsdp2")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        up = Path(tmp) / "upstream"
        p0 = write_params(up, up, 1, n, "ddp", args.sft_steps, args.rl_steps)
        for s in ("curate", "sft", "rollout", "reward"):
            stage(s, p0)
        for label, nproc, threads, strategy in arms:
            p = write_params(Path(tmp) / label.replace(" ", "_"), up, nproc, threads, strategy, args.sft_steps,
                             args.rl_steps)
            raw = yaml.safe_load(p.read_text())
            raw["paths"]["sft_model"] = str(Path(tmp) / label.replace(" ", "_") / "sft-model")
            sft_params = p.with_name("sft.yaml")
            sft_params.write_text(yaml.safe_dump(raw))
            sft = stage("sft", sft_params)
            rl = stage("rl", p)
            rows.append({"arm": label, "world_size": nproc, "threads_per_process": threads, "strategy": strategy,
                         "sft_s_per_step": sft["seconds_per_step"], "sft_tokens_per_s": sft["tokens_per_s"],
                         "rl_s_per_step": round(rl["seconds"] / args.rl_steps, 3),
                         "rl_gen_s_per_step": round(rl["gen_s"] / args.rl_steps, 3),
                         "rl_update_s_per_step": round(rl["update_s"] / args.rl_steps, 3),
                         "rl_samples_per_s": rl["samples_per_s"]})
            print(rows[-1], flush=True)
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    out = ROOT / "benchmarks" / "results" / "distributed_cpu.json"
    out.write_text(json.dumps({"command": " ".join(["python", "benchmarks/distributed.py", *sys.argv[1:]]),
                               "cpu_count": os.cpu_count(), "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
