"""Helpers around a DVC repository that DVC itself does not offer.

``clear_stale_locks``: a ``dvc repro`` killed with SIGKILL (OOM killer, a pre-empted worker) leaves its
entries in ``.dvc/tmp/rwlock``. DVC drops an entry by itself once the process is gone, but while the killed
process is a zombie (its parent has not reaped it yet; measured here: about a second after SIGKILL, and for
as long as a supervising process never waits on it) DVC counts it as alive and refuses to run ("is busy,
it is being blocked by ..."). This removes the entries of processes that are gone or zombies, so a lock
held by a live ``dvc`` is never broken.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from posttrain.schema import atomic_path


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def clear_stale_locks(repo: str | Path = ".") -> list[str]:
    """Drop rwlock entries of dead processes; return the paths that were unlocked."""
    path = Path(repo) / ".dvc" / "tmp" / "rwlock"
    if not path.is_file():
        return []
    info = json.loads(path.read_text() or "{}")
    freed: list[str] = []
    writes = info.get("write", {})
    for p, holder in list(writes.items()):
        if not _alive(int(holder["pid"])):
            freed.append(p)
            del writes[p]
    for p, holders in list(info.get("read", {}).items()):
        live = [h for h in holders if _alive(int(h["pid"]))]
        if len(live) < len(holders):
            freed.append(p)
        if live:
            info["read"][p] = live
        else:
            del info["read"][p]
    if freed:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(info))
    return sorted(set(freed))
