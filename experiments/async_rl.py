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

``--every N`` adds the curve: the policy is saved every N steps (``rl.save_steps``) and each saved policy is
evaluated the same way; its x is the rl log's ``elapsed_s`` at that step (the loop's wall clock: the generators'
spawn included, model loads before the loop not), and step 0 is the upstream's SFT evaluation at 0 s. From the
curves: per arm the wall time at which pass@1 first reaches the synchronous arm's final pass@1 (seed means,
linear interpolation between saved steps; per seed against that seed's sync run too), and a plot of held-out
pass@1 against wall time (``--plot``). ``k0`` (one generator waiting for each version: the synchronous samples
in another process) is an arm too.

    python experiments/async_rl.py --upstream /tmp/overopt/base --root /tmp/async_curve --every 8 \\
        --arms sync k0 k1 k2 k4 --out experiments/results/async_rl_curve.json \\
        --plot experiments/results/async_rl_curve.png
"""

from __future__ import annotations

import argparse
import csv
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
from posttrain.runfacts import read_metrics  # noqa: E402

ARMS = {"sync": None, "k0": 0, "k1": 1, "k2": 2, "k4": 4}  # rl.overlap.max_staleness (None: rl.overlap null)


def per_problem(folder: Path, model: str) -> dict[str, dict[str, float | None]]:
    per = json.loads((folder / "reports" / "evaluate" / "models" / model / "per_problem.json").read_text())["eval"]
    return {pid: {"greedy": r["greedy"], "pass@1": r.get("pass@1")} for pid, r in per.items()}


def run(upstream: Path, root: Path, arm: str, seed: int, steps: int, every: int, common: list[str]
        ) -> dict[str, Any]:
    folder = root / arm / f"s{seed}"
    done = folder / "done.json"
    if done.is_file() and (not every or json.loads(done.read_text()).get("curve")):  # else a run without a curve
        return json.loads(done.read_text())
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(upstream), str(folder)], check=True)
    k = ARMS[arm]
    overlap = "null" if k is None else (f"{{max_staleness: {k}, generators: 1, generator_threads: 1, "
                                        "trainer_threads: 1}")
    saved = sorted({*range(every, steps + 1, every), steps}) if every else []  # the final policy always
    models = "{" + ", ".join(f"s{k}: data/rl/checkpoints/step_{k}" for k in saved) + "}"
    # k > 0 with no rl.correction is refused at load since issue 50 (the published runs predate it and trained
    # stale samples uncorrected); a --set rl.correction=... replaces this default
    fix = ["rl.correction={name: icepop}"] if k and not any(e.startswith("rl.correction=") for e in common) else []
    edits = [*fix, *common, f"rl.seed={seed}", f"rl.steps={steps}", f"rl.overlap={overlap}", "report.compare=[]",
             f"rl.save_steps={saved}", *([f"evaluate.models={models}"] if saved else [])]
    p = write_params(folder, "params_async.yaml", edits)
    t = time.time()
    rl_s = stage(folder, p, "rl")
    curve: dict[str, Any] = {}
    if saved:
        clock = {int(r["step"]): float(r["elapsed_s"]) for r in csv.DictReader(
            (folder / "reports" / "rl" / "train_log.csv").open())}
        for k in saved:  # the last saved step is the final policy: evaluated once
            stage(folder, p, "evaluate", "--model", f"s{k}")
            curve[str(k)] = {"elapsed_s": clock[k], "heldout": per_problem(folder, f"s{k}")}
    else:
        stage(folder, p, "evaluate", "--model", "rl")
    m = read_metrics(folder / "metrics" / "rl.json")
    rec = {"arm": arm, "seed": seed, "rl_s": round(rl_s, 1), "total_s": round(time.time() - t, 1),
           "samples": m["samples"], "staleness": m.get("staleness"), "final_reward": m.get("final_reward"),
           "loop_s": m["seconds"], "curve": curve,
           "heldout": curve[str(saved[-1])]["heldout"] if saved else per_problem(folder, "rl")}
    done.write_text(json.dumps(rec))
    return rec


def seed_mean(recs: list[dict[str, Any]], key: str) -> dict[str, float]:
    ids = set.intersection(*(set(r["heldout"]) for r in recs))
    return {i: float(np.mean([r["heldout"][i][key] for r in recs])) for i in sorted(ids)}


def mean(per: dict[str, dict[str, float | None]], key: str = "pass@1") -> float:
    return float(np.mean([v[key] for v in per.values()]))


def points(rec: dict[str, Any], sft: float) -> list[tuple[float, float]]:
    """(seconds, held-out pass@1) of one run: (0, the SFT policy's) and each saved step."""
    return [(0.0, sft)] + [(c["elapsed_s"], mean(c["heldout"])) for _, c in sorted(rec["curve"].items(),
                                                                                   key=lambda kv: int(kv[0]))]


def reach(pts: list[tuple[float, float]], target: float) -> float | None:
    """The first time the piecewise-linear curve ``pts`` reaches ``target``; None if it never does."""
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if y1 >= target:
            return x0 if y0 >= target else x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return None


def curves(runs: dict[str, list[dict[str, Any]]], sft: float) -> dict[str, Any]:
    """Per arm: the seed-mean curve (mean seconds and pass@1 at each saved step), the seconds at which it
    reaches the synchronous arm's final seed-mean pass@1, and per seed the seconds each run takes to reach its
    own seed's sync final pass@1 (None: not within the run)."""
    sync_final = {r["seed"]: points(r, sft)[-1][1] for r in runs["sync"]}
    target = float(np.mean(list(sync_final.values())))
    out: dict[str, Any] = {"target_pass@1": round(target, 4)}
    for arm, recs in runs.items():
        pts = np.array([points(r, sft) for r in recs])  # [seeds, saved + 1, 2]
        mc = [(float(x), float(y)) for x, y in pts.mean(0)]
        t = reach(mc, target)
        per_seed = [reach(points(r, sft), sync_final[r["seed"]]) for r in recs]
        out[arm] = {"curve": [[round(x, 2), round(y, 4)] for x, y in mc], "seconds_to_target": t and round(t, 1),
                    "seconds_to_own_seed_sync": [s and round(s, 1) for s in per_seed],
                    "per_seed": [[[round(x, 2), round(y, 4)] for x, y in p] for p in pts.tolist()]}
    sync_t = out["sync"]["seconds_to_target"]
    for arm in runs:
        t = out[arm]["seconds_to_target"]
        out[arm]["speed_vs_sync"] = round(sync_t / t, 3) if t and sync_t else None
    return out


def plot(cur: dict[str, Any], path: Path) -> None:
    """Held-out pass@1 against the rl loop's wall time, per arm: seed mean (line), each seed (faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for n, arm in enumerate(a for a in cur if a != "target_pass@1"):
        c = cur[arm]
        for seed in c["per_seed"]:
            ax.plot(*zip(*seed, strict=True), color=f"C{n}", alpha=0.2, linewidth=0.8)
        ax.plot(*zip(*c["curve"], strict=True), color=f"C{n}", marker="o", markersize=3,
                label=f"{arm} (reaches sync's final: {c['seconds_to_target'] or '-'} s)")
    ax.axhline(cur["target_pass@1"], color="gray", ls=":", linewidth=1)
    ax.set_xlabel("rl loop wall time, s (2-core CPU)")
    ax.set_ylabel("held-out pass@1 (200 problems, 4 samples)")
    ax.set_title("pass@1 against wall time: seed mean (line), each seed (faint)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", type=Path, default=Path("/tmp/overopt/base"))
    ap.add_argument("--root", type=Path, default=Path("/tmp/async_rl"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=0, help="save and evaluate every N steps (0: the end only)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None, help="pass@1 against wall time (with --every)")
    ap.add_argument("--set", nargs="*", default=[], help="more key=value overrides for every arm (e.g. "
                    "rollout.backend=vllm, run with .venv-vllm's python: vLLM generators)")
    a = ap.parse_args()
    common = ["runtime.progress=false", "evaluate.samples_per_prompt=4", "evaluate.ks=[1,4]",
              "evaluate.sample_prompts=null", *a.set]
    runs: dict[str, list[dict[str, Any]]] = {}
    for seed in a.seeds:
        for arm in a.arms[seed % len(a.arms):] + a.arms[: seed % len(a.arms)]:  # the order rotates per seed
            rec = run(a.upstream, a.root, arm, seed, a.steps, a.every, common)
            runs.setdefault(arm, []).append(rec)
            print(f"{arm} s{seed}: rl {rec['rl_s']} s, samples {rec['samples']}, pass@1 "
                  f"{np.mean([v['pass@1'] for v in rec['heldout'].values()]):.4f}", flush=True)
    res: dict[str, Any] = {"settings": vars(a) | {"upstream": str(a.upstream), "root": str(a.root),
                                                  "out": str(a.out), "plot": str(a.plot)}, "arms": {}}
    for arm, recs in runs.items():
        row = {"seeds": [r["seed"] for r in recs], "rl_s": [r["rl_s"] for r in recs],
               "samples": [r["samples"] for r in recs], "final_reward": [r["final_reward"] for r in recs],
               "staleness": [r["staleness"] for r in recs]}
        for key in ("pass@1", "greedy"):
            row[key] = [round(float(np.mean([v[key] for v in r["heldout"].values()])), 4) for r in recs]
            if arm != "sync" and "sync" in runs:
                row[f"{key}_minus_sync"] = paired(seed_mean(runs["sync"], key), seed_mean(recs, key))
        res["arms"][arm] = row
    if a.every and "sync" in runs:
        sft = mean(per_problem(a.upstream, "sft"))
        res["curves"] = cur = curves(runs, sft)
        print(f"\nSFT pass@1 {100 * sft:.1f}; sync's final (seed mean) {100 * cur['target_pass@1']:.1f}")
        print("| arm | seed-mean curve (s, pass@1) | s to sync's final | speed vs sync | s per seed (own sync) |")
        print("|---|---|---|---|---|")
        for arm in runs:
            c = cur[arm]
            print(f"| {arm} | {' '.join(f'({x:.0f}, {100 * y:.1f})' for x, y in c['curve'])} | "
                  f"{c['seconds_to_target']} | {c['speed_vs_sync']} | {c['seconds_to_own_seed_sync']} |")
        if a.plot:
            plot(cur, a.plot)
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
