"""The judge for the length of a stage: serve a local folder (``judge.serve``) or not, point scoring processes at
it and at the cache, and merge the cache at the end.

``with session(cache, serve=..., python=...) as s: <score rows> ; s.stats``. Scoring processes learn where the
judge is from the environment (``POSTTRAIN_JUDGE_BASE_URL``, ``_MODEL``, ``_DIGEST``, ``_CACHE``), set here
before the stage starts its reward pool: the pool hands its workers the environment it started with, and a
reward function gets only its params' kwargs. On exit (also on an error: judgements paid are kept) the
cache's pending entries are merged into its file and the run's counters land in ``s.stats``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.judge import cache as jcache
from posttrain.judge.server import identity, serve

ENV_BASE_URL = "POSTTRAIN_JUDGE_BASE_URL"  # the server the stage started (llm_judge's base_url when unset)
ENV_MODEL = "POSTTRAIN_JUDGE_MODEL"  # its served model name
ENV_DIGEST = "POSTTRAIN_JUDGE_DIGEST"  # the served folder's digest (the cache key's judge)


@dataclass
class Session:
    """What a stage gets: the server (None when pointed elsewhere), its start time, and the counters at exit."""

    base_url: str | None = None
    startup_s: float | None = None
    pid: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def session(cache: Path | None, *, serve_folder: str | None = None, python: str = ".venv-vllm/bin/python",
            model: str = "judge", args: Sequence[str] = (), startup_timeout_s: float = 600.0,
            log: Path | None = None) -> Iterator[Session]:
    """Start the judge server if ``serve_folder``; expose it and ``cache`` to scoring processes; merge the cache
    (when given) on exit."""
    s = Session()
    with ExitStack() as stack:
        env: dict[str, str] = {}
        if cache is not None:
            jcache.reset_stats(cache)
            env[jcache.ENV_CACHE] = str(Path(cache).absolute())
        if serve_folder is not None:
            digest = identity(serve_folder, args)
            served = stack.enter_context(serve(serve_folder, python=python, model=model, args=args,
                                               startup_timeout_s=startup_timeout_s, log=log))
            s.base_url, s.startup_s, s.pid = served.base_url, served.startup_s, served.pid
            env |= {ENV_BASE_URL: served.base_url, ENV_MODEL: model, ENV_DIGEST: digest}
        stack.enter_context(_env(env))
        try:
            yield s
        finally:
            if cache is not None:
                s.stats = jcache.merge(Path(cache))


def for_stage(judge: Any, cache: Path) -> Any:
    """The session a scoring stage opens: ``judge`` is ``params.judge``; the server's log goes beside the cache
    (``judge-server.log``)."""
    return session(cache, serve_folder=judge.serve, python=judge.python, model=judge.served_model_name,
                   args=judge.args, startup_timeout_s=judge.startup_timeout_s,
                   log=Path(cache).parent / "judge-server.log")


def metrics(s: Session) -> dict[str, Any]:
    """The judge's numbers for a stage's metrics (``judge_`` prefixed): requests, hit and malformed rates, new
    cache entries, the server's start time."""
    keys = ("requests", "hits", "malformed", "failed", "overlong", "hit_rate", "malformed_rate", "new", "entries")
    return {**{f"judge_{k}": s.stats.get(k) for k in keys}, "judge_server_startup_s": s.startup_s}
