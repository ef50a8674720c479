"""What ``dvc.lock`` says about params and outputs, for ``posttrain.lineage``'s walk: the params that pin an input
outside the repo (:func:`pins`), the params whose value is another stage's output (:func:`refs`), and the stage
that produces a path (:func:`producer`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import StageError

NAMES = ("base", "hub_id", "student")  # params that name a model or dataset outside the repo


def pins(params: Any, prefix: str = "") -> dict[str, Any]:
    """The params (as dvc.lock records them) that name an input outside the repo (model.base, a hub dataset's
    hub_id, a pretrained distill.student) with their revisions (null: the hub's moving main branch).
    Local folders and files are hashed by DVC instead; ``tiny`` is built, not fetched."""
    out: dict[str, Any] = {}
    if isinstance(params, dict) and any("." in str(k) for k in params):  # dvc.lock's flat `model.base: ...`
        params = _nested(params)
    items = params.items() if isinstance(params, dict) else enumerate(params) if isinstance(params, list) else []
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict | list):
            out |= pins(v, key)
        elif str(k) in NAMES and isinstance(v, str) and v != "tiny" and not Path(v).exists():
            out[key] = v
            rev = "student_revision" if k == "student" else "revision"
            for name in (rev, "sha256"):
                if name in params and (name == rev or params[name] is not None):
                    out[f"{prefix}.{name}" if prefix else name] = params[name]
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model.base": b, "model.sha256": h}`` -> ``{"model": {"base": b, "sha256": h}}``."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        *parents, leaf = str(k).split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def _leaves(params: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every string in ``params`` (lists indexed as ``key[i]``)."""
    if isinstance(params, dict):
        for k, v in params.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(params, list):
        for i, v in enumerate(params):
            yield from _leaves(v, f"{prefix}[{i}]")
    elif isinstance(params, str):
        yield prefix, params


def refs(lock: dict[str, Any], stage: str, root: Path | None = None) -> dict[str, str]:
    """The params of ``stage`` (as dvc.lock records them, whatever the params file) whose value is an output of
    another stage (or a path inside one), relative or absolute under ``root``: param key -> that path."""
    out: dict[str, str] = {}
    base = str(root.resolve()) if root is not None else None
    for _, params in sorted(lock[stage].get("params", {}).items()):
        for key, v in _leaves(params):
            path = os.path.normpath(v) if v.strip() else v
            if base is not None and os.path.isabs(path) and path.startswith(base + os.sep):
                path = os.path.relpath(path, base)
            if (hit := producer(lock, path)) is not None and hit[0] != stage:
                out[key] = path
    return out


def load_lock(root: Path) -> dict[str, Any]:
    lock = root / "dvc.lock"
    if not lock.is_file():
        raise StageError(f"{lock}: no dvc.lock (run `dvc repro` first)")
    return yaml.safe_load(lock.read_text())["stages"]


def under(path: str, out: str) -> bool:
    return path == out or path.startswith(out.rstrip("/") + "/")


def producer(lock: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(stage, out path) of the stage whose output is ``path`` or contains it."""
    for stage, e in lock.items():
        for o in e.get("outs", []):
            if under(path, o["path"]):
                return stage, o["path"]
    return None
