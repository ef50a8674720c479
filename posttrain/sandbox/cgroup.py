"""A memory cgroup around one sandbox's whole process tree, where this host lets the caller make one.

RLIMIT_AS bounds each process; a program that forks, or holds memfds or SysV shared memory, could hold several
times ``memory_mb`` (0.6-1.2 GiB were seen at 256). A cgroup's limit is charged for every page the tree
touches, its processes, its shared memory and tmpfs files and the kernel objects it makes (the inodes of
200,000 empty files in ``/scratch``): past it the kernel's OOM killer ends a process of the tree, which the
parent reads back (``oom_kill`` in the cgroup's counters) as status ``memory``.

Where: a child of the caller's own memory cgroup, cgroup v1 (``/sys/fs/cgroup/memory/<path>``, the path from
``/proc/self/cgroup``) or v2 (``/sys/fs/cgroup/<path>``, when the memory controller is enabled for its
children). Making one needs write access there: root on most hosts, or a delegated subtree. Where none can be
made (probed once, :func:`available`, logged), the sandbox runs as before, each process bounded by RLIMIT_AS and
their number by RLIMIT_NPROC: ``memory_mb`` x ``max_procs`` bounds the tree, and docs/sandbox.md says so.

Why by hand: the cgroup file interface is a few writes; the libraries that wrap it (systemd's transient
units, ``cgroupspy``) assume systemd or v1 alone.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import subprocess
import time
from pathlib import Path

from posttrain.config.sandbox import SandboxCfg

ROOT = Path("/sys/fs/cgroup")
HEADROOM_MB = 64  # the launcher and the page cache of the interpreter's files, beside the program's memory_mb
_SEQ = itertools.count()
log = logging.getLogger("sandbox")


def limit_mb(cfg: SandboxCfg) -> int:
    """A sandbox tree's limit: a process's ``memory_mb``, the scratch tmpfs (``max_file_mb`` + 1: its pages are
    charged too) and ``HEADROOM_MB``."""
    return cfg.memory_mb + cfg.max_file_mb + 1 + HEADROOM_MB


def _own() -> tuple[Path, int] | None:
    """The caller's memory cgroup folder and its version (1 or 2), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            return ROOT / "memory" / path.lstrip("/"), 1
    for line in lines:
        if line.startswith("0::"):
            base = ROOT / "unified" if (ROOT / "unified" / "cgroup.controllers").is_file() else ROOT
            folder = base / line[3:].lstrip("/")
            ctrls = (folder / "cgroup.subtree_control").read_text().split() if folder.is_dir() else []
            return (folder, 2) if "memory" in ctrls else None
    return None


class TreeLimit:
    """One cgroup, limit ``mb`` MiB: :meth:`add` a process (its later children follow), :meth:`oom_kills`,
    :meth:`remove` once every process in it has exited."""

    def __init__(self, folder: Path, version: int, mb: int) -> None:
        self.folder, self.version = folder, version
        folder.mkdir()
        try:
            limit = str(mb * 1024 * 1024)
            if version == 1:
                (folder / "memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(OSError):  # swap accounting off: there is no memsw file
                    (folder / "memory.memsw.limit_in_bytes").write_text(limit)
            else:
                (folder / "memory.max").write_text(limit)
                with contextlib.suppress(OSError):
                    (folder / "memory.swap.max").write_text("0")
        except BaseException:
            self.remove()
            raise

    def add(self, pid: int) -> None:
        (self.folder / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes the OOM killer ended in this cgroup."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.folder / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Delete the cgroup (a few tries: the kernel frees it a moment after its last process is reaped)."""
        for _ in range(50):
            try:
                self.folder.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


def make(mb: int) -> TreeLimit | None:
    """A fresh cgroup limited to ``mb`` MiB, or None where this host lets us make none (:func:`available`)."""
    own = available()
    if own is None:
        return None
    folder, version = own
    try:
        return TreeLimit(folder / f"posttrain-sandbox-{os.getpid()}-{next(_SEQ)}", version, mb)
    except OSError as e:
        log.warning("sandbox: no memory cgroup for this run (%s): its tree is bounded by rlimits only", e)
        return None


@functools.cache
def available() -> tuple[Path, int] | None:
    """The caller's memory cgroup and its version when a child with a limit can be made there and a process
    moved into it (tried once per process with a short ``sleep``), else None (logged once)."""
    try:
        own = _own()
    except (OSError, ValueError) as e:  # an unreadable cgroup file: none here
        own, why = None, str(e)
    else:
        why = "no memory controller in /proc/self/cgroup" if own is None else ""
    if own is not None:
        try:
            probe = TreeLimit(own[0] / f"posttrain-sandbox-{os.getpid()}-probe{next(_SEQ)}", own[1], 64)
            try:
                with subprocess.Popen(["sleep", "5"]) as p:
                    try:
                        probe.add(p.pid)
                    finally:
                        p.kill()
            finally:
                probe.remove()
        except OSError as e:
            why = str(e)
    if why:
        log.info("sandbox: no memory cgroup can be made here (%s): each process is bounded by RLIMIT_AS, the tree "
                 "by RLIMIT_AS x RLIMIT_NPROC (docs/sandbox.md)", why)
        return None
    return own
