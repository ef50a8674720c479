"""The idle watch: a sandboxed process tree that has used (almost) no CPU for ``idle_s`` seconds is hung (asleep,
blocked on a lock, waiting on a child that waits too) and is killed, so that it frees its pool worker instead of
holding it until ``wall_s`` (two such programs used to stall a 2-worker pool for the whole wall clock).

What counts is the whole tree's CPU time, read by the parent from ``/proc`` (``utime + stime`` of every process
below bwrap, plus ``cutime + cstime``: the children they already reaped), never from anything the program
writes. The tree is walked through ``/proc/<pid>/task/<tid>/children``, readable for every process of the
sandbox (the non-dumpable launcher included); on a kernel without ``CONFIG_PROC_CHILDREN`` the watch is off
(logged once) and ``wall_s`` alone bounds a hung program.

Why by hand: ``psutil`` would walk the same files through a full ``/proc`` scan for the parent links; cgroup
v2's ``cpu.stat`` would be exact but is not there on cgroup v1 hosts or where no cgroup can be made.
"""

from __future__ import annotations

import collections
import functools
import logging
import os

CPU_FRACTION = 0.02  # under 2% of one core over the window is idle: a busy program starved on a loaded host
# (20 of them on 2 cores get 10% each) is not
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
log = logging.getLogger("sandbox")


def _stat(pid: int) -> tuple[tuple[int, int], int] | None:
    """((pid, start time), utime + stime + cutime + cstime in clock ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (pid, int(fields[19])), sum(int(x) for x in fields[11:15])  # proc(5) fields 22 and 14-17
    except (OSError, IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            continue
    return kids


def tree_ticks(root: int) -> dict[tuple[int, int], int]:
    """CPU clock ticks used so far by ``root`` and each process below it, keyed by (pid, start time): a pid the
    kernel reuses is another process."""
    ticks: dict[tuple[int, int], int] = {}
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if (got := _stat(pid)) is not None:
            ticks[got[0]] = got[1]
        todo += _children(pid)
    return ticks


@functools.cache
def supported() -> bool:
    """Whether this kernel lists a task's children in ``/proc`` (logged once when not)."""
    ok = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    if not ok:
        log.warning("sandbox: this kernel has no /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN): the idle "
                    "watch is off, a hung program is bounded by wall_s alone")
    return ok


class IdleWatch:
    """``idle(now)``: True once the tree under ``root`` has used less than ``CPU_FRACTION`` of one core over the
    last ``idle_s`` seconds (the first window starts at ``t0``, the run's start, start-up included). Reads
    ``/proc`` at most every ``tick`` seconds (a tenth of the window, at most 0.25 s)."""

    def __init__(self, root: int, idle_s: float, t0: float) -> None:
        self.root, self.idle_s = root, idle_s
        self.tick = min(0.25, idle_s / 10)
        self.samples: collections.deque[tuple[float, float]] = collections.deque([(t0, 0.0)])
        self.due = t0 + self.tick
        self.most: dict[tuple[int, int], int] = {}  # each process's largest reading: one that exits between two
        # reads (its time not yet in its parent's cutime) or is read mid-update never makes the total fall

    def idle(self, now: float) -> bool:
        """Sample the tree's CPU time (when a tick has passed) and say whether the last window was idle."""
        if now < self.due:
            return False
        self.due = now + self.tick
        for key, ticks in tree_ticks(self.root).items():
            self.most[key] = max(self.most.get(key, 0), ticks)
        cpu = sum(self.most.values()) / CLOCK_TICKS  # a reaped child may count twice (itself, its parent's
        # cutime): a one-off step up that delays an idle verdict by at most one window, never hides later use
        self.samples.append((now, cpu))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.idle_s:
            self.samples.popleft()  # keep the newest sample at least idle_s old: the window's start
        t, c = self.samples[0]
        return now - t >= self.idle_s and cpu - c < CPU_FRACTION * (now - t)

    def detail(self) -> str:
        """The audit line of an idle kill."""
        (t, c), (now, cpu) = self.samples[0], self.samples[-1]
        return (f"idle: the process tree used {cpu - c:.2f} CPU-s in {now - t:.1f} s (idle_s {self.idle_s:g}): "
                "it was killed")
