"""How much the distilled student moves with the seed, per distillation recipe, on fixed upstreams (issue 27).

Each ``--bases`` folder is an ``experiments/spread.py --upto all`` arm (curate through evaluate@student ran
there with its seed and CPU kernels). An arm of this script is a hard-linked copy of each base in which
``distill`` and ``evaluate --model student`` run again with the base's params plus ``--arm-set`` (the stages
replace their outputs whole, so the base is never written); the teacher, the student's cold start and their
evaluations are the base's. ``--distill-seeds`` adds ``distill.seed`` arms on each base: the spread that the
distillation's own sampling makes on one teacher and one cold start.

It prints, per arm, the student's greedy and pass@1 per base, their range and standard deviation, and the
student minus its teacher (the rl model), and adds the arm to ``--out``.

    python experiments/distill_spread.py --bases /tmp/spread/distill_base/seed*_default --root /tmp/distill_arms \\
        --arm steps90 --arm-set distill.on_policy.steps=90 --out benchmarks/results/distill_spread.json

Run from a snapshot of the repo (``git archive``), like the other experiments.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.code_rl import link_copy, write_params  # noqa: E402

ISAS = {"default": {},  # experiments/spread.py's: the base's kernels are named in its folder (seed<S>_<isa>)
        "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def stage(folder: Path, params: str, isa: str, *args: str) -> float:
    """``python -m stages.<args>`` in ``folder`` under the base's CPU kernels; seconds taken."""
    env = {**os.environ, **ISAS[isa], "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
    t = time.time()
    with open(folder / "log.txt", "a") as log:
        rc = subprocess.run([sys.executable, "-m", f"stages.{args[0]}", "--params", params, *args[1:]], cwd=folder,
                            env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{folder}: {' '.join(args)} exited {rc} (see {folder}/log.txt)")
    return time.time() - t


def scores(folder: Path, model: str) -> dict[str, float]:
    ev = json.loads((folder / "metrics" / "evaluate" / f"{model}.json").read_text())["eval"]
    return {k: ev[k] for k in ("greedy", "pass@1")}


def summary(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Range and population sd of the student's greedy and pass@1 over the runs, and the student - teacher gap."""
    out: dict[str, Any] = {}
    for k in ("greedy", "pass@1"):
        v = [r["student"][k] for r in runs.values()]
        gap = [r["student"][k] - r["rl"][k] for r in runs.values()]
        out[k] = {"min": min(v), "max": max(v), "range": round(max(v) - min(v), 4),
                  "sd": round(statistics.pstdev(v), 4), "mean": round(statistics.fmean(v), 4),
                  "student_minus_teacher_mean": round(statistics.fmean(gap), 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bases", type=Path, nargs="+", required=True, help="spread.py --upto all arm folders")
    ap.add_argument("--root", type=Path, default=Path("/tmp/distill_arms"))
    ap.add_argument("--arm", required=True, help="the arm's name")
    ap.add_argument("--arm-set", nargs="*", default=[], help="the arm's distill overrides")
    ap.add_argument("--distill-seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--reuse", action="store_true", help="the base's own distill ran this arm: only read it")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    runs: dict[str, dict[str, Any]] = {}
    for base in a.bases:
        isa = base.name.rsplit("_", 1)[-1]
        for ds in a.distill_seeds:
            key = f"{base.name}/d{ds}"
            folder = base if a.reuse else a.root / a.arm / f"{base.name}_d{ds}"
            secs: dict[str, float] = {}
            if not a.reuse:
                subprocess.run(["rm", "-rf", str(folder)], check=True)
                folder.parent.mkdir(parents=True, exist_ok=True)
                link_copy(base, folder)
                p = write_params(folder, "params_arm.yaml", base / "params.yaml",
                                 [*a.arm_set, f"distill.seed={ds}", "runtime.progress=false"])
                secs["distill"] = round(stage(folder, p, isa, "distill"), 1)
                secs["evaluate@student"] = round(stage(folder, p, isa, "evaluate", "--model", "student"), 1)
            distill = json.loads((folder / "metrics" / "distill.json").read_text())
            runs[key] = {"student": scores(folder, "student"), "student_sft": scores(base, "student_sft"),
                         "rl": scores(base, "rl"), "seconds": secs,
                         "student_side_seconds": distill.get("student_side_seconds")}
            r = runs[key]
            print(f"{a.arm} {key}: student {100 * r['student']['greedy']:.1f} / {100 * r['student']['pass@1']:.1f}"
                  f"  cold start {100 * r['student_sft']['pass@1']:.1f}  teacher {100 * r['rl']['pass@1']:.1f}"
                  f"  {secs}", flush=True)
    rec = {"overrides": a.arm_set, "distill_seeds": a.distill_seeds, "runs": runs, "summary": summary(runs)}
    with open(a.out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = json.loads(a.out.read_text()) if a.out.exists() else {}
        res.setdefault("arms", {})[a.arm] = rec
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    s = rec["summary"]
    print(f"{a.arm} ({' '.join(a.arm_set) or 'params as given'}): " + "; ".join(
        f"{k} mean {100 * v['mean']:.1f}, range {100 * v['min']:.1f}-{100 * v['max']:.1f} ({100 * v['range']:.1f}), "
        f"sd {100 * v['sd']:.1f}, student - teacher {100 * v['student_minus_teacher_mean']:+.1f}"
        for k, v in s.items()), flush=True)


if __name__ == "__main__":
    main()
