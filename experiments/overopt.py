"""Reward over-optimisation at our scale: Gao et al. (2023)'s setting with the task's verifier as the gold reward.

One base run (curate, sft, rollout, reward) gives scored rollouts; the ``reward_model`` stage trains proxy reward
models on N preference pairs built from them (two values of N; one model, and a K-member ensemble at the larger
N). Each arm then runs the ``rl`` stage against a proxy (``reward.rewards``: the ``reward_model`` reward with
weight 1, and the verifier ``correct`` with weight 0, so the gold is scored and logged but never trained on), with
and without a small KL, for each seed (``rl.seed``: the upstream is shared), saving the policy every
``--every`` steps; each saved policy is evaluated on the held-out eval split (greedy and sampled pass@1: the gold).

Per arm it records, per step, the proxy (``reward_mean`` of the rl log) and the gold on the step's own samples
(``pass_rate``), and at each saved step the held-out gold per problem. The claims (rows of the Reproductions
table, paired-bootstrap intervals over held-out problems, seed means):

1. proxy keeps rising while gold peaks and falls (single RM, small N, no KL): proxy(last) - proxy(peak) > 0
   and gold(last) - gold(peak) < 0, the peak being the saved step with the best seed-mean held-out gold;
2. an ensemble (WCO or UWO) + small KL keeps gold higher at the end than a single RM (no KL), same N;
3. more preference data delays the peak: the single RM's gold peak step at large N vs small N (per seed).

    python experiments/overopt.py --root /tmp/overopt --seeds 0 1 2 --out experiments/results/overopt.json

Run from a snapshot of the repo (``git archive``): the stages run as ``python -m stages.X`` from here. Prints a
table, writes the JSON and ``<out>.png`` (proxy and gold against steps, seed mean and min..max band per arm).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.overopt_report import KL, analyse, heldout_mean, plot, table_rows, upsert_rows  # noqa: E402
from posttrain.config.overrides import parse_overrides, render_overrides  # noqa: E402
from posttrain.runfacts import read_metrics  # noqa: E402

# proxy models: name -> (N key, members)
RMS = {"rm_small": ("small", 1), "rm_large": ("large", 1), "ens_large": ("large", 3)}
# arms: name -> (proxy model, ensemble combination, kl_coef)
ARMS = {"rm_small": ("rm_small", "mean", 0.0), "rm_large": ("rm_large", "mean", 0.0),
        "rm_large_kl": ("rm_large", "mean", KL), "wco_large_kl": ("ens_large", "wco", KL),
        "uwo_large_kl": ("ens_large", "uwo", KL), "wco_large": ("ens_large", "wco", 0.0),
        "uwo_large": ("ens_large", "uwo", 0.0)}


def stage(folder: Path, params: str, *args: str, env: dict[str, str] | None = None) -> float:
    """``python -m stages.<args>`` in ``folder`` with its params file (``env``: more variables); seconds taken."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
    t = time.time()
    with open(folder / "log.txt", "a") as log:
        rc = subprocess.run([sys.executable, "-m", f"stages.{args[0]}", "--params", params, *args[1:]], cwd=folder,
                            env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{folder}: {' '.join(args)} exited {rc} (see {folder}/log.txt)")
    return time.time() - t


def write_params(folder: Path, name: str, overrides: list[str]) -> str:
    base = REPO / "params.yaml"
    with contextlib.chdir(folder):  # relative paths (the reward model's) are checked where the stages run
        _, edits = parse_overrides(base, overrides)  # a bad override is refused before any work
    (folder / name).write_text(render_overrides(base.read_text(), edits))
    return name


def base_run(root: Path, n: dict[str, int], rm_steps: int, common: list[str]) -> dict[str, Any]:
    """curate, sft, rollout, reward once; then each proxy model (``RMS``) on its N pairs. Each stage's seconds are
    kept in ``base/seconds.json`` as it ends, and a stage that ended is not run again (an interrupted base goes on)."""
    folder = root / "base"
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "seconds.json"
    secs = json.loads(log.read_text()) if log.is_file() else {}
    p = write_params(folder, "params.yaml", common)
    jobs = [(s, p, (s,)) for s in ("curate", "sft", "rollout", "reward")]
    for rm, (nkey, members) in RMS.items():
        q = write_params(folder, f"params_{rm}.yaml", [*common, f"reward_model.models={{{rm}: data/reward}}",
                                                       f"reward_model.max_pairs={n[nkey]}",
                                                       f"reward_model.members={members}",
                                                       f"reward_model.steps={rm_steps}"])
        jobs.append((f"reward_model@{rm}", q, ("reward_model", "--model", rm)))
    for name, params, args in jobs:
        if name not in secs:
            secs[name] = round(stage(folder, params, *args), 1)
            log.write_text(json.dumps(secs, indent=1))
    if "evaluate@sft" not in secs:  # step 0 of every arm: the SFT policy, held out
        q = write_params(folder, "params_eval.yaml", [*common, "report.compare=[]"])
        secs["evaluate@sft"] = round(stage(folder, q, "evaluate", "--model", "sft"), 1)
        log.write_text(json.dumps(secs, indent=1))
    per = json.loads((folder / "reports" / "evaluate" / "models" / "sft" / "per_problem.json").read_text())
    rms = {rm: read_metrics(folder / "metrics" / "reward_model" / f"{rm}.json") for rm in RMS}
    return {"seconds": secs, "reward_models": rms, "n": n, "rm_steps": rm_steps,
            "sft": {pid: {"greedy": r["greedy"], "pass@1": r.get("pass@1")} for pid, r in per["eval"].items()}}


def arm_run(root: Path, arm: str, seed: int, steps: int, every: int, common: list[str]) -> dict[str, Any]:
    """One arm and seed: rl against the proxy from a hard-linked copy of the base run, then evaluate at each
    saved step. Returns the rl log's per-step proxy and gold, and per saved step the held-out per-problem gold."""
    folder = root / arm / f"s{seed}"
    done = folder / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(root / "base"), str(folder)], check=True)  # stages replace files whole
    rm, combine, kl = ARMS[arm]
    saved = list(range(every, steps + 1, every))
    evals = {f"s{k}": f"data/rl/checkpoints/step_{k}" for k in saved}
    reward = (f"[{{name: reward_model, weight: 1.0, kwargs: {{path: models/reward_model/{rm}, combine: {combine}}}}},"
              " {name: correct, weight: 0.0}]")
    p = write_params(folder, "params_arm.yaml", [
        *common, f"rl.seed={seed}", f"rl.steps={steps}", f"rl.save_steps={saved}", f"rl.kl_coef={kl}",
        f"reward.rewards={reward}", "report.compare=[]",
        "evaluate.models={" + ", ".join(f"{k}: {v}" for k, v in evals.items()) + "}"])
    secs = {"rl": stage(folder, p, "rl")}
    with open(folder / "reports" / "rl" / "train_log.csv") as f:
        log = [{k: float(v) if v not in ("", None) else None for k, v in r.items()} for r in csv.DictReader(f)]
    gold = {}
    for name in evals:
        secs[f"evaluate@{name}"] = stage(folder, p, "evaluate", "--model", name)
        per = json.loads((folder / "reports" / "evaluate" / "models" / name / "per_problem.json").read_text())
        gold[name[1:]] = {pid: {"greedy": r["greedy"], "pass@1": r.get("pass@1")} for pid, r in per["eval"].items()}
    rec = {"arm": arm, "seed": seed, "seconds": {k: round(v, 1) for k, v in secs.items()},
           "proxy": [r["reward_mean"] for r in log], "train_gold": [r["pass_rate"] for r in log],
           "kl": [r["kl"] for r in log], "heldout": gold}
    done.write_text(json.dumps(rec))
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/overopt"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=30)
    ap.add_argument("--n-small", type=int, default=128)
    ap.add_argument("--n-large", type=int, default=1024)
    ap.add_argument("--rm-steps", type=int, default=100, help="reward_model.steps of each member")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="key=value overrides of every run")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--analyze-only", action="store_true", help="only the runs already done, nothing run")
    ap.add_argument("--table", action="store_true", help="write the claims into experiments/REPRODUCTIONS.md")
    a = ap.parse_args()
    common = ["runtime.progress=false", "evaluate.samples_per_prompt=4", "evaluate.ks=[1,4]",
              "evaluate.sample_prompts=null", *a.overrides]
    base = base_run(a.root, {"small": a.n_small, "large": a.n_large}, a.rm_steps, common)
    runs: dict[str, list[dict[str, Any]]] = {}
    for seed in a.seeds:  # arms alternate within each seed
        for arm in a.arms:
            done = a.root / arm / f"s{seed}" / "done.json"
            if a.analyze_only and not done.is_file():
                continue
            rec = arm_run(a.root, arm, seed, a.steps, a.every, common)
            rec["heldout"] = {"0": base["sft"], **rec["heldout"]}  # step 0: the SFT policy every arm starts from
            runs.setdefault(arm, []).append(rec)
            print(f"{arm} s{seed}: {rec['seconds']}", flush=True)
    def summary(r: dict[str, Any]) -> dict[str, Any]:  # per saved step the held-out means (per problem: in --root)
        return {**{k: v for k, v in r.items() if k != "heldout"},
                "heldout": {s: {m: heldout_mean(r, s, m) for m in ("greedy", "pass@1")} for s in r["heldout"]}}

    res = {"settings": vars(a) | {"root": str(a.root), "out": str(a.out), "kl": KL},
           "base": {k: v for k, v in base.items() if k != "sft"},
           "greedy": analyse(runs, "greedy"), "pass@1": analyse(runs, "pass@1"),
           "runs": {arm: [summary(r) for r in recs] for arm, recs in runs.items()},
           "compute_s": round(sum(base["seconds"].values()) + sum(sum(r["seconds"].values()) for recs in
                                                                     runs.values() for r in recs), 1)}
    res["rows"] = table_rows(res, {arm: len(recs) for arm, recs in runs.items()})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    if a.table:
        upsert_rows(REPO / "experiments" / "REPRODUCTIONS.md", res["rows"])
    plot(runs, a.out.with_suffix(".png"))
    for key in ("greedy", "pass@1"):
        print(f"\nheld-out {key} (seed mean) per saved step:")
        for arm, c in res[key]["heldout_curve"].items():
            print(f"  {arm:14s} " + "  ".join(f"{s}:{100 * v:.1f}" for s, v in c.items()))
        for k, v in res[key].items():
            if k.startswith(("claim", "ablation")):
                print(f"  {k}: {json.dumps(v)}")


if __name__ == "__main__":
    main()
