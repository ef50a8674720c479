"""``sandbox:``: the limits under which model-written code runs (:mod:`posttrain.sandbox`) and how many programs
run at once: the code task's verifier and ``code_tests`` reward (``posttrain.tasks.codeexec``).

The stage runner exports the section to the environment (``ENV``), so that every process of a stage, reward
workers included, runs code under the same limits (:func:`from_env`)."""

from __future__ import annotations

import os

from pydantic import Field

from posttrain.config.base import NOT_RESULT, Section


class SandboxCfg(Section):
    """Limits of one sandboxed program (bubblewrap: no network, a scratch tmpfs, its own PID namespace) and the
    pool's width. A program that hits a limit gets a status (``timeout``, ``memory``, ``output_limit``, ...),
    never a crash of the caller."""

    cpu_s: float = Field(10.0, gt=0, le=3600, description="CPU seconds of each process of the program "
                         "(RLIMIT_CPU, rounded up to whole seconds): past it the process is killed (status timeout)")
    wall_s: float = Field(20.0, gt=0, le=3600, description="wall-clock seconds of the whole run, start-up "
                          "included: past it the whole process tree is killed (status timeout)")
    idle_s: float | None = Field(5.0, gt=0, le=3600, description="seconds the whole process tree may go "
                                 "without using the CPU (under 2% of one core over the window: asleep, blocked, "
                                 "deadlocked) before it is killed (status timeout, detail 'idle'): a hung program "
                                 "frees its worker instead of holding it until wall_s; null: wall_s alone")
    memory_mb: int = Field(256, ge=32, le=1_048_576, description="address space of each process in MiB "
                           "(RLIMIT_AS): an allocation past it fails (MemoryError: status memory)")
    max_procs: int = Field(16, ge=1, le=4096, description="processes and threads the program may have at once "
                           "(RLIMIT_NPROC in its own user namespace): a fork past it fails")
    max_file_mb: int = Field(16, ge=1, le=65_536, description="MiB the program may write, per file "
                             "(RLIMIT_FSIZE) and in all (the size of its scratch tmpfs)")
    max_output_kb: int = Field(64, ge=1, le=1_048_576, description="KiB of stdout and of stderr kept; a program "
                               "that writes more is killed (status output_limit, truncated)")
    max_open_files: int = Field(64, ge=16, le=65_536, description="open file descriptors per process "
                                "(RLIMIT_NOFILE)")
    workers: int = Field(2, ge=1, le=1024, description="programs run at once by the pool (one sandbox each)",
                         json_schema_extra=NOT_RESULT)
    seccomp: bool = Field(True, description="also load the seccomp filter (posttrain/sandbox/seccomp.py: "
                          "namespaces, mounts, ptrace, keyrings, eBPF, io_uring, ... refused with EPERM); true where "
                          "libseccomp cannot be loaded refuses to run code; false: namespaces and rlimits only")
    python: str | None = Field(None, min_length=1, description="the interpreter inside the sandbox (its "
                               "installation is bound read-only; it must be readable by an unprivileged user); "
                               "null: /usr/bin/python3, else the base interpreter of the running Python")
    bwrap: str = Field("bwrap", min_length=1, description="the bubblewrap executable (a name on PATH or a "
                       "path); where it is missing or cannot create namespaces, code is refused, never run "
                       "unsandboxed")


ENV = "POSTTRAIN_SANDBOX"  # the stage's sandbox section as JSON (set by posttrain.runner.setup)


def from_env() -> SandboxCfg:
    """The sandbox settings of the running stage (``ENV``), or the defaults outside a stage."""
    raw = os.environ.get(ENV)
    return SandboxCfg.model_validate_json(raw) if raw else SandboxCfg()
