"""Asynchronous RL at equal samples: held-out pass@1 and wall time of the ``rl`` stage, synchronous vs
``rl.overlap`` with ``max_staleness`` 1, 2, 4 (k = 0 is the synchronous loop bit for bit: tests/test_overlap.py),
seeds ``rl.seed`` 0, 1, 2 on one shared upstream.

The upstream (curate, sft, rollout, reward on the default params) is a folder where those stages ran, e.g. the
over-optimisation experiment's ``/tmp/overopt/base`` (``experiments/overopt.py``); each run is a hard-linked copy
of it (the stages replace files whole), then ``python -m stages.rl`` and ``stages.evaluate --model rl`` on the
eval split (200 problems: greedy, and pass@1 of ``evaluate.samples_per_prompt`` samples). Arms: ``sync``
(params' 2 threads, the loop users run) and ``k1``, ``k2``, ``k4`` (one generator process of 1 torch thread,
a trainer of 1 thread: generation on one core, training on the other). Every run trains on the same number of
samples (``rl.steps`` x B x G; dynamic sampling ``skip`` drops the same kind of groups in every arm). Arms
alternate within each seed. Reported: per arm the wall time of the rl stage (process start, model loads and the
generator's spawn included), and held-out pass@1 and greedy, each arm minus ``sync`` with a 95% paired bootstrap
over problems (seed means), and per seed.

    python experiments/async_rl.py --upstream /tmp/overopt/base --root /tmp/async_rl \\
        --out experiments/results/async_rl.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.overopt import stage, write_params  # noqa: E402
from experiments.overopt_report import paired  # noqa: E402

ARMS = {"sync": None, "k1": 1, "k2": 2, "k4": 4}  # rl.overlap.max_staleness (None: rl.overlap null)


def run(upstream: Path, root: Path, arm: str, seed: int, steps: int, common: list[str]) -> dict[str, Any]:
    folder = root / arm / f"s{seed}"
    done = folder / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(upstream), str(folder)], check=True)
    k = ARMS[arm]
    overlap = "null" if k is None else (f"{{max_staleness: {k}, generators: 1, generator_threads: 1, "
                                        "trainer_threads: 1}")
    p = write_params(folder, "params_async.yaml", [*common, f"rl.seed={seed}", f"rl.steps={steps}",
                                                   f"rl.overlap={overlap}", "report.compare=[]"])
    t = time.time()
    rl_s = stage(folder, p, "rl")
    eval_s = stage(folder, p, "evaluate", "--model", "rl")
    per = json.loads((folder / "reports" / "evaluate" / "models" / "rl" / "per_problem.json").read_text())["eval"]
    m = json.loads((folder / "metrics" / "rl.json").read_text())
    rec = {"arm": arm, "seed": seed, "rl_s": round(rl_s, 1), "evaluate_s": round(eval_s, 1),
           "total_s": round(time.time() - t, 1), "samples": m["samples"], "staleness": m.get("staleness"),
           "final_reward": m.get("final_reward"),
           "heldout": {pid: {"greedy": r["greedy"], "pass@1": r.get("pass@1")} for pid, r in per.items()}}
    done.write_text(json.dumps(rec))
    return rec


def seed_mean(recs: list[dict[str, Any]], key: str) -> dict[str, float]:
    ids = set.intersection(*(set(r["heldout"]) for r in recs))
    return {i: float(np.mean([r["heldout"][i][key] for r in recs])) for i in sorted(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", type=Path, default=Path("/tmp/overopt/base"))
    ap.add_argument("--root", type=Path, default=Path("/tmp/async_rl"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    common = ["runtime.progress=false", "evaluate.samples_per_prompt=4", "evaluate.ks=[1,4]",
              "evaluate.sample_prompts=null", "rl.save_steps=[]"]
    runs: dict[str, list[dict[str, Any]]] = {}
    for seed in a.seeds:
        for arm in a.arms[seed % len(a.arms):] + a.arms[: seed % len(a.arms)]:  # the order rotates per seed
            rec = run(a.upstream, a.root, arm, seed, a.steps, common)
            runs.setdefault(arm, []).append(rec)
            print(f"{arm} s{seed}: rl {rec['rl_s']} s, samples {rec['samples']}, pass@1 "
                  f"{np.mean([v['pass@1'] for v in rec['heldout'].values()]):.4f}", flush=True)
    res: dict[str, Any] = {"settings": vars(a) | {"upstream": str(a.upstream), "root": str(a.root),
                                                  "out": str(a.out)}, "arms": {}}
    for arm, recs in runs.items():
        row = {"seeds": [r["seed"] for r in recs], "rl_s": [r["rl_s"] for r in recs],
               "samples": [r["samples"] for r in recs], "final_reward": [r["final_reward"] for r in recs],
               "staleness": [r["staleness"] for r in recs]}
        for key in ("pass@1", "greedy"):
            row[key] = [round(float(np.mean([v[key] for v in r["heldout"].values()])), 4) for r in recs]
            if arm != "sync" and "sync" in runs:
                row[f"{key}_minus_sync"] = paired(seed_mean(runs["sync"], key), seed_mean(recs, key))
        res["arms"][arm] = row
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print("\n| arm | rl s per seed (median) | pass@1 per seed | pass@1 - sync [95%] | greedy - sync [95%] |")
    print("|---|---|---|---|---|")
    for arm, row in res["arms"].items():
        def cell(d: dict[str, float] | None) -> str:
            return "-" if d is None else f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"

        print(f"| {arm} | {', '.join(map(str, row['rl_s']))} ({np.median(row['rl_s']):.1f}) | "
              f"{', '.join(f'{100 * x:.1f}' for x in row['pass@1'])} | {cell(row.get('pass@1_minus_sync'))} | "
              f"{cell(row.get('greedy_minus_sync'))} |")


if __name__ == "__main__":
    main()
