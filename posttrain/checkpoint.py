"""Resumable checkpoints: what a killed sft, rl or distill run restarts from.

A resumable checkpoint is a folder ``<ckpt_dir>/step_<N>/``:

- ``meta.json``: the fingerprint of everything that determines the run's result (params sections less the
  fields marked ``config.NOT_RESULT``, model config, input data hash), the step, world size and strategy. It is
  written last and is all a resume reads to decide whether a checkpoint matches: nothing else is loaded.
- the model's *trainable* parameters and their optimizer state (and a moving reference model), written through
  ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards (FSDP2: no rank ever gathers a full
  state), DDP and one process write plain tensors once. A LoRA checkpoint thus holds the adapters and their
  Adam moments, not the frozen base. DCP reshards on load: a checkpoint resumes under any world size and
  strategy (optimizer state is keyed by parameter name).
- ``rest.pt``: the small plain state (every rank's RNG states, step, training log, scheduler, prompt cursor),
  written by rank 0 and read with ``weights_only=True`` and ``mmap=True``, on the CPU (``map_location``).

A checkpoint whose fingerprint differs from the current run's is stale: never resumed from, moved aside (not
deleted). A folder is written as ``.step_<N>.partial`` and renamed in when complete; the newest two are kept.
DCP itself reads ``param_groups`` (plain Python values) with ``weights_only=False``; the tensors it reads are
raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from posttrain import distributed
from posttrain.config import NOT_RESULT

log = logging.getLogger("posttrain.checkpoint")
META, REST = "meta.json", "rest.pt"
FORMAT = 2  # 1: one torch.save file step_<N>.pt with full states (before DCP)


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
    """This process's RNG states, in types ``torch.load(weights_only=True)`` reads (numpy's key as a list)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
            "python": random.getstate()}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    name, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(s["python"])


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


# ------------------------------------------------------------------------------------------ state dicts
def model_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state dicts of the *trainable* parameters (LoRA: the adapters), keyed by the
    model's own parameter names, never gathered: DTensor shards under FSDP2, plain tensors otherwise (what
    ``torch.distributed.checkpoint`` saves and reshards). An optimizer without state yet gets it (a zero
    step at lr 0, torch's own ``_init_optim_state``), so the result is also the template a load reads
    into. A collective under FSDP2."""
    pre, o = _prefix(model), _options()
    msd, osd = get_model_state_dict(model, options=o), get_optimizer_state_dict(model, opt, options=o)
    trainable = {n for n, p in _named(model) if p.requires_grad}  # torch keeps a tied frozen head: drop it
    msd = {k: v for k, v in msd.items() if k in trainable}
    return _strip(msd, pre), {"state": _strip(osd["state"], pre), "param_groups": [
        {**g, "params": [n.removeprefix(pre) for n in g["params"]]} for g in osd["param_groups"]]}


def load_model_state(model: torch.nn.Module, opt: torch.optim.Optimizer, msd: dict[str, Any],
                     osd: dict[str, Any]) -> None:
    """The inverse of ``model_state`` (dicts in its layout, e.g. filled by ``dcp.load``). Only trainable
    parameters are loaded; a missing one or an unknown name is an error."""
    pre, o = _prefix(model), _options(strict=False)
    keys = set_model_state_dict(model, {pre + k: v for k, v in msd.items()}, options=o)
    trainable = {n for n, p in _named(model) if p.requires_grad}
    missing = set(keys.missing_keys) & trainable
    if missing or keys.unexpected_keys:
        raise RuntimeError(f"checkpoint does not fit the model: missing {sorted(missing)[:5]}, unexpected "
                           f"{sorted(keys.unexpected_keys)[:5]}")
    set_optimizer_state_dict(model, opt, {
        "state": {pre + k: v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [pre + n for n in g["params"]]} for g in osd["param_groups"]]},
        options=o)


def ref_state(ref: torch.nn.Module) -> dict[str, Any]:
    """A moving reference model's state dict under the model's own names (an FSDP2 reference is a ``Forward``
    handle of shards: the same checkpoint then resumes under any strategy, as the policy's does)."""
    return _strip(ref.state_dict(), _prefix(ref))


def _options(strict: bool = True) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _named(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``model``'s parameters, named as its state dict names them (DDP's ``module.`` dropped)."""
    inner = model.module if hasattr(model, "module") and isinstance(model.module, distributed.Forward) else model
    return inner.named_parameters()


def _prefix(model: torch.nn.Module) -> str:
    """What ``Forward`` adds to state-dict names (checkpoints store the model's own names)."""
    inner = model.module if hasattr(model, "module") else model
    return distributed.PREFIX if isinstance(inner, distributed.Forward) else ""


def _strip(d: dict[str, Any], pre: str) -> dict[str, Any]:
    return {k.removeprefix(pre): v for k, v in d.items()}


# ------------------------------------------------------------------------------------------ save and restore
def save(ckpt_dir: Path, step: int, fp: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
         rest: dict[str, Any], ref: torch.nn.Module | None = None, keep: int = 2) -> Path:
    """Write ``ckpt_dir/step_<N>``: ``model``'s trainable parameters and ``opt``'s state through DCP (sharded
    under FSDP2), ``ref``'s weights (a reference model that moves during the run) if given, and ``rest`` (plain
    Python and tensors) with every rank's RNG states. Every rank calls it (a collective); then the newest
    ``keep`` are kept."""
    d = distributed.current()
    final, tmp = ckpt_dir / f"step_{step:07d}", ckpt_dir / f".step_{step:07d}.partial"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    d.barrier()
    msd, osd = model_state(model, opt)
    tensors = {"model": msd, "optim": osd, **({"ref": ref_state(ref)} if ref is not None else {})}
    with warnings.catch_warnings():  # one process: DCP warns that it assumes one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=tmp, no_dist=not d.active)
    rngs = rank_rngs()
    if d.main:
        torch.save(_loadable({"step": step, "rng": rngs, **rest}), tmp / REST)
        (tmp / META).write_text(json.dumps({"fingerprint": fp, "step": step, "world": d.world,
                                            "strategy": d.strategy if d.active else "none", "format": FORMAT,
                                            "ref": ref is not None}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in _checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old)
    d.barrier()
    return final


def restore(ckpt_dir: Path, fp: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
            ref: torch.nn.Module | None = None) -> dict[str, Any] | None:
    """Load the newest checkpoint whose fingerprint is ``fp`` into ``model``, ``opt`` (and ``ref``) and this
    rank's RNG, resharded to this job's world size and strategy; returns the saved ``rest`` (with ``step``), or
    None when there is none (see ``find``). Every rank calls it."""
    path = find(ckpt_dir, fp)
    if path is None:
        return None
    d = distributed.current()
    msd, osd = model_state(model, opt)  # this job's layout: DCP reads into it (shards under FSDP2)
    tensors = {"model": msd, "optim": osd}
    if ref is not None and json.loads((path / META).read_text()).get("ref"):
        tensors["ref"] = ref_state(ref)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=path, no_dist=not d.active)
    load_model_state(model, opt, tensors["model"], tensors["optim"])
    if "ref" in tensors:
        ref.load_state_dict({_prefix(ref) + k: v for k, v in tensors["ref"].items()})
    rest = torch.load(path / REST, map_location="cpu", mmap=True, weights_only=True)
    set_rank_rng(rest.pop("rng"))
    log.info("resuming from %s step %d", path, rest["step"])
    return rest


def _loadable(x: Any) -> Any:
    """``x`` with numpy scalars and arrays as Python numbers and lists (what ``weights_only=True`` reads)."""
    if isinstance(x, dict):
        return {k: _loadable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_loadable(v) for v in x)
    return x.tolist() if isinstance(x, np.ndarray | np.generic) else x


def _checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder is complete once renamed from ``.partial``)."""
    return sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir() and (p / META).is_file())


def find(ckpt_dir: Path, fp: str) -> Path | None:
    """The newest checkpoint whose fingerprint is ``fp`` (read from its ``meta.json``: nothing is loaded).
    Checkpoints of another configuration (or of the older single-file format) are never resumed from, and
    never deleted either: the folder is moved aside to ``<name>.stale-<their fp>-<time>`` (logged), so a
    changed setting cannot wipe hours of training. Under torchrun rank 0 looks first (and moves aside); the
    other ranks then read what it left (the folder must be on storage every rank sees)."""
    d = distributed.current()
    if not d.main:
        d.barrier()
    try:
        return _find(ckpt_dir, fp)
    finally:
        if d.main:
            d.barrier()


def _find(ckpt_dir: Path, fp: str) -> Path | None:
    if not ckpt_dir.is_dir():
        return None
    found = _checkpoints(ckpt_dir)
    theirs = json.loads((found[-1] / META).read_text())["fingerprint"] if found else None
    if theirs == fp:
        return found[-1]
    if theirs is None and not list(ckpt_dir.glob("step_*.pt")):
        return None
    theirs = theirs or "format1"
    aside = ckpt_dir.with_name(f"{ckpt_dir.name}.stale-{theirs}-{time.strftime('%Y%m%d-%H%M%S')}")
    ckpt_dir.rename(aside)
    log.warning("checkpoints in %s belong to another configuration or format (fingerprint %s, this run %s): "
                "moved aside to %s; delete it when it is no longer needed", ckpt_dir, theirs, fp, aside)
    return None


def save_loop_state(ckpt_dir: Path, step: int, fp: str, cursor_pos: int, model: torch.nn.Module,
                    opt: torch.optim.Optimizer, log_rows: list[dict[str, Any]], ref: torch.nn.Module | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    """Resumable checkpoint of an online loop (rl, distill): ``save`` with the prompt cursor, the log, ``ref``
    (a plain reference model that changes during the run: rl.ref_reset) and ``extra`` (other loop state, e.g.
    per-prompt priors). Every rank calls it (a collective)."""
    save(ckpt_dir, step, fp, model, opt, {"cursor": cursor_pos, "log": log_rows, "extra": extra or {}}, ref)


def restore_loop_state(ckpt_dir: Path, fp: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                       ref: torch.nn.Module | None = None, extra: dict[str, Any] | None = None
                       ) -> tuple[int, list[dict[str, Any]], int]:
    """Load the newest matching ``save_loop_state`` checkpoint into model/optimizer/RNG (and ``ref``; ``extra``
    is updated with the saved extra state). Returns (step, log rows, cursor position); (0, [], 0) when there
    is none."""
    rest = restore(ckpt_dir, fp, model, opt, ref)
    if rest is None:
        return 0, [], 0
    if extra is not None:
        extra.update(rest.get("extra") or {})
    return rest["step"], rest["log"], rest["cursor"]
