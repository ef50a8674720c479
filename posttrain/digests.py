"""``folder_digest``: what identifies a model folder's bytes (a reward model's cache key in each process, a served
judge's identity in the judge-call cache). sha256 over each file's path (relative, POSIX) and content digest, in
path order; recomputed only when a file's name, size or mtime moved, so asking again per batch costs a ``stat``
per file. ``sha256_file`` and ``wheel_cache``: a file's sha256, and where a pinned wheel (``model.base:
pip:...``) is kept by its sha256 (the model stage fills it; ``posttrain lineage --verify`` re-hashes it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

_KNOWN: dict[str, tuple[tuple[Any, ...], str]] = {}  # folder -> (its files' names, sizes, mtimes; their digest)


def folder_digest(folder: str | Path) -> str:
    """``sha256:<hex>`` of every file under ``folder`` (relative path and bytes)."""
    root = Path(folder).resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    sig = tuple((p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    known = _KNOWN.get(str(root))
    if known is not None and known[0] == sig:
        return known[1]
    h = hashlib.sha256()
    for p in files:
        with p.open("rb") as f:
            h.update(f"{p.relative_to(root).as_posix()}\0{hashlib.file_digest(f, 'sha256').hexdigest()}\n".encode())
    _KNOWN[str(root)] = (sig, "sha256:" + h.hexdigest())
    return _KNOWN[str(root)][1]


CACHE_ENV = "POSTTRAIN_CACHE"


def cache_dir() -> Path:
    """``$POSTTRAIN_CACHE``, else ``$XDG_CACHE_HOME/posttrain``, else ``~/.cache/posttrain``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posttrain"


def wheel_cache(sha256: str, cache: Path | None = None) -> Path:
    """The folder holding the wheel whose sha256 is ``sha256`` (content-addressed: one wheel per folder)."""
    return (cache or cache_dir()) / "wheels" / sha256


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
