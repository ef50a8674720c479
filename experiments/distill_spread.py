"""How much the distilled student moves with the seed, per distillation recipe, on fixed upstreams (issue 27).

Each ``--bases`` folder is an ``experiments/spread.py --upto all`` arm (curate through evaluate@student ran
there with its seed and CPU kernels). An arm of this script is a hard-linked copy of each base in which
``distill`` and ``evaluate --model student`` run again with the base's params plus ``--arm-set`` (the stages
replace their outputs whole, so the base is never written); the teacher, the student's cold start and their
evaluations are the base's. An arm with ``sft.*`` overrides changes the student's cold start too (they reach
only the distill stage here: the teacher stays the base's) and evaluates it again. ``--distill-seeds`` adds
``distill.seed`` arms on each base: the spread that the distillation's own sampling makes on one teacher and
one cold start.

It prints, per arm, the student's greedy and pass@1 per base, their range and standard deviation, and the
student minus its teacher (the rl model), and adds the arm to ``--out`` with, per model, the sampled
completions' chain-of-thought share and the accuracy within each format (``formats``). ``--resume`` keeps the
arm folders that finished with the same params (a killed arm goes on with the bases it had not done).

    python experiments/distill_spread.py --bases /tmp/spread/distill_base/seed*_default --root /tmp/distill_arms \\
        --arm steps90 --arm-set distill.on_policy.steps=90 --out benchmarks/results/distill_spread.json

Run from a snapshot of the repo (``git archive``), like the other experiments.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.code_rl import link_copy  # noqa: E402
from experiments.overopt import stage  # noqa: E402
from experiments.spread import ISAS, formats  # noqa: E402  (the base's kernels are named in its folder: seed<S>_<isa>)
from posttrain.config.overrides import parse_overrides, render_overrides  # noqa: E402
from posttrain.runfacts import read_metrics  # noqa: E402


def scores(folder: Path, model: str) -> dict[str, float]:
    ev = read_metrics(folder / "metrics" / "evaluate" / f"{model}.json")["eval"]
    return {k: ev[k] for k in ("greedy", "pass@1")}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def arm_params(base: Path, overrides: list[str]) -> str:
    """The arm's params file: the base's ``params.yaml`` plus ``overrides`` (a bad override is refused here)."""
    _, edits = parse_overrides(base / "params.yaml", overrides)
    return render_overrides((base / "params.yaml").read_text(), edits)


def finished(folder: Path, base: Path, params: str) -> bool:
    """The arm's own ``evaluate --model student`` ran in ``folder`` with these params (its copy starts as hard
    links to the base's files, and a stage replaces a file whole: the student's metrics are then no longer the
    base's)."""
    f, b = folder / "metrics" / "evaluate" / "student.json", base / "metrics" / "evaluate" / "student.json"
    d, bd = folder / "metrics" / "distill.json", base / "metrics" / "distill.json"
    p = folder / "params_arm.yaml"
    return (f.exists() and d.exists() and p.exists() and p.read_text() == params and not f.samefile(b)
            and not d.samefile(bd))


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
    ap.add_argument("--resume", action="store_true", help="keep an arm folder whose student this arm evaluated")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    cold_start = any(o.startswith("sft.") for o in a.arm_set)  # the student's cold start changes: evaluate it
    runs: dict[str, dict[str, Any]] = {}
    for base in a.bases:
        isa = base.name.rsplit("_", 1)[-1]
        for ds in a.distill_seeds:
            key = f"{base.name}/d{ds}"
            folder = base if a.reuse else a.root / a.arm / f"{base.name}_d{ds}"
            secs: dict[str, float] = {}
            params = arm_params(base, [*a.arm_set, f"distill.seed={ds}", "runtime.progress=false"])
            if a.resume and not a.reuse and finished(folder, base, params):
                print(f"{a.arm} {key}: kept {folder}", flush=True)
                secs = json.loads((folder / "arm_seconds.json").read_text()) if (folder / "arm_seconds.json"
                                                                                 ).exists() else {}
            elif not a.reuse:
                subprocess.run(["rm", "-rf", str(folder)], check=True)
                folder.parent.mkdir(parents=True, exist_ok=True)
                link_copy(base, folder)
                (folder / "params_arm.yaml").write_text(params)
                p = "params_arm.yaml"
                env = ISAS[isa]
                secs["distill"] = round(stage(folder, p, "distill", env=env), 1)
                for m in (["student_sft"] if cold_start else []) + ["student"]:
                    secs[f"evaluate@{m}"] = round(stage(folder, p, "evaluate", "--model", m, env=env), 1)
                (folder / "arm_seconds.json").write_text(json.dumps(secs))
            distill = read_metrics(folder / "metrics" / "distill.json")
            cold = folder if cold_start else base
            runs[key] = {"student": scores(folder, "student"), "student_sft": scores(cold, "student_sft"),
                         "rl": scores(base, "rl"), "seconds": secs,
                         "formats": {"student": formats(folder, "student"), "student_sft": formats(cold, "student_sft"),
                                     "rl": formats(base, "rl"), "sft": formats(base, "sft")},
                         "student_side_seconds": distill.get("student_side_seconds")}
            r, f = runs[key], runs[key]["formats"]
            print(f"{a.arm} {key}: student {100 * r['student']['greedy']:.1f} / {100 * r['student']['pass@1']:.1f}"
                  f"  cold start {100 * r['student_sft']['pass@1']:.1f}  teacher {100 * r['rl']['pass@1']:.1f}"
                  f"  student CoT {pct(f['student']['cot'])}% at {pct(f['student']['acc_cot'])}"
                  f" (cold start {pct(f['student_sft']['cot'])}% at {pct(f['student_sft']['acc_cot'])})"
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
