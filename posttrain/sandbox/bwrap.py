"""The bubblewrap command line of one sandboxed run, and the check that bubblewrap works here.

Why bubblewrap (``bwrap``) and not firejail or nsjail: bwrap is a small, audited, widely deployed (Flatpak's
sandbox) Debian package that does exactly what we need and nothing more: it starts from an *empty* mount
namespace and binds in only what it is told, unshares every namespace (user, PID, network, IPC, UTS, cgroup),
drops all capabilities, and kills the sandbox with its parent. firejail starts from the host's filesystem and
blacklists paths (a forgotten path leaks) and is a setuid-root binary with a long CVE history and a large
profile language; nsjail is not packaged in Debian (a source build with protobuf) and its extra features
(cgroups, seccomp policy language) are not needed for running one Python file. bwrap has no resource limits:
those are rlimits, set inside the sandbox by the launcher that is its PID 1 (:func:`launcher`), and the
wall clock and output cap are the parent's (:mod:`posttrain.sandbox.executor`). Its ``--seccomp`` loads the
filter of :mod:`posttrain.sandbox.seccomp`.

What the program sees: ``/usr`` (and the ``/lib``, ``/lib64``, ``/bin``, ``/sbin`` that point into it)
read-only, the interpreter's own installation read-only when it lives outside ``/usr``, a fresh ``/proc`` of
its own PID namespace, a minimal ``/dev``, and ``/scratch``: a fresh tmpfs of ``max_file_mb`` + 1 MiB (one
file hits RLIMIT_FSIZE before the tmpfs is full), its working directory, holding its files. ``/`` and ``/dev``
are remounted read-only (both are tmpfs of bwrap's: writable and unbounded otherwise). Not the repository,
not ``/work``, not the venv's site-packages (the standard library only: what unit tests of model-written code
need), not ``/etc``, ``/home``, ``/root``, ``/tmp`` or ``/sys``. Network: a new, empty network namespace
(loopback only, nothing listening). Environment: a fixed minimal one (``ENV``), nothing inherited.

Users: run as root, the parent starts bwrap as ``nobody`` (``HOST_UID``): RLIMIT_NPROC is not enforced for
host uid 0, whatever the uid inside a user namespace maps to, and a root-owned file stays unwritable even
through a mount the program could remount. Inside, the program is uid/gid 1000 of its own user namespace, with
no capabilities, which ``--disable-userns`` keeps it from nesting (so ``unshare``/``mount`` through ctypes
fail, as the seccomp filter also ensures). bwrap 0.8 or newer (``--disable-userns``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from posttrain.config.sandbox import SandboxCfg
from posttrain.errors import StageError

HOST_UID = 65534  # nobody: the host user bwrap runs as when the caller is root
INNER_UID = 1000  # the program's uid and gid inside its user namespace
SCRATCH = "/scratch"
# MALLOC_ARENA_MAX: glibc reserves 64 MiB of address space per thread arena, which would make RLIMIT_AS a
# limit on threads rather than on memory
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "LANG": "C.UTF-8", "TMPDIR": SCRATCH,
       "MALLOC_ARENA_MAX": "2"}
# the launcher (PID 1 of the sandbox) counts against RLIMIT_NPROC too
NPROC_OVERHEAD = 1


class SandboxUnavailable(StageError):
    """Bubblewrap is missing or cannot create its namespaces here: code is refused, never run unsandboxed.
    ``str()`` is one line saying what to do."""


def resolve_bwrap(name: str) -> str:
    """The bwrap executable's path, or :class:`SandboxUnavailable`."""
    found = shutil.which(name)
    if found is None:
        raise SandboxUnavailable(f"sandbox: bubblewrap {name!r} not found (apt-get install -y bubblewrap); "
                                 "refusing to run code unsandboxed")
    return found


def resolve_python(python: str | None) -> str:
    """The interpreter inside the sandbox: ``python``, else ``/usr/bin/python3``, else the running Python's base
    interpreter (the venv's own ``python`` would bring its site-packages path)."""
    if python is not None:
        return shutil.which(python) or python  # a bare name: the host's PATH, as the sandbox's /usr has it
    if Path("/usr/bin/python3").exists():
        return "/usr/bin/python3"
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}")


@functools.lru_cache(maxsize=8)
def _ro_binds(python: str) -> tuple[str, ...]:
    """``/usr`` and its companions as the host has them (merged-/usr symlinks or directories), plus the
    interpreter's installation prefix when it is not under ``/usr``."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/lib", "/lib64", "/bin", "/sbin"):
        p = Path(top)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), top]
        elif p.is_dir():
            args += ["--ro-bind", top, top]
    real = Path(os.path.realpath(python))
    prefix = real.parent.parent  # <prefix>/bin/python3.x
    if not real.is_relative_to("/usr") and str(prefix) != "/":
        args += ["--ro-bind", str(prefix), str(prefix)]
    return tuple(args)


@functools.lru_cache(maxsize=8)
def site_dirs(python: str) -> tuple[str, ...]:
    """The interpreter's site-packages folders that exist (``site.getsitepackages()``: the system's
    dist-packages, numpy and the like where installed): the sandbox mounts an empty read-only tmpfs over each,
    so a program imports the standard library only while ``site`` still runs (``exit()``, ``quit()``)."""
    out = subprocess.run([python, "-I", "-c", "import site; print(chr(10).join(site.getsitepackages()))"],
                         capture_output=True, text=True, timeout=30, check=False)
    return tuple(d for d in out.stdout.splitlines() if d and Path(d).is_dir())


def launcher(cfg: SandboxCfg, main: str, report_fd: int) -> str:
    """PID 1 of the sandbox (``--as-pid-1``; bwrap's own init would be ptrace-able by the program, same uid):
    makes itself non-dumpable (no ptrace, no ``/proc/1/mem`` or ``/proc/1/fd`` from the program), sets the
    rlimits (lowering is always allowed; children inherit them), forks the program (``python -I main.py``: no
    PYTHON* variables, no user site, no cwd on the path), reaps every orphan until the program exits, writes
    the program's raw wait status and CPU seconds to ``report_fd`` (close-on-exec: the program never holds it,
    so how it ended, by a signal or an exit code, is not the program's to say) and exits with its status
    (128 + n for signal n). When PID 1 exits the kernel kills what is left in the PID namespace. RLIMIT_CPU's
    hard limit is a second past the soft one: SIGXCPU first, SIGKILL if the program catches it."""
    mb = 1024 * 1024
    cpu = max(1, int(-(-cfg.cpu_s // 1)))
    nproc = cfg.max_procs + NPROC_OVERHEAD
    limits = [("CPU", cpu, cpu + 1), ("AS", cfg.memory_mb * mb, cfg.memory_mb * mb), ("NPROC", nproc, nproc),
              ("FSIZE", cfg.max_file_mb * mb, cfg.max_file_mb * mb),
              ("NOFILE", cfg.max_open_files, cfg.max_open_files), ("CORE", 0, 0)]
    sets = "\n".join(f"r.setrlimit(r.RLIMIT_{k},({s},{h}))" for k, s, h in limits)
    return f"""import ctypes,os,signal,sys,resource as r
signal.signal(signal.SIGINT,signal.SIG_DFL)
if ctypes.CDLL(None).prctl(4,0,0,0,0):os._exit(126)
os.set_inheritable({report_fd},False)
{sets}
c=os.fork()
if c==0:os.execv(sys.executable,[sys.executable,'-E','-s','-B',{main!r}])
while True:
 p,s,u=os.wait4(-1,0)
 if p==c:break
os.write({report_fd},b'%d %.3f'%(s,u.ru_utime+u.ru_stime))
e=os.waitstatus_to_exitcode(s)
os._exit(e if e>=0 else 128-e)
"""


def command(cfg: SandboxCfg, bwrap: str, python: str, files: dict[str, int], status_fd: int,
            seccomp_fd: int | None, report_fd: int, block_fd: int | None = None) -> list[str]:
    """The bwrap argv: namespaces, binds, the scratch tmpfs filled from ``files`` (name -> readable fd), the
    environment, the seccomp filter (a readable fd of BPF, or None), then the launcher. ``status_fd``: bwrap's
    JSON status (child pid once set up, exit code); ``report_fd``: the launcher's (:func:`launcher`);
    ``block_fd``: set up, the sandbox waits for a byte there before it runs anything (``executor._place``
    moves it into its memory cgroup first)."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1",
            "--cap-drop", "ALL", "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", "sandbox",
            "--json-status-fd", str(status_fd), *_ro_binds(python), "--proc", "/proc", "--dev", "/dev",
            "--size", str((cfg.max_file_mb + 1) * 1024 * 1024), "--perms", "0700", "--tmpfs", SCRATCH]
    for name, fd in files.items():
        args += ["--file", str(fd), f"{SCRATCH}/{name}"]
    for d in site_dirs(python):  # emptied: the standard library only
        args += ["--perms", "0555", "--tmpfs", d, "--remount-ro", d]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    for k, v in ENV.items():
        args += ["--setenv", k, v]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    if block_fd is not None:
        args += ["--block-fd", str(block_fd)]
    return [*args, python, "-I", "-S", "-c", launcher(cfg, "main.py", report_fd)]
