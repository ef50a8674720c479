"""Helpers around a DVC repository that DVC itself does not offer.

``clear_stale_locks``: a ``dvc repro`` killed with SIGKILL (OOM killer, a pre-empted worker) leaves its
entries in ``.dvc/tmp/rwlock``, and every later ``dvc repro`` refuses to start ("is busy, it is being
blocked by ...") until someone deletes the file by hand. This removes only the entries whose process is
gone, so a lock held by a live ``dvc`` is never broken.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.schema import atomic_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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
