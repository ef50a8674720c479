"""RL with tools vs RL without, on the tools profile (profiles/tools.yaml: arithmetic at 5-6 digits, a calculator).

One SFT model (curate -> sft at ``seed: --sft-seed``, on a mix of tool-use and bare-answer demos) is shared by
both arms and every RL seed (``rl.seed``: "seeds of an RL arm on the same SFT model"): the arms differ only in
whether the environment answers a tool call (``tools.enabled``) during rollout, RL and evaluation. ``tools``: a
call gets the calculator's observation; ``no_tools``: it gets nothing (single-turn: the model writes on after
``</tool>`` itself). Each (RL seed, arm) runs evaluate@sft -> rollout -> reward -> rl -> evaluate@rl -> report in
its own copy of the SFT folder (``python -m stages.<name>``, as ``dvc.yaml`` runs them), one after another. A
folder whose SFT model exists is reused (``--root`` kept between invocations).

Printed and written to ``--out`` (JSON) and ``--plot`` (PNG): per arm and seed the held-out greedy, pass@1 and
tool-call rate (share of sampled completions that call a tool, read from the completions: the no-tools arm's
calls get no observation but are still written) of SFT and RL; RL(tools) - RL(no tools) pass@1 per RL seed and
pooled (each problem's metrics averaged over the RL seeds, then a paired bootstrap over problems: the seeds share
the problems, so they are not resampled as independent; ``stages.report.paired``); each arm's SFT -> RL paired
difference (the report stage's); and the RL curves: reward and tool-call rate per step (from the rl shards).

Run: ``python experiments/tools.py --rl-seeds 0 1 2 --out experiments/results/tools.json``
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.runfacts import read_metrics  # noqa: E402
from posttrain.schema import read_columns  # noqa: E402
from stages.report import paired  # noqa: E402

# no_tools: without the calculator no prompt has a pass rate in rl.select's default band [0.01, 0.99] (the SFT model's
# bare answers at 5-6 digits are all wrong), and the rl stage refuses to start; min_pass_rate 0 lets it run on
# all-wrong prompts, whose groups have no reward variance: nothing to update, as RL without a tool has here (and
# max_idle_steps past rl.steps, so the stage runs its steps rather than stopping with an error after 5 idle ones)
ARMS = {"tools": {"tools": {"enabled": True}},
        "no_tools": {"tools": {"enabled": False}, "rl": {"select": {"min_pass_rate": 0.0}, "max_idle_steps": 1000}}}
BASE_CHAIN = [["curate"], ["sft"]]
ARM_CHAIN = [["evaluate", "--model", "sft"], ["rollout"], ["reward"], ["rl"], ["evaluate", "--model", "rl"],
             ["report"]]
CALL = "</tool>"  # a completion that closed a call (answered or not)


def _merge(raw: dict, edit: dict) -> dict:
    for k, v in edit.items():
        raw[k] = _merge(raw.get(k, {}), v) if isinstance(v, dict) and k in raw else v
    return raw


def write_params(folder: Path, profile: Path, seed: int, edit: dict, rl_seed: int = 0) -> None:
    (folder / "params.yaml").write_text(_params_text(profile, seed, edit, rl_seed))


def _params_text(profile: Path, seed: int, edit: dict, rl_seed: int) -> str:
    raw = yaml.safe_load(profile.read_text())
    raw = _merge(_merge(raw, edit), {"seed": seed, "rl": {"seed": rl_seed}, "tracking": {"enabled": False},
                       # 1 thread each: 3x faster than 2 on this shared 2-core machine
                       "runtime": {"progress": False, "train_threads": 1, "generate_threads": 1},
                       "report": {"compare": [["sft", "rl"]]}})
    raw["evaluate"]["models"] = {"sft": raw["paths"]["sft_model"], "rl": raw["paths"]["rl_model"]}
    return yaml.safe_dump(raw, sort_keys=False)


def run_chain(folder: Path, chain: list[list[str]]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    for stage in chain:
        cmd = [sys.executable, "-m", f"stages.{stage[0]}", "--params", "params.yaml", *stage[1:]]
        with open(folder / "log.txt", "a") as log:
            rc = subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"{folder}: {' '.join(stage)} exited {rc} (see {folder}/log.txt)")
    return round(time.time() - t0, 1)


def columns(path: Path, names: list[str]) -> dict[str, list]:
    return read_columns(path, names).to_pydict()


def collect(folder: Path) -> dict:
    """One arm's numbers: SFT and RL held-out metrics, the report's SFT -> RL differences, the RL curves."""
    out: dict = {}
    for model in ("sft", "rl"):
        ev = read_metrics(folder / "metrics" / "evaluate" / f"{model}.json")["eval"]
        gens = folder / "reports" / "evaluate" / "models" / model / "generations.parquet"
        cols = columns(gens, ["mode", "completion"])
        sampled = [c for m, c in zip(cols["mode"], cols["completion"], strict=True) if m == "sample"]
        out[model] = {k: ev.get(k) for k in ("greedy", "pass@1", "pass@16", "tool_rate", "tool_calls")}
        out[model]["call_rate"] = round(sum(CALL in c for c in sampled) / max(len(sampled), 1), 4)
    out["sft_to_rl"] = read_metrics(folder / "metrics" / "report.json")
    with open(folder / "reports" / "rl" / "train_log.csv") as f:
        log = list(csv.DictReader(f))
    rates: dict[int, list[bool]] = {}
    for shard in sorted((folder / "data" / "rl" / "shards").glob("step_*.parquet")):
        cols = columns(shard, ["step", "completion"])
        for s, c in zip(cols["step"], cols["completion"], strict=True):
            rates.setdefault(int(s), []).append(CALL in c)
    out["curve"] = {"step": [int(r["step"]) for r in log], "reward": [float(r["reward_mean"]) for r in log],
                    "call_rate": [round(sum(rates.get(int(r["step"]), [])) / max(len(rates.get(int(r["step"]), [])),
                                                                                1), 4) for r in log]}
    return out


def per_problem(folder: Path) -> dict[str, dict]:
    return json.loads((folder / "reports" / "evaluate" / "models" / "rl" / "per_problem.json").read_text())["eval"]


def seed_mean(pers: list[dict[str, dict]]) -> dict[str, dict]:
    """Each problem's metrics averaged over the RL seeds (the problems every seed has)."""
    ids = [i for i in pers[0] if all(i in p for p in pers)]
    return {i: {k: sum(p[i][k] for p in pers) / len(pers) for k in pers[0][i] if all(k in p[i] for p in pers)}
            for i in ids}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, color in (("tools", "tab:blue"), ("no_tools", "tab:orange")):
        for i, (_, r) in enumerate(sorted(results["arms"][arm].items())):
            c = r["curve"]
            for ax, key in zip(axes, ("call_rate", "reward"), strict=True):
                ax.plot(c["step"], c[key], color=color, alpha=0.8, label=arm if i == 0 else None)
    for ax, title in zip(axes, ("tool-call rate (share of the step's completions)", "reward (mean)"), strict=True):
        ax.set_xlabel("RL step")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("RL with vs without the calculator (profiles/tools.yaml; one line per seed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/tools-exp"))
    ap.add_argument("--sft-seed", type=int, default=0, help="seed of curate and sft (and evaluate's sampling)")
    ap.add_argument("--rl-seeds", type=int, nargs="+", default=[0, 1, 2], help="rl.seed of each RL run")
    ap.add_argument("--params", type=Path, default=REPO / "profiles" / "tools.yaml")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--bootstrap", type=int, default=2000)
    a = ap.parse_args()
    results: dict = {"profile": str(a.params.name), "sft_seed": a.sft_seed, "seconds": {},
                     "arms": {arm: {} for arm in ARMS}}
    pers: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    t_all = time.time()
    base = a.root / f"sft{a.sft_seed}" / "base"
    if not (base / "models" / "sft" / "model.safetensors").exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        write_params(base, a.params, a.sft_seed, {})
        results["seconds"]["curate+sft"] = run_chain(base, BASE_CHAIN)
    else:
        results["seconds"]["curate+sft"] = read_metrics(base / "metrics" / "sft.json")["seconds"]
    for seed in a.rl_seeds:
        for arm, edit in ARMS.items():
            folder = base.parent / f"rl{seed}" / arm
            old = folder / "params.yaml"
            if (folder / "metrics" / "report.json").exists() and old.read_text() == _params_text(a.params, a.sft_seed,
                                                                                                  edit, seed):
                results["seconds"][f"rl{seed}/{arm}"] = "reused"  # done by an earlier invocation, same params
            else:
                shutil.rmtree(folder, ignore_errors=True)
                shutil.copytree(base, folder, ignore=shutil.ignore_patterns("checkpoints", "log.txt"))
                write_params(folder, a.params, a.sft_seed, edit, seed)
                results["seconds"][f"rl{seed}/{arm}"] = run_chain(folder, ARM_CHAIN)
            results["arms"][arm][f"rl{seed}"] = collect(folder)
            pers[arm].append(per_problem(folder))
            print(f"rl seed {seed} {arm}: " + json.dumps({m: results["arms"][arm][f"rl{seed}"][m] for m in
                                                          ("sft", "rl")}), flush=True)
        results[f"tools_minus_no_tools/rl{seed}"] = paired(pers["no_tools"][-1], pers["tools"][-1], a.bootstrap,
                                                           seed)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1) + "\n")  # what is done so far
    results["tools_minus_no_tools/seed_mean"] = paired(seed_mean(pers["no_tools"]), seed_mean(pers["tools"]),
                                                       a.bootstrap, 0)
    results["seconds"]["total"] = round(time.time() - t_all, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, a.plot or a.out.with_suffix(".png"))
    print("\n| arm | seed | SFT greedy | SFT pass@1 | SFT call rate | RL greedy | RL pass@1 | RL call rate |"
          "\n|---|---|---|---|---|---|---|---|")
    for arm in ARMS:
        for seed, r in results["arms"][arm].items():
            s, rl = r["sft"], r["rl"]
            print(f"| {arm} | {seed} | {100 * s['greedy']:.1f} | {100 * s['pass@1']:.1f} | {100 * s['call_rate']:.1f}"
                  f" | {100 * rl['greedy']:.1f} | {100 * rl['pass@1']:.1f} | {100 * rl['call_rate']:.1f} |")
    for key in [k for k in results if k.startswith("tools_minus")]:
        d = results[key].get("pass@1", {})
        print(f"{key}: pass@1 {100 * d.get('diff', float('nan')):+.1f} "
              f"[{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}] (n={d.get('n')})" if d else f"{key}: -")
    print(f"seconds: {json.dumps(results['seconds'])}")


if __name__ == "__main__":
    main()
