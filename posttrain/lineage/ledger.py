"""The sample ledger: which curated rows each rl step consumed, in order, read from the run's own shards.

``ledger(root, params)`` -> ``{"split": {path, sha256}, "steps": [{step, prompts: [prompt_id, ...], samples,
used}]}``: the curated train split the prompts were drawn from (its file and content hash), then for each step
(``paths.rl_dir/shards/step_NNNNN.parquet``, written by the step itself) the prompt ids in the order the step
sampled them (each once, its G samples counted), how many samples entered the update. Two runs consumed the same
sequence exactly when their ledgers are equal: what ``tests/test_slow.py`` checks of a SIGKILLed and resumed run
against an uninterrupted one (the question NeMo-RL#3480 and prime-rl#3299 ask of resumed runs).

``sft_ledger(root, params)``: the same for sft, read from ``paths.sft_report_dir/ledger.parquet``, which the sft
stage writes from the ledger its training loop checkpoints (:func:`write_sft`): per step the demo ids of
``curated/sft.parquet`` in the order it trained on them, each with its rendering (cot, direct, tool).

``distill_ledger(root, params)``: the distill stage's phases A-C (``paths.distill_report_dir/ledger.parquet``,
checkpointed with the loop): per step its phase and the ids of ``curated/train.parquet`` it drew, in order, each
with the model that sampled it (``teacher`` or ``student``); its student's cold start has an sft ledger of its
own (``sft_ledger.parquet`` beside it). ``posttrain lineage <model> --samples`` prints any of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.config import Params
from posttrain.digests import sha256_file

SFT_LEDGER = "ledger.parquet"  # in paths.sft_report_dir
DISTILL_LEDGER = "ledger.parquet"  # in paths.distill_report_dir: phases A-C
STUDENT_SFT_LEDGER = "sft_ledger.parquet"  # in paths.distill_report_dir: the student's cold start
_SFT_SCHEMA = pa.schema([("step", pa.int32()), ("id", pa.string()), ("style", pa.string())])
_DISTILL_SCHEMA = pa.schema([("step", pa.int32()), ("phase", pa.string()), ("id", pa.string()),
                             ("sampler", pa.string())])


def _split(root: Path, split: Path) -> dict[str, Any]:
    return {"path": str(split.relative_to(root)) if split.is_relative_to(root) else str(split),
            "sha256": sha256_file(split) if split.is_file() else None}


def ledger(root: Path, params: Params) -> dict[str, Any]:
    """The rl run's ledger under ``root`` (see the module docstring); ``steps`` empty when no shard exists."""
    out: dict[str, Any] = {"split": _split(root, root / params.paths.curated_dir / "train.parquet"), "steps": []}
    for f in sorted((root / params.paths.rl_dir / "shards").glob("step_*.parquet")):
        t = pq.read_table(f, columns=["prompt_id", "step", "used"])
        ids = t.column("prompt_id").to_pylist()
        steps = set(t.column("step").to_pylist())
        out["steps"].append({"step": steps.pop() if len(steps) == 1 else sorted(steps),
                             "prompts": list(dict.fromkeys(ids)), "samples": len(ids),
                             "used": sum(bool(u) for u in t.column("used").to_pylist())})
    return out


def write_sft(steps: list[dict[str, Any]], path: Path) -> None:
    """The sft run's ledger (``training.sft_train``'s ``ledger``: per step ``{step, ids, styles}``) as one row per
    (step, demo), in training order."""
    cols: dict[str, list[Any]] = {"step": [], "id": [], "style": []}
    for s in steps:
        cols["step"] += [s["step"]] * len(s["ids"])
        cols["id"] += s["ids"]
        cols["style"] += s["styles"]
    pq.write_table(pa.table(cols, schema=_SFT_SCHEMA), path)


def sft_ledger(root: Path, params: Params, student: bool = False) -> dict[str, Any]:
    """The sft run's ledger (``student``: the distill student's cold start): the demos split and, per step, the
    demo ids and renderings it trained on; ``steps`` empty when the stage wrote no ledger."""
    out: dict[str, Any] = {"split": _split(root, root / params.paths.curated_dir / "sft.parquet"), "steps": []}
    f = (root / params.paths.distill_report_dir / STUDENT_SFT_LEDGER if student else
         root / params.paths.sft_report_dir / SFT_LEDGER)
    if f.is_file():
        t = pq.read_table(f).to_pydict()
        for step, i, style in zip(t["step"], t["id"], t["style"], strict=True):
            if not out["steps"] or out["steps"][-1]["step"] != step:
                out["steps"].append({"step": step, "ids": [], "styles": []})
            out["steps"][-1]["ids"].append(i)
            out["steps"][-1]["styles"].append(style)
    return out


def write_distill(steps: list[dict[str, Any]], path: Path) -> None:
    """The distill loop's ledger (per step ``{step, phase, ids, samplers}``) as one row per (step, prompt drawn)."""
    cols: dict[str, list[Any]] = {"step": [], "phase": [], "id": [], "sampler": []}
    for s in steps:
        cols["step"] += [s["step"]] * len(s["ids"])
        cols["phase"] += [s["phase"]] * len(s["ids"])
        cols["id"] += s["ids"]
        cols["sampler"] += s["samplers"]
    pq.write_table(pa.table(cols, schema=_DISTILL_SCHEMA), path)


def distill_ledger(root: Path, params: Params) -> dict[str, Any]:
    """The distill run's ledger: the train split and, per step, its phase, the prompt ids drawn and who sampled
    each; ``steps`` empty when the stage wrote none."""
    out: dict[str, Any] = {"split": _split(root, root / params.paths.curated_dir / "train.parquet"), "steps": []}
    f = root / params.paths.distill_report_dir / DISTILL_LEDGER
    if f.is_file():
        t = pq.read_table(f).to_pydict()
        for step, phase, i, who in zip(t["step"], t["phase"], t["id"], t["sampler"], strict=True):
            if not out["steps"] or out["steps"][-1]["step"] != step:
                out["steps"].append({"step": step, "phase": phase, "ids": [], "samplers": []})
            out["steps"][-1]["ids"].append(i)
            out["steps"][-1]["samplers"].append(who)
    return out
