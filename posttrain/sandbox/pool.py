"""``SandboxPool``: many programs at once, one fresh sandbox each, ``workers`` at a time.

Why threads (``concurrent.futures.ThreadPoolExecutor``) and not pebble's process pool (what
:mod:`posttrain.rewards.pool` uses for in-process scoring): here the untrusted work already runs in its own
process, the sandbox, which the executor times and kills itself (wall clock, output cap, PID-namespace
teardown). The parent's share of a run is a ``Popen`` (``fork``/``exec`` in C, no ``preexec_fn``: safe from
threads) and a ``select`` loop that waits with the GIL released; a worker process per program would add a
process start and a pickling round-trip for nothing, and pebble's kill-on-timeout is already done better by the
sandbox (it also kills what the program forked).

A reward scores a batch: ``pool.map([Program(completion + tests), ...])``. A tool call runs one snippet and
reads its output: ``pool.submit(Program(code)).result()`` (or :meth:`Sandbox.run` directly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from posttrain.config.sandbox import SandboxCfg
from posttrain.sandbox.executor import Sandbox
from posttrain.sandbox.result import Result


@dataclasses.dataclass(frozen=True)
class Program:
    """One program: its source (``/scratch/main.py``), stdin, and extra files in ``/scratch``."""

    source: str
    stdin: str | bytes = b""
    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)


class SandboxPool:
    """``with SandboxPool(cfg) as pool: results = pool.map(programs)``. Construction refuses (raises
    :class:`~posttrain.sandbox.bwrap.SandboxUnavailable`) where bubblewrap cannot sandbox; ``map`` never raises
    for what a program does (each gets a :class:`Result`)."""

    def __init__(self, cfg: SandboxCfg | None = None, workers: int | None = None) -> None:
        self.sandbox = Sandbox(cfg)
        self.workers = workers or self.sandbox.cfg.workers
        self._ex = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")

    def submit(self, program: Program | str) -> Future[Result]:
        """Run one program (a :class:`Program` or bare source) in the background."""
        p = program if isinstance(program, Program) else Program(program)
        return self._ex.submit(self.sandbox.run, p.source, stdin=p.stdin, files=p.files)

    def map(self, programs: Iterable[Program | str]) -> list[Result]:
        """Run every program, ``workers`` at a time; results in the programs' order."""
        return [f.result() for f in [self.submit(p) for p in programs]]

    def close(self) -> None:
        """Wait for the running programs (each ends by its wall-clock limit at the latest) and stop the threads."""
        self._ex.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
