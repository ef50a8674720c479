"""The sample ledger: which curated rows each rl step consumed, in order, read from the run's own shards.

``ledger(root, params)`` -> ``{"split": {path, sha256}, "steps": [{step, prompts: [prompt_id, ...], samples,
used}]}``: the curated train split the prompts were drawn from (its file and content hash), then for each step
(``paths.rl_dir/shards/step_NNNNN.parquet``, written by the step itself) the prompt ids in the order the step
sampled them (each once, its G samples counted), how many samples entered the update. Two runs consumed the same
sequence exactly when their ledgers are equal: what ``tests/test_slow.py`` checks of a SIGKILLed and resumed run
against an uninterrupted one (the question NeMo-RL#3480 and prime-rl#3299 ask of resumed runs).

RL only: the sft and distill stages record no per-step row ids yet (their order is a function of the seed and
the split, but a ledger must be read, not recomputed); ``posttrain lineage <rl model> --samples`` prints it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from posttrain.config import Params
from posttrain.digests import sha256_file


def ledger(root: Path, params: Params) -> dict[str, Any]:
    """The rl run's ledger under ``root`` (see the module docstring); ``steps`` empty when no shard exists."""
    split = root / params.paths.curated_dir / "train.parquet"
    out: dict[str, Any] = {"split": {"path": str(split.relative_to(root)) if split.is_relative_to(root) else str(split),
                                     "sha256": sha256_file(split) if split.is_file() else None}, "steps": []}
    for f in sorted((root / params.paths.rl_dir / "shards").glob("step_*.parquet")):
        t = pq.read_table(f, columns=["prompt_id", "step", "used"])
        ids = t.column("prompt_id").to_pylist()
        steps = set(t.column("step").to_pylist())
        out["steps"].append({"step": steps.pop() if len(steps) == 1 else sorted(steps),
                             "prompts": list(dict.fromkeys(ids)), "samples": len(ids),
                             "used": sum(bool(u) for u in t.column("used").to_pylist())})
    return out
