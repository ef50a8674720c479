"""``RewardPool``: score samples in worker processes, each sample under a timeout; or in-process, serially.

Why pebble (``pebble.ProcessPool``) and not the standard library: ``concurrent.futures.ProcessPoolExecutor``
and ``multiprocessing.Pool`` (even with ``maxtasksperchild``) can stop *waiting* for a task but cannot stop
the task: a worker stuck in sympy, or in C code that never returns to the interpreter, keeps its process and
its slot forever, and a pool whose worker dies is broken as a whole (``BrokenProcessPool``). pebble's pool
times each task from the moment a worker starts it, kills that worker (SIGTERM, then SIGKILL when it does not
exit: a C loop ignores Python-level handlers) and starts a new one; a worker that dies mid-task fails that
task alone (``ProcessExpired``). Both become an unscorable sample with its reason, never a crash or a hang.

Workers are forked from a ``forkserver`` that has imported ``posttrain.rewards`` (math-verify) and the stage's
module once, and holds no model, thread or engine: starting or replacing a worker costs milliseconds, workers
never inherit the stage's torch threads, model or vLLM engine (forking the stage itself would), and math-verify
runs in each worker's main thread, where its own ``signal.alarm`` timeouts work. Workers ignore SIGINT and die
with the stage, also when it is SIGKILLed (``_init_worker``); the pool stops when its ``with`` block ends, also
on SIGTERM of the stage (turned into ``SystemExit`` while the pool is open, when nothing else handles SIGTERM).

Learned rewards (``scoring.is_learned``: a reward model, the LLM judge) are scored in the calling process, once
per batch, never in the workers: one copy of a reward model per rank, on the rank's own device
(``learned.rank_device``), instead of one per worker (``reward.workers`` copies of its weights per rank); a model's
forward needs no per-sample timeout. The workers warm and score the verifiers alone.

``workers`` 0 or 1 scores in the calling thread with one ``combine`` of the whole batch: the same function the
workers run on their chunks, so results are identical for per-sample rewards (tests/test_reward_pool.py checks
it; a model reward's scores may differ in the last bits with what shares its forward: padding).

Batches and timeouts: a worker gets a chunk of up to ``MAX_CHUNK`` consecutive samples (a prompt's group, or
part of one) and calls each reward once on the chunk (``fn(samples)``: a batch reward scores the chunk in one
go). The chunk has ``timeout_s`` per sample it holds; a chunk that runs past that, or loses its worker, is redone
one sample at a time, each with ``timeout_s``: a sample is unscorable only when it alone runs out of time.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing import forkserver
from types import FrameType, TracebackType
from typing import Any

from pebble import ProcessExpired, ProcessPool

from posttrain.rewards.builtin import Sample
from posttrain.rewards.scoring import Spec, combine, failed, is_learned, merge, specs_of, warm

EXIT_SIGTERM = 128 + signal.SIGTERM
MAX_CHUNK = 16  # samples sent to a worker at once (fewer when there are few: every worker gets work)


def _init_worker(sys_path: list[str], environ: dict[str, str], specs: tuple[Spec, ...] = ()) -> None:
    """In each worker: the stage's import path (plug-ins) and environment as the pool started (the forkserver
    holds those of its own start), no Ctrl-C tracebacks, death with the stage; then ``warm(specs)``: a learned
    reward's model is loaded here, before the worker takes a task, so no sample's timeout pays for it (pebble
    times a task from the worker's acknowledgement of it, after the initializer).

    Death with the stage, even by SIGKILL and even for a worker stuck in C code: the worker dies with its
    parent, the forkserver (``PR_SET_PDEATHSIG``), and the forkserver exits when no client holds its "alive"
    pipe. multiprocessing hands every process it starts that pipe's write end (so that children may start
    processes too); a scoring worker never does, so it closes it: otherwise a hung worker would keep the
    forkserver alive and the forkserver the worker, forever, after the stage was killed."""
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:  # (a private attribute of multiprocessing.forkserver, read defensively)
        os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
    if sys.platform == "linux":  # SIGKILL when the process that forked us (the forkserver) dies
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # it died before the line above
            os._exit(1)
    warm(specs)


def _score_chunk(samples: Sequence[Sample], specs: tuple[Spec, ...]) -> list[tuple[float | None, dict[str, Any]]]:
    return combine(samples, specs)


def _preload() -> list[str]:
    """What the forkserver imports once, before it forks any worker: the rewards and the stage's own module
    (``python -m stages.rl``: each worker re-runs its ``__main__`` as ``__mp_main__``, as every non-fork start
    method does; with its imports already loaded, that costs nothing)."""
    main = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None)
    stage = [main] if main and not main.endswith("__main__") else []
    return ["posttrain.rewards.forkserver", "posttrain.rewards", *stage]


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_SIGTERM)


class RewardPool:
    """``with RewardPool(workers, timeout_s) as pool: pool.score(samples, specs)``.

    ``workers`` >= 2 starts that many scoring processes; 0 or 1 scores in this process (no processes, no
    timeout). ``timeout_s``: seconds one sample may take in a worker before it is unscorable. ``warm``: the
    reward specs each worker prepares as it starts (``scoring.warm``). ``RewardPool.of(params.reward)``: the
    stage's pool."""

    def __init__(self, workers: int = 0, timeout_s: float = 30.0, warm: Sequence[Any] = ()) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self.warm = tuple(s for s in specs_of(warm) if not is_learned(s.name))  # learned: scored here, not there
        self._pool: ProcessPool | None = None
        self._old_sigterm: Any = None

    @classmethod
    def of(cls, reward: Any) -> RewardPool:
        """The pool of a stage's ``params.reward`` (its timeout and specs). ``reward.workers`` are the machine's:
        under torchrun each of its ``LOCAL_WORLD_SIZE`` ranks (torchrun's variable) starts its share,
        ``workers // ranks`` but at least 2 when ``workers`` >= 2, so a pool's per-sample timeout and isolation
        are never traded away: 8 ranks with workers 16 run 16 scoring processes (not 128), with workers 8 run 16."""
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        workers = reward.workers if reward.workers < 2 else max(2, reward.workers // ranks)
        return cls(workers, reward.timeout_s, reward.rewards)

    def __enter__(self) -> RewardPool:
        if self.workers >= 2:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_preload())
            self._pool = ProcessPool(max_workers=self.workers, initializer=_init_worker,
                                     initargs=(list(sys.path), dict(os.environ), self.warm), context=ctx)
            main = threading.current_thread() is threading.main_thread()
            if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (a task still running is killed) and restore the SIGTERM handler."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.stop()
            pool.join()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def score(self, samples: Sequence[Sample], specs: Sequence[Any]) -> list[tuple[float | None, dict[str, Any]]]:
        """``combine(samples, specs)``: each sample's (total, parts), in order; a sample that times out or whose
        worker dies scores ``(None, {name: None, ..., "error": why})``."""
        plain = specs_of(specs)
        if self._pool is None:
            return combine(samples, plain)
        learned = tuple(s for s in plain if is_learned(s.name))
        if learned:  # in this process, one forward per batch; the verifiers in the workers
            checked = self.score(samples, [s for s in plain if s not in learned]) if len(learned) < len(plain) \
                else [(0.0, {})] * len(samples)
            names = [s.name for s in plain]
            return [merge(a, b, names) for a, b in zip(checked, combine(samples, learned), strict=True)]
        # Chunks amortise the per-task cost (a few ms of pipes and threads). A chunk of n samples gets n samples'
        # time: one that runs past it, or loses its worker, is redone a sample at a time, so a sample is
        # unscorable only when it alone runs out of time (or kills its worker).
        k = max(1, min(MAX_CHUNK, len(samples) // (4 * self.workers)))
        chunks = [samples[i : i + k] for i in range(0, len(samples), k)]
        out: list[tuple[float | None, dict[str, Any]]] = []
        for chunk, got in zip(chunks, self._run(_score_chunk, [(c, plain) for c in chunks], k), strict=True):
            if isinstance(got, str) and len(chunk) > 1:  # redo it one sample at a time
                got = [r[0] if isinstance(r, list) else failed(plain, r)
                       for r in self._run(_score_chunk, [([x], plain) for x in chunk], 1)]
            out += got if isinstance(got, list) else [failed(plain, got)]
        return out

    def _run(self, fn: Any, args: list[tuple[Any, ...]], per_task: int) -> list[Any]:
        """``fn(*a)`` for each ``a`` in the pool, each with ``per_task`` samples' time: its result, or why it has
        none (a string)."""
        assert self._pool is not None
        limit = self.timeout_s * per_task
        futures = [self._pool.schedule(fn, args=a, timeout=limit) for a in args]
        out: list[Any] = []
        for f in futures:
            try:
                out.append(f.result())
            except FutureTimeout:
                out.append(f"timeout after {limit:g}s")
            except ProcessExpired as e:
                out.append(f"worker died (exit code {e.exitcode})")
        return out
