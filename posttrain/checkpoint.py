"""Resumable checkpoints: what a killed sft, rl or distill run restarts from.

A resumable checkpoint holds model, optimizer, scheduler, RNG states, the step and the training log, plus a
fingerprint of everything that determines the run's result (params sections less the fields marked
``config.NOT_RESULT``, model config, input data hash). A checkpoint whose fingerprint differs from the current
run's is stale: never resumed from, moved aside (not deleted). Rank 0 writes (atomically, keeping the newest
two); every rank reads. States are full (unsharded, optimizer state keyed by parameter name), so any world
size and strategy can resume them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel

from posttrain import distributed
from posttrain.config import NOT_RESULT
from posttrain.outputs import atomic_path

log = logging.getLogger("posttrain.checkpoint")


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(*parts: Any) -> str:
    """A stable hash of what determines a run's result. Pydantic models are dumped without the fields marked
    ``config.NOT_RESULT`` (micro-batch size, packing, checkpoint cadence): changing those between a kill and
    a resume still resumes."""
    return hashlib.sha256(json.dumps([_result_fields(p) for p in parts], sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


def _result_fields(x: Any) -> Any:
    if isinstance(x, BaseModel):
        return {name: _result_fields(getattr(x, name)) for name, f in type(x).model_fields.items()
                if (f.json_schema_extra or {}) != NOT_RESULT}
    if isinstance(x, list | tuple):
        return [_result_fields(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _result_fields(v) for k, v in x.items()}
    return x


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


def save_resumable(ckpt_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``step_<N>.pt`` atomically, then prune all but the newest ``keep`` (rank 0 only: the others
    return the path it writes)."""
    path = ckpt_dir / f"step_{step:07d}.pt"
    if not distributed.current().main:
        return path
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def load_resumable(ckpt_dir: Path, fp: str) -> dict[str, Any] | None:
    """The newest checkpoint whose fingerprint is ``fp``. Checkpoints of another configuration are never
    resumed from, and never deleted either: the folder is moved aside to ``<name>.stale-<their fp>-<time>``
    (logged), so a changed setting cannot wipe hours of training. Under torchrun rank 0 looks first (and moves
    aside); the other ranks then read what it left (the folder must be on storage every rank sees)."""
    d = distributed.current()
    if not d.main:
        d.barrier()
    try:
        return _load_resumable(ckpt_dir, fp)
    finally:
        if d.main:
            d.barrier()


def _load_resumable(ckpt_dir: Path, fp: str) -> dict[str, Any] | None:
    if not ckpt_dir.is_dir():
        return None
    for path in sorted(ckpt_dir.glob("step_*.pt"), reverse=True):
        state = torch.load(path, weights_only=False, map_location="cpu")  # not onto the device that saved it

        if state.get("fingerprint") == fp:
            return state
        aside = ckpt_dir.with_name(f"{ckpt_dir.name}.stale-{state.get('fingerprint')}-{time.strftime('%Y%m%d-%H%M%S')}")
        ckpt_dir.rename(aside)
        log.warning("checkpoints in %s belong to another configuration (fingerprint %s, this run %s): moved "
                    "aside to %s; delete it when it is no longer needed", ckpt_dir, state.get("fingerprint"), fp,
                    aside)
        return None
    return None


def rank_rngs() -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (a collective under torchrun)."""
    return distributed.current().gather_shards([rng_state()])


def set_rank_rng(saved: dict[str, Any] | list[dict[str, Any]]) -> None:
    """Restore this rank's RNG states from ``rank_rngs()``. Saved at another world size: rank 0 takes rank 0's
    and the others keep their fresh per-rank seeds (data order is (seed, step)-pure either way; only
    dropout-like randomness differs from an uninterrupted run)."""
    d = distributed.current()
    states = [saved] if isinstance(saved, dict) else saved
    if len(states) == d.world:
        set_rng_state(states[d.rank])
    else:
        if d.rank == 0:
            set_rng_state(states[0])
        log.warning("checkpoint saved at world size %d, resuming at %d: per-rank RNG states start fresh",
                    len(states), d.world)


def save_loop_state(ckpt_dir: Path, step: int, fp: str, cursor_pos: int, model: torch.nn.Module,
                    opt: torch.optim.Optimizer, log_rows: list[dict[str, Any]], ref: torch.nn.Module | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    """Resumable checkpoint of an online loop (rl, distill): model, optimizer, RNG, step, prompt cursor, log,
    ``ref`` (a plain reference model that changes during the run: rl.ref_reset) and ``extra`` (other loop
    state, e.g. per-prompt priors). Full (unsharded) states, written by rank 0; every rank calls it (gathering
    is a collective)."""
    msd, osd = distributed.current().state(model, opt)
    save_resumable(ckpt_dir, step, {"fingerprint": fp, "step": step, "cursor": cursor_pos, "model": msd,
                                    "optimizer": osd, "rng": rank_rngs(), "log": log_rows,
                                    "ref": None if ref is None else ref.state_dict(), "extra": extra or {}})


def restore_loop_state(ckpt_dir: Path, fp: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                       ref: torch.nn.Module | None = None, extra: dict[str, Any] | None = None
                       ) -> tuple[int, list[dict[str, Any]], int]:
    """Load the newest matching ``save_loop_state`` checkpoint into model/optimizer/RNG (and ``ref``; ``extra``
    is updated with the saved extra state). Returns (step, log rows, cursor position); (0, [], 0) when there
    is none."""
    state = load_resumable(ckpt_dir, fp)
    if state is None:
        return 0, [], 0
    if extra is not None:
        extra.update(state.get("extra") or {})
    if ref is not None and state.get("ref") is not None:
        ref.load_state_dict(state["ref"])
    distributed.current().load_state(model, opt, state["model"], state["optimizer"])
    set_rank_rng(state["rng"])
    log.info("resuming from %s step %d", ckpt_dir, state["step"])
    return state["step"], state["log"], state["cursor"]
