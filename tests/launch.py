"""Multi-process launches whose hang says where it hangs (a helper for the torchrun tests, not a test).

``run(cmd, env=..., timeout=...)`` is ``subprocess.run(..., capture_output=True, text=True)`` in a session of its
own; ``communicate(proc, timeout)`` waits for a ``Popen`` started with ``start_new_session=True``. On a timeout
every process of the session (torchrun's agent and its ranks) is asked for its Python stacks (SIGUSR2: ranks
register it in ``distributed.init``; ``TORCHRUN`` registers it in the agent), the whole session is killed (no
orphaned rank keeps the machine busy), and the test fails with the stacks instead of a bare ``TimeoutExpired``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# ``python -m torch.distributed.run`` with the agent's stacks on SIGUSR2 (argv as torchrun's own)
TORCHRUN = [sys.executable, "-c", "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR2, "
            "all_threads=True); sys.argv[0] = 'torchrun'; from torch.distributed.run import main; main()"]


def session(sid: int) -> list[int]:
    """The pids of the processes in session ``sid`` (from /proc: field 6 of stat)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == sid:
            pids.append(int(stat.parent.name))
    return pids


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)``; on a timeout: the stacks of its session, the session killed, the test failed."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    for pid in session(proc.pid):
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    time.sleep(3)  # the dumps are written by each process's own signal handler
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    pytest.fail(f"{proc.args} did not end in {timeout}s; its processes' stacks (SIGUSR2) and output:\n"
                f"{(out or '')[-3000:]}\n{(err or '')[-20000:]}", pytrace=False)


def run(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)`` whose timeout shows the stacks."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = communicate(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
