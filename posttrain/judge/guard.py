"""The judge server's guard: it dies with the stage that started it, SIGKILL included.

``python -m posttrain.judge.guard PARENT_PID CMD...`` runs ``CMD`` (the server) in the guard's own process group
and waits for it. Every half second it checks that its parent is still ``PARENT_PID``: when the stage is gone
(killed by any signal, SIGKILL included, where no ``finally`` of the stage runs), the guard SIGTERMs its group (the
server, its engine core and workers), waits ``GRACE_S`` and SIGKILLs what is left, itself last. A server that exits
on its own ends the guard with its exit code. Hand-written: ``PR_SET_PDEATHSIG`` reaches one process, not the
server's children, and no library supervises a process tree against its parent's death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

GRACE_S = 10.0
POLL_S = 0.5


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def _stop_group() -> None:
    """SIGTERM the guard's group but the guard, wait, then SIGKILL every survivor (descendants that left the group
    included) and the guard."""
    me = psutil.Process()
    tree = me.children(recursive=True)
    group = os.getpgid(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the server, not for the guard
    os.killpg(group, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    os.killpg(group, signal.SIGKILL)  # anything left in the group, the guard with it


def main(argv: list[str]) -> int:
    parent, cmd = int(argv[0]), argv[1:]
    if _orphaned(parent):  # the stage died before the guard started
        return 1
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)  # stdout/stderr: the guard's (the server's log)
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if _orphaned(parent):
            _stop_group()
            time.sleep(GRACE_S)  # (not reached: the group's SIGKILL ends the guard)
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
