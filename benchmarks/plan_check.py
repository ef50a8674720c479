"""The memory plan checked against a real run: ``posttrain plan``'s numbers (fake process group, fake tensors)
against the same tracker on the same update step run for real at 2 ranks on gloo (real tensors, this CPU), per
stage and per category, with the difference in %. Run under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/plan_check.py \\
        models/base/config.json -p profiles/smollm2-gsm8k.yaml --seq-len 256
    # writes benchmarks/results/plan_check.json (rank 0)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from posttrain import distributed, plan
from posttrain.config import load_params

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", help="a model folder or config.json")
    ap.add_argument("-p", "--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_check.json"))
    a = ap.parse_args()
    params, config = load_params(Path(a.params)), plan.load_config(a.config)
    d = distributed.init("gloo", "fsdp2", 600)
    measured = {s.stage: plan.measure(config, params, s, d) for s in plan.shapes(params, a.seq_len)}
    distributed.shutdown()
    if d.rank:
        return
    predicted = {r["stage"]: r for r in plan.plan(config, params, d.world, 80.0, a.seq_len)}
    cols = [*plan.CATEGORIES, "Full copy", "Frozen model", "Update peak"]
    print(f"{a.config}, {params.model.dtype}, world {d.world}: predicted (fake) / measured (gloo), GiB per rank")
    print(f"{'stage':8} " + " ".join(f"{c:>22}" for c in cols))
    rows = []
    for stage, got in measured.items():
        pred = predicted[stage]
        cells = []
        for c in cols:
            pct = 100 * (pred[c] - got[c]) / got[c] if got[c] else 0.0
            cells.append(f"{pred[c]:7.3f}/{got[c]:7.3f} {pct:+5.1f}%")
            rows.append({"stage": stage, "category": c, "predicted_gib": pred[c], "measured_gib": got[c],
                         "diff_pct": round(pct, 2)})
        print(f"{stage:8} " + " ".join(f"{x:>22}" for x in cells))
    Path(a.out).write_text(json.dumps({"config": a.config, "params": a.params, "world": d.world,
                                       "seq_len": a.seq_len, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
