"""RL loop throughput on the default config: samples/s, tokens/s and where a step's time goes.

Runs the real ``rl`` stage (``stages.rl.run``) from the pipeline's SFT checkpoint and pass rates into a
temporary folder, for ``--steps`` steps, ``--repeats`` times, and prints a table. Needs the default
pipeline's outputs up to ``reward`` (``dvc repro reward``).

    python benchmarks/rl_throughput.py [--params params.yaml] [--steps 10] [--repeats 2]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from posttrain.config import load_params  # noqa: E402
from posttrain.runner import setup  # noqa: E402
from stages import rl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    base = load_params(args.params)
    params = base.model_copy(update={"rl": base.rl.model_copy(update={"steps": args.steps}),
                                     "runtime": base.runtime.model_copy(update={"progress": False})})
    setup(params)
    inputs, _ = rl.paths(params)
    rows = []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            outs = {k: Path(d) / k for k in ("model", "rl_dir", "checkpoints", "report_dir")}
            outs["metrics"] = Path(d) / "rl.json"
            t0 = time.time()
            rl.run(params, inputs, outs)
            wall = time.time() - t0
            log = list(csv.DictReader((outs["report_dir"] / "train_log.csv").open()))
        sps = [float(r["samples_per_s"]) for r in log]
        gen = sum(float(r["gen_s"]) for r in log)
        upd = sum(float(r["update_s"]) for r in log)
        rew = sum(float(r["reward_s"]) for r in log)
        samples = args.steps * params.rl.prompts_per_step * params.rl.group_size
        tokens = sum(float(r["response_len"]) for r in log) * params.rl.prompts_per_step * params.rl.group_size
        rows.append({"repeat": rep, "wall_s": wall, "samples_per_s": samples / (gen + upd + rew),
                     "tokens_per_s": tokens / (gen + upd + rew), "median_step_samples_per_s": statistics.median(sps),
                     "gen_s_per_step": gen / args.steps, "reward_s_per_step": rew / args.steps,
                     "update_s_per_step": upd / args.steps})
    cols = list(rows[0])
    print(f"rl throughput: B={params.rl.prompts_per_step} G={params.rl.group_size} "
          f"max_new_tokens={params.rl.sampling.max_new_tokens} steps={args.steps} "
          f"threads gen/train={params.runtime.generate_threads}/{params.runtime.train_threads}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
