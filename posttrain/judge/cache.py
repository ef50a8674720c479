"""The judge-call cache: a judgement paid for once is never asked again.

Key: sha256 of (the judge model's digest, the request). The request is the rendered prompt (template, rubric,
verdict format, prompt, gold answer, completion) and the sampling settings (api, max_tokens, temperature,
seed); the served model's *name* is not in it (a server may rename a model; the digest says which weights
answered). A value: the judge's reply, the parsed value and why it was refused. Malformed verdicts are cached
too (asking the same deterministic judge again would pay for the same reply); a request that failed
(timeout, HTTP error) is not.

The artifact is one JSONL file (``paths.judge_cache``, a DVC out kept between runs): a header line
(``HEADER``: an empty cache is one line, not an empty file DVC warns about), then one entry a line, sorted
by key: the same judgements give the same bytes (the same DVC hash), a person can grep a judgement, and the
merge is a sorted union. Several scoring processes (``reward.workers``) share it without locks: each process
reads the file (and the pending shards) once, at its first call, and appends what it newly paid for to its own
shard in ``<cache>.pending/`` (``<pid>-<random>.jsonl``, one ``write`` a line); at the end the stage merges
file + shards into a new file (``outputs.atomic_path``: the old cache or the new, never half) and removes the
shards. Shards a killed run left are read by the next run and merged at its end: what was paid is kept.
Counters (hits, misses, malformed, failed) go to ``<pid>-<random>.stats`` beside them and are summed by the
merge. Why not sqlite: a shared database file would need locks across processes and its bytes depend on the
write order; here each process writes only its own file. The limit: every process holds the cache's keys and
values in memory (about 0.3 KB an entry plus the reply), fine to millions of entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from posttrain.outputs import atomic_path

log = logging.getLogger("posttrain.judge")

ENV_CACHE = "POSTTRAIN_JUDGE_CACHE"  # the cache file scoring processes read and add to (set by judge.session)
COUNTERS = ("requests", "hits", "misses", "malformed", "failed", "overlong")


class Entry(NamedTuple):
    """One judgement: the judge's reply, its value in [0, 1] (None = malformed) and why it was refused."""

    reply: str
    value: float | None
    why: str | None


def key(judge: str, request: dict[str, Any]) -> str:
    """The cache key of a request to the judge with digest ``judge``."""
    return hashlib.sha256(json.dumps([judge, request], sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def pending_dir(cache: Path) -> Path:
    """Where scoring processes write what they add to ``cache`` until the stage merges it."""
    return cache.with_name(cache.name + ".pending")


# the merged file's first line: an empty cache is one line, not an empty file (DVC warns about an empty output)
HEADER = {"posttrain_judge_cache": 1}


def _read_entries(path: Path, into: dict[str, dict[str, Any]]) -> int:
    """Add the entries of one JSONL file; a line a killed writer cut short is skipped (counted)."""
    bad = 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                e = json.loads(line)
                if isinstance(e, dict) and next(iter(HEADER)) in e:  # the header (any version of it)
                    continue
                into[e["key"]] = e
            except (json.JSONDecodeError, KeyError, TypeError):
                bad += 1
    return bad


def load(cache: Path) -> dict[str, dict[str, Any]]:
    """The cache's entries by key: the file and every pending shard."""
    entries: dict[str, dict[str, Any]] = {}
    files = ([cache] if cache.exists() else []) + sorted(pending_dir(cache).glob("*.jsonl"))
    bad = sum(_read_entries(p, entries) for p in files)
    if bad:
        log.warning("%s: %d cut-short line(s) skipped", cache, bad)
    return entries


class Store:
    """One process's view of the cache: ``get``, ``put`` (to this process's shard) and counters. ``cache``
    None: in memory only (a caller with no cache configured)."""

    def __init__(self, cache: Path | None) -> None:
        self.cache = cache
        self.entries = load(cache) if cache is not None else {}
        self.counts: Counter[str] = Counter()
        self._name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def get(self, k: str) -> Entry | None:
        e = self.entries.get(k)
        return None if e is None else Entry(e["reply"], e["value"], e["why"])

    def put(self, k: str, judge: str, entry: Entry) -> None:
        e = {"key": k, "judge": judge, "reply": entry.reply, "value": entry.value, "why": entry.why}
        self.entries[k] = e
        if self.cache is not None:
            self._append(".jsonl", json.dumps(e, ensure_ascii=False))

    def count(self, counts: Counter[str]) -> None:
        """Add one call's counters (and append them to this process's stats file)."""
        self.counts.update(counts)
        if self.cache is not None:
            self._append(".stats", json.dumps(dict(counts)))

    def _append(self, suffix: str, line: str) -> None:
        assert self.cache is not None
        d = pending_dir(self.cache)
        d.mkdir(parents=True, exist_ok=True)
        with (d / (self._name + suffix)).open("a", encoding="utf-8") as f:
            f.write(line + "\n")  # one write a line: a kill leaves at most one cut line, which load skips


_STORES: dict[tuple[int, str | None], Store] = {}


def store(cache: Path | None = None) -> Store:
    """This process's store of ``cache`` (default: ``$POSTTRAIN_JUDGE_CACHE``, else in memory), read once."""
    if cache is None and os.environ.get(ENV_CACHE):
        cache = Path(os.environ[ENV_CACHE])
    k = (os.getpid(), None if cache is None else str(cache.absolute()))
    if k not in _STORES:
        _STORES[k] = Store(cache)
    return _STORES[k]


def reset_stats(cache: Path) -> None:
    """Remove the counters a killed run left (its entries stay: they are merged at this run's end)."""
    for p in pending_dir(cache).glob("*.stats"):
        p.unlink()


def merge(cache: Path) -> dict[str, Any]:
    """Write the cache file with every pending entry (sorted by key, replaced whole), remove the shards, and
    return the run's counters: requests, hits, misses, malformed, failed, ``hit_rate`` (hits / requests),
    ``malformed_rate`` (malformed / judged: of the replies got, fresh or cached), ``entries``, ``new``."""
    d = pending_dir(cache)
    entries = load(cache)
    before = len(_base(cache))
    counts: Counter[str] = Counter({c: 0 for c in COUNTERS})
    for p in sorted(d.glob("*.stats")) if d.exists() else []:
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                counts.update(json.loads(line))
            except json.JSONDecodeError:
                continue
    with atomic_path(cache, now=True) as tmp:  # the cache is kept even if the stage's other outputs are not
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps(HEADER) + "\n")
            for k in sorted(entries):
                f.write(json.dumps(entries[k], ensure_ascii=False, sort_keys=True) + "\n")
    for p in sorted(d.glob("*")) if d.exists() else []:
        p.unlink()
    if d.exists():
        d.rmdir()
    return {**dict(counts), **rates(counts), "entries": len(entries), "new": len(entries) - before}


def _base(cache: Path) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    if cache.exists():
        _read_entries(cache, entries)
    return entries


def rates(counts: Counter[str] | dict[str, int]) -> dict[str, float | None]:
    """``hit_rate`` = hits / requests; ``malformed_rate`` = malformed / (requests - failed): None when nothing
    was asked (or nothing came back)."""
    req, judged = counts.get("requests", 0), counts.get("requests", 0) - counts.get("failed", 0)
    return {"hit_rate": counts.get("hits", 0) / req if req else None,
            "malformed_rate": counts.get("malformed", 0) / judged if judged else None}
