"""What MLflow tracking costs a stage: the same stage run with ``tracking.enabled`` true and false, the two arms
alternated (on, off, on, off, ...) so the machine's drift hits both, every repeat reported.

With tracking on, the stage opens its MLflow run at the start, logs every train-log row to it as it is made
(live telemetry: one ``log_batch`` per row) and fills it at the end (params, tags, DVC hashes, artifacts,
registered models). The overhead is the whole-process wall time of "on" over "off", pair by pair.

Run it in a workspace whose upstream outputs exist (after ``make pipeline``); it overwrites the stage's own
outputs with identical ones (tracking changes no output):

    python benchmarks/tracking_overhead.py --stage rl --repeats 3

prints a table and writes benchmarks/results/tracking_overhead_<stage>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def run_stage(stage: str, params: Path) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--params", str(params)], cwd=REPO, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"stages.{stage} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default="rl", choices=["sft", "rl", "distill"])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["runtime"]["progress"] = False
    with tempfile.TemporaryDirectory() as tmp:
        arms = {}
        for arm, enabled in (("on", True), ("off", False)):
            p = REPO / f".params.bench-{arm}.yaml"  # in the repo root: the stage's tracking root is the file's folder
            p.write_text(yaml.safe_dump({**raw, "tracking": {**raw["tracking"], "enabled": enabled,
                                                             "uri": f"sqlite:///{Path(tmp) / 'mlflow.db'}"}}))
            arms[arm] = p
        try:
            rows = []
            for i in range(a.repeats):
                on, off = run_stage(a.stage, arms["on"]), run_stage(a.stage, arms["off"])
                rows.append({"repeat": i + 1, "on_s": round(on, 2), "off_s": round(off, 2),
                             "overhead_pct": round(100 * (on / off - 1), 2)})
                print(f"repeat {i + 1}: on {on:.2f} s, off {off:.2f} s, overhead {rows[-1]['overhead_pct']:+.2f}%",
                      flush=True)
        finally:
            for p in arms.values():
                p.unlink(missing_ok=True)
    ratios = sorted(r["overhead_pct"] for r in rows)
    print(f"\nMLflow tracking overhead of the {a.stage} stage ({a.repeats} alternated pairs, whole-process wall time)")
    print("| repeat | tracking on (s) | tracking off (s) | overhead |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['repeat']} | {r['on_s']} | {r['off_s']} | {r['overhead_pct']:+.2f}% |")
    print(f"median overhead {ratios[len(ratios) // 2]:+.2f}% (min {ratios[0]:+.2f}%, max {ratios[-1]:+.2f}%)")
    out = REPO / "benchmarks" / "results" / f"tracking_overhead_{a.stage}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"stage": a.stage, "machine": platform.platform(), "cpus": os.cpu_count(),
                               "rows": rows, "median_overhead_pct": ratios[len(ratios) // 2]}, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
