"""The Reproductions grid: each paper's central comparison as ``dvc exp run`` experiments, with seeds and
paired intervals, at a task difficulty where no arm sits at the ceiling or the floor.

Every arm is one ``dvc exp run -n <exp>-<arm>-s<seed> -S ... evaluate@rl`` on the same upstream (curate, sft,
rollout, reward run once: ``rl.seed`` varies RL alone), so an arm costs its ``rl`` stage and the evaluation of
its RL model (``evaluate@<name>`` is one DVC stage per model); an arm two experiments share (GRPO) is
restored from DVC's run-cache. After each run the RL model's per-problem metrics are copied to
``experiments/results/runs/<run>.json``; then, per experiment:

- per arm and problem, the mean over seeds of each metric (greedy, pass@k); per pair of arms the mean
  difference and its paired-bootstrap 95% interval over problems (the same problems resampled jointly);
- the claim's verdict from those intervals: ``holds``, ``does not hold`` or ``inconclusive``;
- a plot: pass@k per arm (seed mean, band = min..max over seeds), ``experiments/results/<exp>.png``;
- ``experiments/results/<exp>.json`` and the table ``experiments/REPRODUCTIONS.md``.

    python experiments/reproduce.py [--only psr_nsr,entropy] [--seeds 3] [--analyze-only]

Run it in a clone with the pipeline's venv active (the stages run as ``python -m stages.X``). Wall time is
printed per run and in total.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain import metrics as M  # noqa: E402

RESULTS = REPO / "experiments" / "results"

# The harder task: a of 3..5 digits (the default 2..4 saturates: RL 98.5% greedy); room for the longer chain
DIFFICULTY = {"task.min_digits": 3, "task.max_digits": 5, "rollout.sampling.max_new_tokens": 96,
              "rl.sampling.max_new_tokens": 96, "evaluate.sampling.max_new_tokens": 96,
              "evaluate.num_samples": 64, "evaluate.ks": "[1,2,4,8,16,32,64]"}
# every knob an arm touches, at its default, so one run's -S never leaks into the next
DEFAULTS = {"rl.advantage": "grpo", "rl.dynamic_sampling": "skip", "rl.token_select": "all", "rl.token_rho": 0.2}

EXPERIMENTS: dict[str, dict[str, Any]] = {
    "psr_nsr": {
        "paper": "The Surprising Effectiveness of Negative Reinforcement (Zhu et al. 2025)",
        "setting": "Qwen2.5-Math-7B / Qwen3-4B, MATH, pass@k to 256",
        "arms": {"grpo": {}, "psr": {"rl.advantage": "psr", "rl.dynamic_sampling": "off"},
                 "nsr": {"rl.advantage": "nsr", "rl.dynamic_sampling": "off"},
                 "w_reinforce": {"rl.advantage": "w_reinforce", "rl.dynamic_sampling": "off"}},
        "claims": [("NSR >= base (SFT) at every k", "geq_all", "nsr", "base"),
                   ("PSR > base at pass@1", "gt_k1", "psr", "base"),
                   ("PSR < base at the largest k", "lt_kmax", "psr", "base"),
                   ("W-REINFORCE >= GRPO at every k", "geq_all", "w_reinforce", "grpo")],
    },
    "entropy": {
        "paper": "Beyond the 80/20 Rule: High-Entropy Minority Tokens (Wang et al. 2025)",
        "setting": "Qwen3-8B/14B/32B base, DAPO, AIME",
        "arms": {"grpo": {}, "top20": {"rl.token_select": "top_entropy", "rl.token_rho": 0.2},
                 "bottom80": {"rl.token_select": "bottom_entropy", "rl.token_rho": 0.2}},
        "claims": [("top-20% entropy tokens ~ all tokens (pass@1)", "approx_k1", "top20", "grpo"),
                   ("top-20% > bottom-80% (pass@1)", "gt_k1", "top20", "bottom80")],
    },
}


def dvc(*args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"dvc {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def run(name: str, overrides: dict[str, Any], target: str, model: str) -> dict[str, Any]:
    """One experiment (``dvc exp run``); its ``model``'s per-problem metrics saved and returned."""
    out = RESULTS / "runs" / f"{name}.json"
    if out.is_file():
        return json.loads(out.read_text())
    sets = [a for k, v in overrides.items() for a in ("-S", f"{k}={v}")]
    t = time.time()
    log = dvc("exp", "run", "-n", name, *sets, target)
    wall = time.time() - t
    folder = REPO / "reports" / "evaluate" / "models" / model
    keep = ("greedy", *(f"pass@{k}" for k in (1, 2, 4, 8, 16, 32, 64, 128, 256)))
    per = {split: {pid: {k: v for k, v in row.items() if k in keep} for pid, row in rows.items()}
           for split, rows in json.loads((folder / "per_problem.json").read_text()).items()}
    rec = {"name": name, "overrides": overrides, "wall_s": round(wall, 1),
           "stages_run": [ln.split("'")[1] for ln in log.splitlines() if ln.startswith("Running stage '")],
           "summary": json.loads((folder / "summary.json").read_text()), "per_problem": per}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec))
    print(f"{name}: {wall:.0f} s, ran {rec['stages_run']}", flush=True)
    return rec


def seed_mean(recs: list[dict[str, Any]], split: str = "eval") -> dict[str, dict[str, float]]:
    """problem id -> metric -> mean over the seeds' runs (problems every run scored)."""
    ids = set.intersection(*(set(r["per_problem"][split]) for r in recs))
    return {i: {k: float(np.mean([r["per_problem"][split][i][k] for r in recs]))
                for k in recs[0]["per_problem"][split][i]} for i in sorted(ids)}


def paired(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], key: str) -> dict[str, float]:
    """b - a over the problems both have that carry ``key``: mean difference and 95% paired-bootstrap CI."""
    ids = [i for i in a if i in b and key in a[i] and key in b[i]]
    xa, xb = [a[i][key] for i in ids], [b[i][key] for i in ids]
    lo, hi = M.paired_bootstrap_ci(xa, xb, 2000, 0)
    return {"diff": float(np.mean(xb) - np.mean(xa)), "lo": lo, "hi": hi, "n": len(ids)}


def verdict(kind: str, diffs: dict[str, dict[str, float]], ks: list[int]) -> str:
    """From paired intervals of (first arm - second arm) per metric."""
    k1, kmax = diffs["pass@1"], diffs[f"pass@{ks[-1]}"]
    if kind == "geq_all":  # no k at which the first is decidedly below the second
        below = [k for k in ks if diffs[f"pass@{k}"]["hi"] < 0]
        return "does not hold" if below else ("holds" if all(diffs[f"pass@{k}"]["lo"] > 0 for k in ks)
                                              else "holds (not below at any k; not above at every k)")
    if kind == "gt_k1":
        return "holds" if k1["lo"] > 0 else "does not hold" if k1["hi"] < 0 else "inconclusive"
    if kind == "lt_kmax":
        return "holds" if kmax["hi"] < 0 else "does not hold" if kmax["lo"] > 0 else "inconclusive"
    if kind == "approx_k1":  # equivalence within 2 points: the interval inside [-0.02, 0.02]
        return ("holds" if -0.02 <= k1["lo"] and k1["hi"] <= 0.02 else
                "does not hold" if k1["lo"] > 0.02 or k1["hi"] < -0.02 else "inconclusive")
    raise ValueError(kind)


def plot(exp: str, curves: dict[str, dict[str, list[float]]], ks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, c in curves.items():
        ax.plot(ks, c["mean"], marker="o", markersize=3, label=arm)
        ax.fill_between(ks, c["min"], c["max"], alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (held-out eval)")
    ax.set_title(f"{exp}: seed mean, band = min..max over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(EXPERIMENTS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--analyze-only", action="store_true", help="tables and plots from saved runs")
    args = ap.parse_args()
    t0 = time.time()
    ks = json.loads(DIFFICULTY["evaluate.ks"])
    base_run = run("repro-sft", {**DIFFICULTY, **DEFAULTS}, "evaluate@sft", "sft") if not args.analyze_only else \
        json.loads((RESULTS / "runs" / "repro-sft.json").read_text())
    exps = args.only.split(",")
    if not args.analyze_only:  # seed by seed over every arm, so a grid cut short still has every arm
        for s in range(1, args.seeds + 1):
            for exp in exps:
                for arm, over in EXPERIMENTS[exp]["arms"].items():  # an arm two experiments share is one run
                    run(f"repro-{arm}-s{s}", {**DIFFICULTY, **DEFAULTS, **over, "rl.seed": s}, "evaluate@rl", "rl")
    rows, report = [], {}
    for exp in exps:
        spec = EXPERIMENTS[exp]
        arms: dict[str, list[dict[str, Any]]] = {"base": [base_run]}
        for arm in spec["arms"]:
            files = [RESULTS / "runs" / f"repro-{arm}-s{s}.json" for s in range(1, args.seeds + 1)]
            arms[arm] = [json.loads(f.read_text()) for f in files if f.is_file()]
        missing = [a for a, recs in arms.items() if not recs]
        if missing:
            print(f"{exp}: no runs of {missing} yet; left out")
            continue
        means = {arm: seed_mean(recs) for arm, recs in arms.items()}
        keys = ["greedy", *(f"pass@{k}" for k in ks)]
        curves = {arm: {"mean": [float(np.mean([r["summary"]["eval"][f"pass@{k}"] for r in recs])) for k in ks],
                        "min": [min(r["summary"]["eval"][f"pass@{k}"] for r in recs) for k in ks],
                        "max": [max(r["summary"]["eval"][f"pass@{k}"] for r in recs) for k in ks]}
                  for arm, recs in arms.items()}
        claims = []
        for text, kind, a, b in spec["claims"]:
            diffs = {k: paired(means[b], means[a], k) for k in keys}  # a - b
            claims.append({"claim": text, "first": a, "second": b, "verdict": verdict(kind, diffs, ks),
                           "diffs": diffs})
        plot(exp, curves, ks, RESULTS / f"{exp}.png")
        report[exp] = {"paper": spec["paper"], "setting": spec["setting"],
                       "seeds": {a: len(recs) for a, recs in arms.items()}, "curves": curves,
                       "claims": claims, "arms": {a: [r["name"] for r in recs] for a, recs in arms.items()},
                       "wall_s": {a: [r["wall_s"] for r in recs] for a, recs in arms.items()}}
        (RESULTS / f"{exp}.json").write_text(json.dumps(report[exp], indent=1))
        for c in claims:
            d1, dk = c["diffs"]["pass@1"], c["diffs"][f"pass@{ks[-1]}"]
            rows.append(f"| {spec['paper']} ({spec['setting']}) | {c['claim']} | "
                        f"{100 * d1['diff']:+.1f} [{100 * d1['lo']:+.1f}, {100 * d1['hi']:+.1f}] | "
                        f"{100 * dk['diff']:+.1f} [{100 * dk['lo']:+.1f}, {100 * dk['hi']:+.1f}] | {c['verdict']} |")
    table = ["| paper (its setting) | claim | pass@1, first - second | "
             f"pass@{ks[-1]}, first - second | verdict here |", "|---|---|---:|---:|---|", *rows]
    text = "\n".join(["# Reproductions", "", "Generated by `python experiments/reproduce.py`; points, seed-mean per "
                      "problem, 95% paired-bootstrap interval over the held-out problems.", "", *table, ""])
    (REPO / "experiments" / "REPRODUCTIONS.md").write_text(text)
    print(text)
    print(f"total wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
