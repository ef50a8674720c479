"""Helpers around a DVC repository that DVC itself does not offer.

``clear_stale_locks``: a ``dvc repro`` killed with SIGKILL (OOM killer, a pre-empted worker) leaves its
entries in ``.dvc/tmp/rwlock``. DVC drops an entry by itself once the process is gone, but while the killed
process is a zombie (its parent has not reaped it yet; measured here: about a second after SIGKILL, and for
as long as a supervising process never waits on it) DVC counts it as alive and refuses to run ("is busy,
it is being blocked by ..."). This removes the entries of processes that are gone or zombies, so a lock
held by a live ``dvc`` is never broken.

``workspace_lock``: one pipeline invocation at a time per workspace. A flow run rewrites ``params.yaml`` with
its overrides and then runs stage after stage; a second run in the same checkout meanwhile would run the
first one's stages with its own params (or they would collide on DVC's lock). The lock is an ``flock`` on
``.dvc/tmp/posttrain-workspace.lock``: the kernel releases it when its holder dies (a killed run never
leaves it stuck), and the file says who holds it. A second run waits up to ``wait_s`` for it, then refuses
in one line naming the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from posttrain.errors import StageError
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


@contextmanager
def workspace_lock(repo: str | Path, owner: str, wait_s: float) -> Iterator[None]:
    """Hold the workspace for one pipeline invocation (see module docstring); ``owner`` says who, in the file."""
    path = Path(repo) / ".dvc" / "tmp" / "posttrain-workspace.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
                    raise StageError(f"workspace {Path(repo).resolve()} is in use by another pipeline run "
                                     f"({holder}); waited {wait_s:.0f}s (prefect.workspace_wait_s). Run the "
                                     "other one in its own clone, or wait for it") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock
