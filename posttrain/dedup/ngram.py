"""The bounded n-gram index (``curate.dedup.method: ngram``): exact copies by digest, near duplicates by the
share of informative n-grams two rows hold in common. In memory (a posting list per distinct n-gram): the
method for up to ``auto_minhash_rows`` rows, where it also catches a copy inside a rare wrapper."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

from posttrain.dedup.found import Dup, Found
from posttrain.dedup.text import Features, Texts, features


def _exact_or_features(texts: Iterable[str], n: int, common: frozenset[str]
                       ) -> Iterator[tuple[int, int | None, Features, frozenset[str]]]:
    """(row, index of an earlier exact copy or None, features, informative n-grams) for each row."""
    seen: dict[bytes, int] = {}
    for i, t in enumerate(texts):
        f = features(t, n)
        first = seen.setdefault(f.digest, i)
        yield i, (first if first != i else None), f, f.grams - common


def near_ngram(texts: Texts, cfg: Any, common: frozenset[str], scratch: Path) -> Found:
    """Bounded n-gram index: informative n-gram overlap >= ``cfg.near_threshold`` with equal numbers; score =
    shared n-grams / the smaller row's count; each posting list holds at most ``cfg.max_postings`` rows.
    ``scratch`` is not used (the index is in memory)."""
    postings: dict[int, list[int]] = {}
    size: dict[int, int] = {}  # kept row -> informative n-grams
    nums: dict[int, int] = {}
    dups: list[Dup] = []
    for i, exact, f, inf in _exact_or_features(texts, cfg.near_ngram, common):
        if exact is not None:
            dups.append(Dup(i, exact, "exact", 1.0))
            continue
        keys = [hash(g) for g in inf]
        shared = Counter(chain.from_iterable(postings.get(k, ()) for k in keys))
        best: tuple[float, int] | None = None
        for j, c in shared.items():
            if cfg.numbers_must_match and nums[j] != f.numbers:
                continue
            score = c / min(len(keys), size[j])
            if score >= cfg.near_threshold and (best is None or (score, -j) > (best[0], -best[1])):
                best = (score, j)
        if best is not None:
            dups.append(Dup(i, best[1], "ngram", round(best[0], 3)))
            continue
        size[i], nums[i] = len(keys), f.numbers
        for k in keys:
            lst = postings.setdefault(k, [])
            if len(lst) < cfg.max_postings:
                lst.append(i)
    return Found.of_list(dups)
