"""Code RL recipes on one shared SFT model: held-out pass@1 of RL minus SFT with paired intervals (issue 30).

The upstream is a folder where curate, sft, rollout and reward ran on ``profiles/code.yaml`` with the arm's SFT
overrides (e.g. ``experiments/spread.py --params profiles/code.yaml --upto rl --set 'sft.phases=[{steps: 250,
cot_frac: 0.7}]' ...``'s ``seed0_default``). ``base`` is a hard-linked copy of it where ``evaluate --model sft``
runs again with the evaluation settings of every arm (``--set``: e.g. all 200 held-out problems sampled). Each
arm and RL seed is a hard-linked copy of ``base`` (the stages replace files whole) in which ``rl``,
``evaluate --model rl`` and ``report`` (paired bootstrap, RL vs SFT over the same problems) run with the arm's
overrides. ``--reeval`` evaluates the upstream's own ``models/rl`` instead of training (an arm that ran before).

    python experiments/code_rl.py --upstream /tmp/coderun/code_rl_sft250/seed0_default --root /tmp/code_rl \\
        --arm lr1e-4_s120 --rl-seeds 0 --set 'sft.phases=[{steps: 250, cot_frac: 0.7}]' \\
        --arm-set rl.lr=1e-4 rl.steps=120 --out benchmarks/results/code_rl.json

Run from a snapshot of the repo (``git archive``). Adds one record per arm and seed to ``--out``'s ``recipes``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.overopt import stage  # noqa: E402
from experiments.spread import formats  # noqa: E402
from posttrain.config.overrides import parse_overrides, render_overrides  # noqa: E402
from posttrain.runfacts import read_metrics  # noqa: E402

EVAL = ["runtime.progress=false", "evaluate.models={sft: models/sft, rl: models/rl}", "report.compare=[[sft, rl]]",
        "evaluate.benchmarks=[]"]


def write_params(folder: Path, name: str, base: Path, overrides: list[str]) -> str:
    _, edits = parse_overrides(base, overrides)  # a bad override is refused before any work
    text = render_overrides(base.read_text(), edits)
    (folder / name).write_text(text)
    return name


def link_copy(src: Path, dst: Path) -> None:
    """``dst``: a hard-linked copy of ``src``, but its own log and MLflow database (files written in place)."""
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)
    subprocess.run(["rm", "-rf", str(dst / "checkpoints")], check=True)  # never resume another run's rl
    for name in ("log.txt", "mlflow.db"):
        if (dst / name).is_file():
            subprocess.run(["cp", "--remove-destination", str(src / name), str(dst / name)], check=True)


def evals(folder: Path) -> dict[str, Any]:
    out = {}
    for m in ("sft", "rl"):
        ev = read_metrics(folder / "metrics" / "evaluate" / f"{m}.json")["eval"]
        out[m] = {k: ev.get(k) for k in ("greedy", "pass@1", "pass@16", "len")}
    paired = read_metrics(folder / "metrics" / "report.json")["eval"]["sft vs rl"]
    out["rl - sft"] = {k: paired[k] for k in ("greedy", "pass@1", "pass@16")}
    return out


def by_steps(folder: Path) -> dict[str, Any]:
    """Greedy and pass@1 of SFT and RL, and RL minus SFT, on the held-out problems grouped by their number of
    filter/map steps (the eval split draws 1- and 2-step problems alike; the train split may hold only some)."""
    import numpy as np
    import pyarrow.parquet as pq

    from posttrain.tasks.code import parse_prompt

    ev = pq.read_table(folder / "data" / "curated" / "eval.parquet", columns=["id", "prompt"]).to_pylist()
    steps = {r["id"]: len(parse_prompt(r["prompt"])[0]) for r in ev}
    per = {m: json.loads((folder / "reports" / "evaluate" / "models" / m / "per_problem.json").read_text())["eval"]
           for m in ("sft", "rl")}
    out: dict[str, Any] = {}
    for n in sorted(set(steps.values())):
        ids = [i for i in per["sft"] if steps.get(i) == n]
        row: dict[str, Any] = {"problems": len(ids)}
        for k in ("greedy", "pass@1"):
            a = [per["sft"][i][k] for i in ids if per["sft"][i].get(k) is not None and per["rl"][i].get(k) is not None]
            b = [per["rl"][i][k] for i in ids if per["sft"][i].get(k) is not None and per["rl"][i].get(k) is not None]
            row[k] = {"sft": round(float(np.mean(a)), 4), "rl": round(float(np.mean(b)), 4),
                      "rl - sft": round(float(np.mean(b) - np.mean(a)), 4)}
        out[f"{n}_step"] = row
    return out


def pooled(root: Path, arm: str, seeds: list[int]) -> dict[str, Any]:
    """RL minus SFT over the seeds: per held-out problem the seed mean of RL's metric minus SFT's, its mean and a
    95% paired bootstrap over problems (the seeds' spread is listed beside it)."""
    import numpy as np

    from posttrain import metrics as M

    def per(seed: int, model: str) -> dict[str, Any]:
        f = root / arm / f"s{seed}" / "reports" / "evaluate" / "models" / model / "per_problem.json"
        return json.loads(f.read_text())["eval"]

    sft = per(seeds[0], "sft")
    rls = [per(s, "rl") for s in seeds]
    out: dict[str, Any] = {"arm": arm, "rl_seeds": seeds}
    for k in ("greedy", "pass@1", "pass@16"):
        ids = [i for i in sft if sft[i].get(k) is not None and all(r[i].get(k) is not None for r in rls)]
        a = [sft[i][k] for i in ids]
        b = [float(np.mean([r[i][k] for r in rls])) for i in ids]
        lo, hi = M.paired_bootstrap_ci(a, b, 2000, 0)
        out[k] = {"diff": round(float(np.mean(b) - np.mean(a)), 4), "ci": [round(lo, 4), round(hi, 4)],
                  "n": len(ids), "per_seed": [round(float(np.mean([r[i][k] for i in ids]) - np.mean(a)), 4)
                                              for r in rls]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", type=Path, required=True)
    ap.add_argument("--root", type=Path, default=Path("/tmp/code_rl"))
    ap.add_argument("--params", type=Path, default=REPO / "profiles" / "code.yaml")
    ap.add_argument("--set", dest="common", nargs="*", default=[], help="overrides of base and every arm")
    ap.add_argument("--arm", required=True, help="the arm's name")
    ap.add_argument("--arm-set", nargs="*", default=[], help="the arm's RL overrides")
    ap.add_argument("--rl-seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--reeval", action="store_true", help="evaluate the upstream's models/rl, no training")
    ap.add_argument("--threads", type=int, default=2, help="runtime.*_threads, reward.workers, sandbox.workers")
    ap.add_argument("--pool", action="store_true", help="only pool the arm's --rl-seeds already run into --out")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.pool:
        rec = pooled(a.root, a.arm, a.rl_seeds)
        res = json.loads(a.out.read_text()) if a.out.exists() else {}
        res.setdefault("pooled", {})[a.arm] = rec
        a.out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(rec))
        return
    base_p = a.params.resolve()
    t = a.threads
    common = [*EVAL, *a.common, f"runtime.train_threads={t}", f"runtime.generate_threads={t}",
              f"reward.workers={t}", f"sandbox.workers={t}"]
    env = {"OMP_NUM_THREADS": str(t)}
    base = a.root / "base"
    with open(a.root.with_suffix(".lock"), "w") as lock:  # one arm at a time builds base
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "base_done").is_file():
            subprocess.run(["rm", "-rf", str(base)], check=True)
            a.root.mkdir(parents=True, exist_ok=True)
            link_copy(a.upstream.resolve(), base)
            p = write_params(base, "params_base.yaml", base_p, common)
            s = stage(base, p, "evaluate", "--model", "sft", env=env)
            (base / "base_done").write_text(json.dumps({"evaluate@sft_s": round(s, 1)}))
    for seed in a.rl_seeds:
        folder = a.root / a.arm / f"s{seed}"
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        link_copy(base, folder)
        over = [*common, f"rl.seed={seed}", *a.arm_set]
        p = write_params(folder, "params_arm.yaml", base_p, over)
        secs = {}
        if not a.reeval:
            secs["rl"] = round(stage(folder, p, "rl", env=env), 1)
        secs["evaluate@rl"] = round(stage(folder, p, "evaluate", "--model", "rl", env=env), 1)
        secs["report"] = round(stage(folder, p, "report", env=env), 1)
        rec = {"arm": a.arm, "rl_seed": seed, "overrides": [*a.common, *a.arm_set], "reeval": a.reeval,
               "upstream": str(a.upstream), "seconds": secs, **evals(folder), "by_steps": by_steps(folder),
               "formats": {m: formats(folder, m, p) for m in ("sft", "rl")}}
        if not a.reeval:
            rl = read_metrics(folder / "metrics" / "rl.json")
            rec["rl_metrics"] = {k: rl.get(k) for k in ("first_reward", "final_reward", "samples",
                                                        "zero_var_frac_mean", "selected_prompts")}
        (folder / "done.json").write_text(json.dumps(rec, indent=1))
        subprocess.run(["rm", "-rf", str(folder / "checkpoints")], check=True)
        with open(a.out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            res = json.loads(a.out.read_text()) if a.out.exists() else {}
            res.setdefault("recipes", {}).setdefault(a.arm, {})[f"rl_seed{seed}"] = rec
            a.out.write_text(json.dumps(res, indent=1) + "\n")
        d = rec["rl - sft"]
        print(f"{a.arm} s{seed} {secs} sft {rec['sft']} rl {rec['rl']} " + " ".join(
            f"{k} {100 * v['diff']:+.1f} [{100 * v['ci'][0]:+.1f}, {100 * v['ci'][1]:+.1f}]" for k, v in d.items()),
            flush=True)


if __name__ == "__main__":
    main()
