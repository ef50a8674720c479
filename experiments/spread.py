"""How much the default run's headline numbers move with the seed and the CPU's instruction set.

Each arm runs the DAG's stages in order (``python -m stages.<name>``, as ``dvc.yaml`` runs them) in its own
folder under ``--root``, with ``params.yaml`` plus the arm's ``key=value`` overrides, under one CPU instruction
set: ``default`` (what torch picks here) or ``avx2`` (``ATEN_CPU_CAPABILITY=avx2`` for ATen's own kernels,
``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN, ``MKL_ENABLE_INSTRUCTIONS=AVX2`` for MKL's GEMMs: what an AVX2-only
machine runs). ``--upto sft`` stops after ``evaluate@sft`` (the recipe sweep); ``--upto rl`` after
``evaluate@rl`` and the report (``--set`` the report's pairs and models to match); ``--upto all`` runs every
stage through the report. ``--params`` picks the base file (a profile). It prints a table of greedy and pass@1
per model (and per benchmark split) and writes JSON, with the report's paired differences when it ran and, per
model, the sampled completions' chain-of-thought share and accuracy per format (``formats``).

Run: ``python experiments/spread.py --seeds 0 1 2 --isas default avx2 --upto all --out benchmarks/results/spread.json``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.config.overrides import parse_overrides, render_overrides  # noqa: E402
from posttrain.runfacts import read_metrics  # noqa: E402

ISAS = {"default": {},
        "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
SFT_CHAIN = [["curate"], ["sft"], ["evaluate", "--model", "sft"]]
RL_CHAIN = [*SFT_CHAIN, ["rollout"], ["reward"], ["rl"], ["evaluate", "--model", "rl"], ["report"]]
ALL_CHAIN = [*SFT_CHAIN, ["rollout"], ["reward"], ["rl"], ["evaluate", "--model", "rl"], ["distill"],
             ["evaluate", "--model", "student_sft"], ["evaluate", "--model", "student"]]


def run_arm(folder: Path, overrides: list[str], isa: str, chain: list[list[str]], base: Path = REPO / "params.yaml"
            ) -> dict:
    """Stages of ``chain`` in ``folder`` (fresh), params ``base`` + ``overrides``; returns {model: {greedy,
    pass@1}} (benchmark splits as ``model/split``), the report's paired differences if it ran, and seconds."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    _, edits = parse_overrides(base, overrides)  # refuses a bad override before any work
    text = render_overrides(base.read_text(), edits)
    (folder / "params.yaml").write_text(text)
    env = {**os.environ, **ISAS[isa], "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db",}
    t0 = time.time()
    for stage in chain:
        cmd = [sys.executable, "-m", f"stages.{stage[0]}", "--params", "params.yaml", *stage[1:]]
        with open(folder / "log.txt", "a") as log:
            rc = subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"{folder}: {' '.join(stage)} exited {rc} (see {folder}/log.txt)")
    out = {"seconds": round(time.time() - t0, 1)}
    for f in sorted((folder / "metrics" / "evaluate").glob("*.json")):
        for split, ev in json.loads(f.read_text()).items():
            key = f.stem if split == "eval" else f"{f.stem}/{split}"
            out[key] = {k: ev.get(k) for k in ("greedy", "pass@1", "len", "pass@16", "pass@64") if k in ev}
    if (folder / "metrics" / "report.json").exists():
        out["paired"] = read_metrics(folder / "metrics" / "report.json")
    sft = read_metrics(folder / "metrics" / "sft.json")
    out["sft_final_loss"] = sft["final_loss"]
    out["formats"] = {m: formats(folder, m) for m in ("sft", "rl", "student_sft", "student")
                      if (folder / "reports" / "evaluate" / "models" / m / "generations.parquet").exists()}
    return out


# What a completion in the short form starts with, per task: arithmetic's bare answer, code's one expression.
DIRECT = {"arith": "answer:", "code": "return"}


def formats(folder: Path, model: str, params: str = "params.yaml") -> dict[str, float | None]:
    """The sampled completions' share in the long format (``cot``: arithmetic's chain of thought, code's line per
    step) and the accuracy within each format (``DIRECT``; the task is that of ``folder / params``):
    pass@1 = cot * acc_cot + (1 - cot) * acc_direct. All None on a task with no short form (``math``); a tool
    call counts as the long form."""
    import pyarrow.parquet as pq
    import yaml

    kind = (yaml.safe_load((folder / params).read_text()).get("task") or {}).get("kind", "arith")
    if kind not in DIRECT:
        return {"cot": None, "acc_cot": None, "acc_direct": None}
    rows = pq.read_table(folder / "reports" / "evaluate" / "models" / model / "generations.parquet",
                         columns=["split", "mode", "completion", "correct"]).to_pylist()
    rows = [r for r in rows if r["mode"] == "sample" and r["split"] == "eval"]  # not the benchmark splits
    short = [r["completion"].lstrip().startswith(DIRECT[kind]) for r in rows]
    cot = [r for r, d in zip(rows, short, strict=True) if not d]
    direct = [r for r, d in zip(rows, short, strict=True) if d]

    def acc(rs: list[dict[str, Any]]) -> float | None:  # an unscorable sample (correct None) counts as wrong
        return round(sum(bool(r["correct"]) for r in rs) / len(rs), 4) if rs else None

    return {"cot": round(len(cot) / len(rows), 4) if rows else None, "acc_cot": acc(cot), "acc_direct": acc(direct)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/spread"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--isas", nargs="+", default=list(ISAS), choices=list(ISAS))
    ap.add_argument("--upto", choices=["sft", "rl", "all"], default="sft")
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml", help="the base params file (a profile)")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="key=value overrides of every arm")
    ap.add_argument("--name", default="default", help="the recipe's name in the JSON")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    chain = {"sft": SFT_CHAIN, "rl": RL_CHAIN, "all": ALL_CHAIN}[a.upto]
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    arms = results.setdefault(a.name, {"overrides": a.overrides, "arms": {}})
    for seed in a.seeds:  # the ISAs alternate within each seed
        for isa in a.isas:
            key = f"seed{seed}/{isa}"
            over = [*a.overrides, f"seed={seed}", "runtime.progress=false"]
            r = run_arm(a.root / a.name / key.replace("/", "_"), over, isa, chain, a.params.resolve())
            arms["arms"][key] = r
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(results, indent=1) + "\n")
            print(key, json.dumps(r), flush=True)
    models = sorted({m for r in arms["arms"].values() for m in r if isinstance(r[m], dict) and "greedy" in r[m]})
    print(f"\n{a.name}: {' '.join(a.overrides)}\n| model | metric | " + " | ".join(arms["arms"]) + " | range |")
    for m in models:
        for k in ("greedy", "pass@1"):
            vals = [r[m][k] for r in arms["arms"].values() if m in r and r[m].get(k) is not None]
            cells = " | ".join(f"{100 * v:.1f}" for v in vals)
            spread = f"{100 * (max(vals) - min(vals)):.1f} (sd {100 * statistics.pstdev(vals):.1f})" if vals else "-"
            print(f"| {m} | {k} | {cells} | {spread} |")


if __name__ == "__main__":
    main()
