"""Run one untrusted Python program in a bubblewrap sandbox (:mod:`posttrain.sandbox.bwrap`) and read back a
:class:`~posttrain.sandbox.result.Result`: never an exception for anything the program does.

The parent enforces what rlimits cannot: the wall clock (``wall_s``, start-up included) and the output cap
(``max_output_kb`` of stdout and of stderr, read through ``selectors``; a program that writes more is killed,
so a ``while True: print()`` costs no more than its cap). Killing a run kills bwrap's process group; the
launcher, PID 1 inside the sandbox, dies with it (``--die-with-parent``; also when the caller itself is
SIGKILLed) and the kernel then kills every process left in the sandbox's PID namespace, whatever
``setsid``/double fork it did; the call returns once PID 1 has exited (:func:`_await_namespace`): no process
outlives the call. A program that exits normally ends the namespace
the same way (the launcher exits with it).

Setup failures are told apart from the program's own exit codes by bwrap's JSON status pipe: no
``child-pid`` there means the sandbox was never set up (status ``refused``, nothing of the program ran).
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from posttrain.config.sandbox import SandboxCfg
from posttrain.sandbox import bwrap, cgroup, idle, outcome, seccomp
from posttrain.sandbox.result import Result

READ = 65536


class Sandbox:
    """Runs programs under ``cfg``'s limits. Construction checks that bubblewrap is installed and can create its
    namespaces (one trivial run, cached per executable, interpreter and seccomp setting) and raises
    :class:`~posttrain.sandbox.bwrap.SandboxUnavailable` otherwise. Thread-safe: :meth:`run` keeps no state."""

    def __init__(self, cfg: SandboxCfg | None = None) -> None:
        self.cfg = cfg or SandboxCfg()
        self.bwrap = bwrap.resolve_bwrap(self.cfg.bwrap)
        self.python = bwrap.resolve_python(self.cfg.python)
        if self.cfg.seccomp:
            try:
                seccomp.program()
            except seccomp.SeccompUnavailable as e:
                raise bwrap.SandboxUnavailable(f"sandbox: {e}: install libseccomp2, or set sandbox.seccomp: false "
                                               "(namespaces and rlimits only)") from None
        _probe(self)

    def run(self, source: str, *, stdin: str | bytes = b"", files: Mapping[str, str | bytes] | None = None,
            ) -> Result:
        """Run ``source`` as ``/scratch/main.py`` with ``stdin`` and extra ``files`` (name -> content, in
        ``/scratch``; e.g. a test module next to the completion)."""
        return _run(self.cfg, self.bwrap, self.python, source, stdin, files or {})


_PROBED: dict[tuple[str, str, bool], str] = {}  # (bwrap, python, seccomp) -> '' (works) or why not
_PROBE_LOCK = threading.Lock()


def _probe(sb: Sandbox) -> None:
    """One trivial program under the default limits: bubblewrap must set up every namespace and the interpreter
    must start inside. Cached per (bwrap, python, seccomp); a failure raises :class:`SandboxUnavailable`, one line."""
    key = (sb.bwrap, sb.python, sb.cfg.seccomp)
    with _PROBE_LOCK:
        if key not in _PROBED:
            r = _run(SandboxCfg(seccomp=sb.cfg.seccomp), sb.bwrap, sb.python, "print('ok')", b"", {})
            _PROBED[key] = "" if r.ok and r.stdout == "ok\n" else (r.detail or r.status)
    if _PROBED[key]:
        raise bwrap.SandboxUnavailable(f"sandbox: bubblewrap ({sb.bwrap}) cannot run {sb.python} in a sandbox here: "
                                       f"{_PROBED[key]}; refusing to run code unsandboxed")


def _run(cfg: SandboxCfg, bwrap_path: str, python: str, source: str, stdin: str | bytes,
         files: Mapping[str, str | bytes]) -> Result:
    """One program in one fresh sandbox (see :meth:`Sandbox.run`)."""
    contents = {"main.py": source, **files}
    bad = [n for n in contents if not n or "/" in n or n in {".", ".."}]
    if bad:
        raise ValueError(f"sandbox file names must be plain names, got {bad}")
    tree = cgroup.make(cgroup.limit_mb(cfg))
    ours: list[int] = []  # the parent's ends of the pipes
    theirs: list[int] = []  # what bwrap gets (pass_fds), closed here once it has them
    t0 = time.monotonic()
    try:
        fds = {name: _keep(theirs, _memfd(name, data)) for name, data in contents.items()}
        bpf = _keep(theirs, _memfd("seccomp", seccomp.program())) if cfg.seccomp else None
        status_r, status_w = _pipe(ours, theirs)
        report_r, report_w = _pipe(ours, theirs)
        block_r, block_w = _pipe(theirs, ours) if tree is not None else (None, None)  # bwrap reads, we write
        argv = bwrap.command(cfg, bwrap_path, python, fds, status_w, bpf, report_w, block_r)
        owner: dict = ({"user": bwrap.HOST_UID, "group": bwrap.HOST_UID, "extra_groups": []} if os.geteuid() == 0
                       else {})
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=theirs, env={}, start_new_session=True, **owner)
    except BaseException as e:
        for fd in ours:
            os.close(fd)
        if tree is not None:
            tree.remove()
        if isinstance(e, OSError):  # bwrap not executable (by the host user it runs as), no fd left: nothing ran
            return Result("refused", None, "", "", False, 0.0, f"cannot start {bwrap_path}: {e.strerror}")
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    early, placed, oom = b"", True, 0
    try:
        if tree is not None:  # the program starts only once its sandbox is in the cgroup
            try:
                early, placed = _place(status_r, block_w, tree, t0 + cfg.wall_s)
                if not placed:  # stopped before the block pipe closes: bwrap reads EOF as the go-ahead
                    _stop(proc, outcome.status_lines(early).get("child-pid"))
            finally:
                os.close(block_w)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        watch = idle.IdleWatch(proc.pid, cfg.idle_s, t0) if cfg.idle_s and idle.supported() else None
        out, err, why = _communicate(proc, data if placed else b"", t0 + cfg.wall_s, cfg.max_output_kb * 1024,
                                     watch)
        why, ended = why if placed else "unplaced", time.monotonic()  # (the teardown below is not the program's)
    finally:
        early += _read_ready(status_r)  # bwrap's child-pid line, written at set-up
        _kill(proc, outcome.status_lines(early).get("child-pid"))
        with os.fdopen(status_r, "rb") as f:
            status = outcome.status_lines(early + f.read())
        _await_namespace(status.get("child-pid"))
        with os.fdopen(report_r, "rb") as f:
            report = outcome.launcher_report(f.read())
        if tree is not None:
            oom = tree.oom_kills()
            tree.remove()
    return outcome.classify(cfg, proc.returncode, status, report, oom, out.buf.decode("utf-8", "replace"),
                            err.buf.decode("utf-8", "replace"), out.over or err.over, why, ended - t0)


def _keep(owner: list[int], fd: int) -> int:
    owner.append(fd)
    return fd


def _pipe(reader: list[int], writer: list[int]) -> tuple[int, int]:
    """A pipe whose read end goes to ``reader``'s list and write end to ``writer``'s (the parent's or bwrap's)."""
    r, w = os.pipe()
    return _keep(reader, r), _keep(writer, w)


def _place(status_r: int, block_w: int, tree: cgroup.TreeLimit, deadline: float) -> tuple[bytes, bool]:
    """Wait for bwrap's ``child-pid`` (the sandbox's PID 1, blocked on ``--block-fd`` before it runs anything),
    move it into ``tree`` and let it go. Returns what was read of the status pipe and whether it was placed
    (not: bwrap failed its set-up, the deadline passed, or the move was refused; the caller stops the sandbox
    before it closes ``block_w``, whose EOF bwrap would take as the go-ahead)."""
    got = b""
    poller = select.poll()  # (select.select refuses descriptors >= 1024)
    poller.register(status_r, select.POLLIN)
    try:
        while "child-pid" not in outcome.status_lines(got):  # a whole JSON line (a read may end mid-line)
            left = deadline - time.monotonic()
            chunk = os.read(status_r, READ) if left > 0 and poller.poll(1000 * left) else b""
            if not chunk:
                return got, False
            got += chunk
        tree.add(outcome.status_lines(got)["child-pid"])
        os.write(block_w, b"go")
        return got, True
    except OSError:
        return got, False


def _memfd(name: str, data: str | bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at 0 (bwrap ``--file`` copies it in)."""
    fd = os.memfd_create(f"sandbox-{name}")  # close-on-exec: pass_fds hands it to bwrap alone
    view = memoryview(data.encode() if isinstance(data, str) else data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Capped:
    def __init__(self, cap: int) -> None:
        self.buf, self.cap, self.over = bytearray(), cap, False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.buf)
        self.buf += chunk[:room]
        self.over = self.over or len(chunk) > room


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int,
                 watch: idle.IdleWatch | None = None) -> tuple[_Capped, _Capped, str]:
    """Feed stdin, read stdout and stderr up to ``cap`` each until both close, the deadline passes (``'wall'``),
    the cap is exceeded (``'output'``) or ``watch`` finds the tree idle (its detail line, ``'idle: ...'``); then
    wait for bwrap to exit (under the same deadline and watch). Returns (out, err, why-killed-or-'')."""
    assert proc.stdin and proc.stdout and proc.stderr
    out, err = _Capped(cap), _Capped(cap)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    view = memoryview(stdin)
    if view:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, None)
    else:
        proc.stdin.close()
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return out, err, "wall"
            if watch is not None and watch.idle(now):
                return out, err, watch.detail()
            for key, _ in sel.select(min(deadline - now, watch.tick) if watch else deadline - now):
                if key.data is None:  # stdin writable
                    try:
                        view = view[os.write(key.fd, view[:READ]):]
                    except BrokenPipeError:
                        view = view[:0]
                    if not view:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
                    continue
                chunk = os.read(key.fd, READ)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.add(chunk)
                if key.data.over:
                    return out, err, "output"
        while True:  # both pipes closed (a program may close them and go on)
            now = time.monotonic()
            if now >= deadline:
                return out, err, "wall"
            if watch is not None and watch.idle(now):
                return out, err, watch.detail()
            try:
                proc.wait(min(deadline - now, watch.tick) if watch else deadline - now)
                return out, err, ""
            except subprocess.TimeoutExpired:
                continue
    finally:
        sel.close()


def _read_ready(fd: int) -> bytes:
    """What ``fd`` (a pipe) holds now, without waiting."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, READ):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    os.set_blocking(fd, True)
    return b"".join(chunks)


def _kill(proc: subprocess.Popen, pid1: int | None) -> None:
    """:func:`_stop` the sandbox, reap bwrap, close its pipes."""
    _stop(proc, pid1)
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None and not f.closed:
            f.close()


def _stop(proc: subprocess.Popen, pid1: int | None) -> None:
    """SIGKILL the sandbox's PID 1 (host pid ``pid1``) first, while bwrap still lives to reap it (killed after
    bwrap, it would be orphaned to the host's init: a zombie until init reaps it, forever when the caller is a
    container's PID 1 that does not), then bwrap's process group."""
    if proc.poll() is None and pid1 is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid1, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)  # bwrap reaps its child and exits
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _await_namespace(pid: int | None, limit_s: float = 10.0) -> None:
    """Return once the sandbox's PID 1 (host pid ``pid``, bwrap's ``child-pid``) has exited: the kernel reaps
    every other process of its PID namespace before PID 1 can exit, so none is left when :meth:`Sandbox.run`
    returns (killing bwrap on a wall timeout only starts that: 42 processes were still there at the return).
    PID 1 orphaned by bwrap's kill is reparented to the host's init, or to the caller when the caller is PID 1
    of a container (or a subreaper): then the caller reaps it here, leaving no zombie."""
    if pid is None:
        return
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return  # gone (reaped)
        if state in {"Z", "X"}:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # ours only when orphaned to this process
            return
        time.sleep(0.002)
