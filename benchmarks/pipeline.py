"""Wall time and peak memory of each stage of the default pipeline, of a no-op ``dvc repro``, and of the
re-run after one evaluate param changes.

Runs in the current repository (its outputs are what ``dvc repro`` would produce anyway):

1. every stage in DAG order, one ``dvc repro --force --single-item <stage>`` each (forced, so neither the
   run-cache nor an up-to-date lock skips the work); wall time and the peak RSS of the process tree (dvc
   plus the stage's python), sampled every 0.1 s with psutil;
2. ``dvc repro`` with nothing changed (the no-op: hashing deps and outs only);
3. ``evaluate.bootstrap`` changed in params.yaml, then ``dvc repro`` (only evaluate re-runs); params.yaml is
   restored afterwards and a last ``dvc repro`` takes evaluate's outputs back from DVC's run-cache.

    python benchmarks/pipeline.py [--json benchmarks/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

STAGES = ["curate", "sft", "rollout", "reward", "rl", "distill", "evaluate"]


def timed(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd``; (wall seconds, peak summed RSS of it and its descendants in MB)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr.read()[-2000:]}")
    return wall, peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/pipeline.json")
    args = ap.parse_args()
    dvc = [sys.executable, "-m", "dvc"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for s in STAGES:
        wall, rss = timed([*dvc, "repro", "--force", "--single-item", s])
        rows.append({"what": f"stage {s}", "wall_s": round(wall, 1), "peak_rss_mb": round(rss)})
        print(rows[-1], flush=True)
    rows.append({"what": "all stages (sum)", "wall_s": round(sum(r["wall_s"] for r in rows), 1),
                 "peak_rss_mb": max(r["peak_rss_mb"] for r in rows)})
    wall, rss = timed([*dvc, "repro"])
    rows.append({"what": "no-op dvc repro", "wall_s": round(wall, 2), "peak_rss_mb": round(rss)})
    params = Path("params.yaml")
    text = params.read_text()
    raw = yaml.safe_load(text)
    try:
        params.write_text(text.replace(f"bootstrap: {raw['evaluate']['bootstrap']}",
                                       f"bootstrap: {raw['evaluate']['bootstrap'] + 1}"))
        wall, rss = timed([*dvc, "repro"])
        rows.append({"what": "dvc repro after evaluate.bootstrap changed", "wall_s": round(wall, 1),
                     "peak_rss_mb": round(rss)})
    finally:
        params.write_text(text)
    wall, rss = timed([*dvc, "repro"])
    rows.append({"what": "dvc repro after restoring it (run-cache)", "wall_s": round(wall, 1),
                 "peak_rss_mb": round(rss)})
    print("\n| what | wall s | peak RSS MB |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['what']} | {r['wall_s']} | {r['peak_rss_mb']} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
