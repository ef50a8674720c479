"""What publishing one weight version costs the asynchronous trainer (``rl.overlap``'s ``WeightStore.publish``):
the time the trainer's thread is blocked, per step, for the whole state dict written in that thread (``before``:
the store as it was) against the trainable tensors snapshotted and written by the store's own thread (``now``),
on a LoRA policy and on full fine-tuning. Arms alternate within the run; every repeat is reported.

    python benchmarks/weight_publish.py MODEL_FOLDER --repeats 5   # writes benchmarks/results/weight_publish.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from posttrain import modeling
from posttrain.config import LoraCfg, ModelCfg
from posttrain.rl.overlap import WeightStore

ROOT = Path(__file__).resolve().parents[1]


def before(model: torch.nn.Module, root: Path, version: int) -> float:
    t = time.perf_counter()
    tmp = root / f".v_{version:06d}.tmp"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, root / f"v_{version:06d}.pt")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weight_publish.json")
    a = ap.parse_args()
    res: dict = {"folder": a.folder, "repeats": a.repeats, "arms": {}}
    for name, cfg in (("lora_r8_all_linear", ModelCfg(lora=LoraCfg(r=8, alpha=16, dropout=0.0,
                                                                     target_modules="all-linear"))),
                      ("full", ModelCfg())):
        model = modeling.load_policy(a.folder, cfg, torch.device("cpu"))
        runs: dict[str, list[float]] = {"before": [], "now": [], "now_written": []}
        with tempfile.TemporaryDirectory() as d:
            store = WeightStore(Path(d) / "now")
            (Path(d) / "before").mkdir()
            for i in range(a.repeats):
                for arm in ("before", "now") if i % 2 == 0 else ("now", "before"):
                    if arm == "before":
                        runs["before"].append(round(before(model, Path(d) / "before", i), 4))
                    else:
                        t = time.perf_counter()
                        store.publish(model, i)
                        runs["now"].append(round(time.perf_counter() - t, 4))
                        store.flush()
                        runs["now_written"].append(round(time.perf_counter() - t, 4))
            size = {arm: (Path(d) / arm / f"v_{a.repeats - 1:06d}.pt").stat().st_size for arm in ("before", "now")}
        res["arms"][name] = {"blocked_s": runs, "bytes": size}
        print(f"{name}: trainer blocked per publish, before {runs['before']} s ({size['before']:,} B), now "
              f"{runs['now']} s ({size['now']:,} B; written by the store's thread in {runs['now_written']} s)")
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
