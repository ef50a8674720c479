"""The Reproductions grid: each paper's central comparison as ``dvc exp run`` experiments, with seeds and
paired intervals, at a task difficulty where no arm sits at the ceiling or the floor. The grid itself (arms,
claims, difficulty) is ``experiments/grid.py``.

Every arm is one ``dvc exp run -n repro-<arm>-s<seed> -S ... evaluate@rl`` on the same upstream (curate, sft,
rollout, reward run once: ``rl.seed`` varies RL alone), so an arm costs its ``rl`` stage and the evaluation of
its RL model (``evaluate@<name>`` is one DVC stage per model); a stage an earlier run already ran with the same
inputs is restored from DVC's run-cache. The distillation arms target ``evaluate@student`` and are seeded by
``distill.seed`` (teacher and cold start fixed). After each run the evaluated model's per-problem metrics (and
metrics/rl.json, metrics/distill.json) are copied to ``experiments/results/runs/<run>.json``, which also makes
a re-run skip it; then, per experiment:

- per arm and problem, the mean over seeds of each metric (greedy, pass@k); per pair of arms the mean
  difference and its paired-bootstrap 95% interval over problems (the same problems resampled jointly);
- the claim's verdict from those intervals: ``holds``, ``does not hold`` or ``inconclusive``;
- a plot: pass@k per arm (seed mean, band = min..max over seeds), ``experiments/results/<exp>.png``;
- ``experiments/results/<exp>.json`` and the table ``experiments/REPRODUCTIONS.md``.

    python experiments/reproduce.py [--only psr_nsr,psr_nsr_k256,entropy,one_shot,prior,prorl,distill]
                                    [--seeds 3] [--analyze-only]

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

from experiments.grid import DEFAULTS, DIFFICULTY, EXPERIMENTS, SFT_BASE  # noqa: E402
from posttrain import metrics as M  # noqa: E402
from posttrain.runfacts import read_metrics  # noqa: E402

RESULTS = REPO / "experiments" / "results"

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
           "summary": json.loads((folder / "summary.json").read_text()), "per_problem": per,
           "stage_metrics": {s: read_metrics(REPO / "metrics" / f"{s}.json")
                             for s in ("rl", "distill") if (REPO / "metrics" / f"{s}.json").is_file()}}
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


def share(base: dict[str, dict[str, float]], part: dict[str, dict[str, float]], full: dict[str, dict[str, float]],
          key: str = "pass@1", n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """(part - base) / (full - base): the share of the full arm's gain over base that ``part`` recovers, with a
    95% bootstrap interval (the problems resampled jointly for the three arms)."""
    ids = [i for i in base if i in part and i in full and key in base[i]]
    x = np.array([[base[i][key], part[i][key], full[i][key]] for i in ids])
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_boot):
        m = x[rng.integers(0, len(ids), len(ids))].mean(0)
        if m[2] != m[0]:
            boot.append((m[1] - m[0]) / (m[2] - m[0]))
    m = x.mean(0)
    return {"share": float((m[1] - m[0]) / (m[2] - m[0])), "lo": float(np.percentile(boot, 2.5)),
            "hi": float(np.percentile(boot, 97.5)), "n": len(ids)}


def verdict(kind: str, diffs: dict[str, dict[str, float]], ks: list[int]) -> str:
    """From paired intervals of (first arm - second arm) per metric."""
    k1, kmax = diffs["pass@1"], diffs[f"pass@{ks[-1]}"]
    if kind == "geq_all":  # no k at which the first is decidedly below the second
        below = [k for k in ks if diffs[f"pass@{k}"]["hi"] < 0]
        return "does not hold" if below else ("holds" if all(diffs[f"pass@{k}"]["lo"] > 0 for k in ks)
                                              else "holds (not below at any k; not above at every k)")
    if kind == "gt_k1":
        return "holds" if k1["lo"] > 0 else "does not hold" if k1["hi"] < 0 else "inconclusive"
    if kind == "gt_kmax":
        return "holds" if kmax["lo"] > 0 else "does not hold" if kmax["hi"] < 0 else "inconclusive"
    if kind == "lt_kmax":
        return "holds" if kmax["hi"] < 0 else "does not hold" if kmax["lo"] > 0 else "inconclusive"
    if kind == "approx_k1":  # equivalence within 2 points: the interval inside [-0.02, 0.02]
        return ("holds" if -0.02 <= k1["lo"] and k1["hi"] <= 0.02 else
                "does not hold" if k1["lo"] > 0.02 or k1["hi"] < -0.02 else "inconclusive")
    raise ValueError(kind)


def samples_spent(rec: dict[str, Any]) -> int | None:
    """Completions the arm's RL stage sampled (refills and prior-budget extras included): rl's ``samples``
    metric; runs recorded before that metric existed ran dynamic sampling ``skip`` or ``off`` without a budget,
    which samples exactly steps x prompts_per_step x samples_per_prompt (rl.group_size in records made before the
    rename)."""
    if "rl" in rec.get("stage_metrics", {}) and "samples" in rec["stage_metrics"]["rl"]:
        return int(rec["stage_metrics"]["rl"]["samples"])
    o = rec["overrides"]
    if "rl.seed" not in o or o.get("rl.dynamic_sampling") == "refill" or o.get("rl.prior_budget", 0):
        return None
    return int(o.get("rl.steps", 40)) * 16 * int(o.get("rl.samples_per_prompt", o.get("rl.group_size", 8)))


def plot(exp: str, curves: dict[str, dict[str, list[float]]], ks: list[int], path: Path,
         spent: dict[str, list[tuple[int, float]]] | None = None) -> None:
    """pass@k per arm (seed mean, band = min..max over seeds); with ``spent``, a second panel: pass@1 of each
    seed against the samples its RL stage drew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if spent else 1, figsize=(11 if spent else 6, 4), squeeze=False)
    ax = axes[0][0]
    for arm, c in curves.items():
        ax.plot(ks, c["mean"], marker="o", markersize=3, label=arm)
        ax.fill_between(ks, c["min"], c["max"], alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (held-out eval)")
    ax.set_title(f"{exp}: seed mean, band = min..max over seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if spent:
        ax = axes[0][1]
        for n, (arm, pts) in enumerate(spent.items()):
            ax.scatter([x for x, _ in pts], [y for _, y in pts], label=arm, color=f"C{n + 1}")
        ax.set_xlabel("completions sampled by the RL stage")
        ax.set_ylabel("pass@1 (held-out eval)")
        ax.set_title("accuracy vs samples spent (one point per seed)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load(name: str) -> dict[str, Any] | None:
    f = RESULTS / "runs" / f"{name}.json"
    return json.loads(f.read_text()) if f.is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(EXPERIMENTS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--analyze-only", action="store_true", help="tables and plots from saved runs")
    args = ap.parse_args()
    t0 = time.time()
    exps = args.only.split(",")
    unknown = [e for e in exps if e not in EXPERIMENTS]
    if unknown:
        sys.exit(f"--only: unknown experiment(s) {unknown}; known: {list(EXPERIMENTS)}")

    def over(spec: dict[str, Any], arm: dict[str, Any]) -> dict[str, Any]:
        return {**DIFFICULTY, **DEFAULTS, **spec.get("eval", {}), **spec.get("common", {}), **arm}

    if not args.analyze_only:  # base runs first, then seed by seed over every arm (a grid cut short has them all)
        for exp in exps:
            spec = EXPERIMENTS[exp]
            b = spec.get("base", SFT_BASE)
            run(f"repro-{b['name']}", over(spec, b["over"]), b["target"], b["model"])
        for s in range(1, args.seeds + 1):
            for exp in exps:
                spec = EXPERIMENTS[exp]
                for arm, o in spec["arms"].items():  # an arm two experiments share is one run
                    run(f"repro-{arm}-s{s}", over(spec, {**o, spec.get("seed_key", "rl.seed"): s}),
                        spec.get("target", "evaluate@rl"), spec.get("model", "rl"))
    rows, report = [], {}
    for exp, spec in EXPERIMENTS.items():  # the table covers every experiment with runs, not only --only's
        ks = json.loads(over(spec, {})["evaluate.ks"])
        base = load(f"repro-{spec.get('base', SFT_BASE)['name']}")
        arms: dict[str, list[dict[str, Any]]] = {"base": [base] if base else []}
        for arm in spec["arms"]:
            arms[arm] = [r for s in range(1, args.seeds + 1) if (r := load(f"repro-{arm}-s{s}"))]
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
            c = {"claim": text, "first": a, "second": b, "diffs": diffs,
                 "below_at": [k for k in ks if diffs[f"pass@{k}"]["hi"] < 0]}  # first decidedly below second
            if kind == "share80":  # a's share of b's gain over base
                c["share"] = sh = share(means["base"], means[a], means[b])
                c["verdict"] = "holds" if sh["lo"] >= 0.8 else "does not hold" if sh["hi"] < 0.8 else "inconclusive"
            else:
                c["verdict"] = verdict(kind, diffs, ks)
            claims.append(c)
        spent = {arm: [(n, r["summary"]["eval"]["pass@1"]) for r in recs if (n := samples_spent(r)) is not None]
                 for arm, recs in arms.items() if arm != "base"} if exp == "prior" else None
        plot(exp, curves, ks, RESULTS / f"{exp}.png", spent)
        report[exp] = {"paper": spec["paper"], "setting": spec["setting"], "ks": ks,
                       "seeds": {a: len(recs) for a, recs in arms.items()}, "curves": curves,
                       "claims": claims, "arms": {a: [r["name"] for r in recs] for a, recs in arms.items()},
                       "wall_s": {a: [r["wall_s"] for r in recs] for a, recs in arms.items()},
                       "samples": {a: [samples_spent(r) for r in recs] for a, recs in arms.items()
                                   if a != "base" and spec.get("target", "evaluate@rl") == "evaluate@rl"}}
        (RESULTS / f"{exp}.json").write_text(json.dumps(report[exp], indent=1))
        for c in claims:
            d1, dk = c["diffs"]["pass@1"], c["diffs"][f"pass@{ks[-1]}"]
            extra = (f" (share {100 * c['share']['share']:.0f}% [{100 * c['share']['lo']:.0f}, "
                     f"{100 * c['share']['hi']:.0f}])" if "share" in c else "")
            rows.append(f"| {spec['paper']} ({spec['setting']}) | {c['claim']} | "
                        f"{100 * d1['diff']:+.1f} [{100 * d1['lo']:+.1f}, {100 * d1['hi']:+.1f}] | "
                        f"pass@{ks[-1]}: {100 * dk['diff']:+.1f} [{100 * dk['lo']:+.1f}, {100 * dk['hi']:+.1f}] | "
                        f"{c['verdict']}{extra} |")
    extra = RESULTS / "overopt.json"  # experiments/overopt.py's claims (its own runs), kept in the table
    rows += json.loads(extra.read_text()).get("rows", []) if extra.is_file() else []
    table = ["| paper (its setting) | claim | pass@1, first - second | largest k, first - second | verdict here |",
             "|---|---|---:|---:|---|", *rows]
    text = "\n".join(["# Reproductions", "", "Generated by `python experiments/reproduce.py`; points, seed-mean per "
                      "problem, 95% paired-bootstrap interval over the held-out problems.", "", *table, ""])
    (REPO / "experiments" / "REPRODUCTIONS.md").write_text(text)
    print(text)
    print(f"total wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
