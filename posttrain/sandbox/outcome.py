"""How a sandboxed run ended, decided by the parent (:mod:`posttrain.sandbox.executor`) from what the program
cannot write: bwrap's JSON status pipe (``child-pid`` once set up: else nothing ran), the parent's own limits
(wall clock, output cap), the memory cgroup's OOM kills, and the launcher's report of the program's raw wait
status and CPU seconds (:func:`posttrain.sandbox.bwrap.launcher`). The program's own text is read for one
label only (``memory`` from Python's ``MemoryError``) and for the audit line, control characters stripped."""

from __future__ import annotations

import json
import os
import signal

from posttrain.config.sandbox import SandboxCfg
from posttrain.sandbox import cgroup
from posttrain.sandbox.result import Result, Status
from posttrain.text import printable


def status_lines(raw: bytes) -> dict[str, int]:
    """bwrap's ``--json-status-fd`` records merged: ``child-pid`` once set up, ``exit-code`` at the end."""
    merged: dict[str, int] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            merged.update({k: v for k, v in rec.items() if isinstance(v, int)})
    return merged


def launcher_report(raw: bytes) -> tuple[int, float] | None:
    """The launcher's record: the program's raw wait status and CPU seconds; None when it wrote none (it was
    killed first: by the parent's wall clock or output cap, or from outside)."""
    try:
        ws, cpu = raw.decode().split()
        return int(ws), float(cpu)
    except ValueError:
        return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return printable(lines[-1])[:300] if lines else ""  # the program's own text: no escapes in an audit


def classify(cfg: SandboxCfg, returncode: int, status: dict[str, int], report: tuple[int, float] | None,
             oom: int, stdout: str, stderr: str, truncated: bool, why: str, wall: float) -> Result:
    """The status, decided here from what the program cannot write: bwrap's status pipe, the parent's own
    limits, and the launcher's wait status and CPU time (a signal is a signal, whatever exit code a program
    picks: ``sys.exit(152)`` is an error, and a SIGXCPU the program sends itself is ``killed``: a CPU-time
    ``timeout`` needs the CPU seconds to be there). Only ``memory`` reads the program's stderr (Python's
    ``MemoryError`` at RLIMIT_AS, which the kernel does not signal): an audit label, never a verdict."""
    def result(s: Status, code: int | None, detail: str) -> Result:
        return Result(s, code, stdout, stderr, truncated, round(wall, 4), detail)

    if "child-pid" not in status:
        return result("refused", None, _last_line(stderr) or f"bwrap exited {returncode} before the sandbox was set up")
    if why == "unplaced":
        return result("refused", None, "the sandbox could not be put in its memory cgroup: nothing ran")
    if oom:
        return result("memory", None, f"the process tree passed {cgroup.limit_mb(cfg)} MiB: the "
                                      f"kernel's OOM killer ended {oom} of its processes (memory cgroup)")
    if why == "wall":
        return result("timeout", None, "wall-clock limit: the process tree was killed")
    if why.startswith("idle"):  # the parent's idle watch (posttrain/sandbox/idle.py): its own audit line
        return result("timeout", None, why)
    if why == "output":
        return result("output_limit", None, "output past max_output_kb: the process tree was killed")
    if report is None:
        return result("killed", None, f"the sandbox ended before the program did (bwrap exited {returncode})")
    ws, cpu = report
    if os.WIFSIGNALED(ws):
        n = os.WTERMSIG(ws)
        name = signal.Signals(n).name if n in signal.valid_signals() else str(n)
        # the rlimit's signal, not kill(2)'s: the CPU was used. (wait4's rusage lags the clock RLIMIT_CPU reads:
        # 0.97-1.0 s at a 1 s limit here, below 0.9 s once on a loaded CI run; a self-sent SIGXCPU has ~0.03 s)
        if n in (signal.SIGXCPU, signal.SIGKILL) and cpu >= 0.5 * cfg.cpu_s:
            return result("timeout", 128 + n, f"CPU-time limit ({name})")
        return result("killed", 128 + n, f"ended by {name}")
    code = os.WEXITSTATUS(ws)
    if code == 0:
        return result("ok", 0, "")
    last = _last_line(stderr)
    if last.startswith("MemoryError"):
        return result("memory", code, last)
    return result("error", code, last or f"exit code {code}")
