"""Wall time and peak memory of each stage of the default pipeline, of a no-op ``dvc repro``, and of the
re-runs after one evaluate param and one report param change.

Runs in the current repository (its outputs are what ``dvc repro`` would produce anyway):

Stage output goes to log files in a temporary folder (named at the end).

1. every stage in DAG order, one ``dvc repro --force --single-item <stage>`` each (forced, so neither the
   run-cache nor an up-to-date lock skips the work); wall time and the peak RSS of the process tree (dvc
   plus the stage's python), sampled every 0.1 s with psutil;
2. ``dvc repro`` with nothing changed (the no-op: hashing deps and outs only);
3. ``evaluate.bootstrap`` changed in params.yaml, then ``dvc repro`` (every ``evaluate@<model>`` and
   ``report`` re-run); params.yaml is restored afterwards and a last ``dvc repro`` takes their outputs back
   from DVC's run-cache;
4. ``report.compare`` changed (only ``report`` re-runs: no model is evaluated again), then restored.

    python benchmarks/pipeline.py [--json benchmarks/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml


def timed(cmd: list[str], log: Path) -> tuple[float, float, float]:
    """Run ``cmd`` (output to ``log``); (wall seconds, peak summed RSS of it and its descendants in MB, seconds
    the stages spent on MLflow tracking, from their "tracked as MLflow run ... in X s" lines)."""
    t = time.perf_counter()
    with log.open("w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        peak = 0
        proc = psutil.Process(p.pid)
        while p.poll() is None:
            try:
                rss = sum(x.memory_info().rss for x in [proc, *proc.children(recursive=True)])
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.1)
    wall = time.perf_counter() - t
    text = log.read_text()
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{text[-2000:]}")
    tracking = sum(float(x) for x in re.findall(r"tracked as MLflow run \S+ \(.*?\) in ([0-9.]+)s", text))
    return wall, peak / 2**20, tracking


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/pipeline.json")
    args = ap.parse_args()
    dvc = [sys.executable, "-m", "dvc"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logs = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    rows = []

    def run(what: str, cmd: list[str]) -> None:
        wall, rss, trk = timed(cmd, logs / f"{len(rows)}.log")
        rows.append({"what": what, "wall_s": round(wall, 2 if wall < 10 else 1), "peak_rss_mb": round(rss),
                     "tracking_s": round(trk, 2)})
        print(rows[-1], flush=True)

    raw = yaml.safe_load(Path("params.yaml").read_text())
    stages = ["curate", "sft", "rollout", "reward", "rl", "distill",
              *(f"evaluate@{m}" for m in raw["evaluate"]["models"]), "report"]  # dvc.yaml's DAG order
    for s in stages:
        run(f"stage {s}", [*dvc, "repro", "--force", "--single-item", s])
    rows.append({"what": "all stages (sum)", "wall_s": round(sum(r["wall_s"] for r in rows), 1),
                 "peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
                 "tracking_s": round(sum(r["tracking_s"] for r in rows), 2)})
    run("no-op dvc repro", [*dvc, "repro"])
    params = Path("params.yaml")
    text = params.read_text()
    try:
        params.write_text(text.replace(f"bootstrap: {raw['evaluate']['bootstrap']}",
                                       f"bootstrap: {raw['evaluate']['bootstrap'] + 1}"))
        run("dvc repro after evaluate.bootstrap changed", [*dvc, "repro"])
    finally:
        params.write_text(text)
    run("dvc repro after restoring it (run-cache)", [*dvc, "repro"])
    try:
        first = raw["report"]["compare"][0]
        params.write_text(text.replace(f"- [{first[0]}, {first[1]}]\n", "", 1))
        run("dvc repro after report.compare changed", [*dvc, "repro"])
    finally:
        params.write_text(text)
    run("dvc repro after restoring it (run-cache)", [*dvc, "repro"])
    print("\n| what | wall s | peak RSS MB | of which MLflow tracking s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['what']} | {r['wall_s']} | {r['peak_rss_mb']} | {r['tracking_s']} |")
    print(f"logs: {logs}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
