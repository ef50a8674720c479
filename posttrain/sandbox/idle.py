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


def _stat_cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of ``pid`` in clock ticks (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return sum(int(x) for x in fields[11:15])  # fields 14-17 of proc(5), counted after the command's ")"


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


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and every process below it (a process that exits between two reads
    is missed until its parent reaps it: :class:`IdleWatch` keeps the running maximum)."""
    ticks, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        ticks += _stat_cpu_ticks(pid)
        todo += _children(pid)
    return ticks / CLOCK_TICKS


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
        self.next = t0 + self.tick

    def idle(self, now: float) -> bool:
        """Sample the tree's CPU time (when a tick has passed) and say whether the last window was idle."""
        if now < self.next:
            return False
        self.next = now + self.tick
        cpu = max(self.samples[-1][1], tree_cpu_s(self.root))
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
