"""Deduplication that scales and keeps distinct problems apart: exact duplicates by digest, near duplicates
by a bounded n-gram index or by MinHash-LSH (``datasketch``).

Why partly hand-written: ``datasketch`` gives MinHash and the LSH buckets (used for large sets), but no
library gives the rules that keep distinct maths problems apart, which is what matters here:

- **Exact**: a 16-byte blake2b digest of the normalised token stream (``decontam.words``: NFKC, casefold,
  LaTeX read as plain maths, punctuation split), so memory is a digest a row, never the text.
- **Boilerplate**: word n-grams (within sentences, so reordered sentences give the same set) found in more
  than ``boilerplate_frac`` of the rows, counted on an evenly spaced sample of at most ``df_sample`` rows,
  are neither indexed nor scored: a shared instruction template (DAPO-Math-17k's, "Please reason step by
  step...") cannot make two problems look alike, and a copy wrapped in a common template is still caught.
- **Numbers decide**: two rows are near duplicates only if they hold the same numbers in the same order with
  the same signs and operators, sentence by sentence (digit runs, number words, ``+ - * / = ^`` and
  plus/minus/times; ``numbers_must_match``). "Simplify √50" and "Simplify √72" are two problems, and so are
  "60 miles in 2 hours" and "2 miles in 60 hours"; a re-spaced, re-cased, reordered, LaTeX-rewritten or
  templated copy keeps its numbers.
- ``ngram``: score = shared informative n-grams / the smaller row's count (an edited copy, or a copy inside
  a wrapper); every n-gram's posting list holds at most ``max_postings`` rows, so a row looks at most
  (its n-grams x max_postings) candidates: no quadratic walk. Memory grows with distinct n-grams.
- ``minhash``: datasketch MinHash signatures of the informative n-grams; LSH bands (b x r chosen by
  datasketch's ``MinHashLSH`` for ``minhash_threshold``), each kept as one 32-bit key a row and grouped with
  numpy sorts, because datasketch's in-memory buckets cost ~6 KB a row (6 GB at a million rows); candidates
  confirmed by their recomputed signatures' estimated Jaccard and the numbers. About 125 bytes a row at the
  defaults, the texts streamed twice (``Texts``). Catches copies (Jaccard), not a copy inside a rare wrapper
  (containment): that is the n-gram index's job.

First occurrence kept; a duplicate names the kept row it repeats.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any, Protocol

import numpy as np

from posttrain.decontam import ngrams, sentences, words

_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_NUMBER_WORDS |= {w: str(10 * i) for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), 3)}
_NUMBER_WORDS |= {"hundred": "100", "thousand": "1000", "million": "1000000", "half": "1/2", "twice": "x2"}
_OPERATORS = {"+": "+", "-": "-", "*": "*", "/": "/", "=": "=", "^": "^", "plus": "+", "minus": "-", "times": "*",
              "negative": "-"}


class Texts(Protocol):
    """The rows' texts: sized and iterable more than once (a list, or ``schema.Column`` streaming a Parquet
    column), so no method needs them all in memory at once."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[str]: ...


@dataclass(frozen=True)
class Features:
    digest: bytes  # exact-duplicate key
    grams: frozenset[str]  # word n-grams within sentences (boilerplate not yet removed)
    numbers: int  # hash of `maths` (stable within a run; equality only)


@dataclass(frozen=True, slots=True)
class Dup:
    row: int  # index of the duplicate row
    of: int  # index of the kept row it repeats
    method: str  # "exact" | "ngram" | "minhash"
    score: float


def features(text: str, n: int) -> Features:
    """The exact key, the n-grams and the numbers of one text (see the module docstring)."""
    toks = words(text)
    digest = hashlib.blake2b(" ".join(toks).encode(), digest_size=16).digest()
    grams = frozenset().union(*(ngrams(s, n) for s in sentences(toks))) if toks else frozenset()
    return Features(digest, grams, hash(maths(toks)))


def maths(toks: list[str]) -> tuple[tuple[str, ...], ...]:
    """The numbers of a text in order with their signs and operators, per sentence (sentences sorted, so a
    reordered copy keeps them): "60 miles in 2 hours" and "2 miles in 60 hours", or "x^2 - 4x + 3" and
    "x^2 + 4x - 3", are two problems."""
    per = (tuple(_NUMBER_WORDS.get(t) or _OPERATORS.get(t) or t for t in s
                 if t.isdigit() or t in _NUMBER_WORDS or t in _OPERATORS)
           for s in sentences(toks))
    return tuple(sorted(p for p in per if any(t not in _OPERATORS for t in p)))


def boilerplate(texts: Texts, n: int, frac: float, sample: int, min_rows: int = 3) -> frozenset[str]:
    """N-grams in more than ``frac`` of an evenly spaced sample of at most ``sample`` rows (and in more than
    ``min_rows`` of them, so a tiny set has none)."""
    step = max(1, len(texts) // sample)
    picked = 0
    df: Counter[str] = Counter()
    for t in islice(texts, 0, None, step):
        if picked == sample:
            break
        df.update(features(t, n).grams)
        picked += 1
    limit = max(min_rows, frac * picked)
    return frozenset(g for g, c in df.items() if c > limit)


def _exact_or_features(texts: Iterable[str], n: int, common: frozenset[str]
                       ) -> Iterator[tuple[int, int | None, Features, frozenset[str]]]:
    """(row, index of an earlier exact copy or None, features, informative n-grams) for each row."""
    seen: dict[bytes, int] = {}
    for i, t in enumerate(texts):
        f = features(t, n)
        first = seen.setdefault(f.digest, i)
        yield i, (first if first != i else None), f, f.grams - common


def near_ngram(texts: Texts, cfg: Any, common: frozenset[str]) -> list[Dup]:
    """Bounded n-gram index: informative n-gram overlap >= ``cfg.near_threshold`` with equal numbers."""
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
    return dups


def near_minhash(texts: Texts, cfg: Any, common: frozenset[str]) -> list[Dup]:
    """MinHash-LSH over informative n-grams: estimated Jaccard >= ``cfg.minhash_threshold`` with equal
    numbers. datasketch computes the signatures and picks the bands (b x r) for the threshold. One pass keeps,
    per row, its digest, its numbers and one 32-bit key per band (``b x 4`` bytes: 100 at the defaults, b = 25
    for threshold 0.5, where a signature is ``num_perm x 4`` = 512; two bands whose keys collide make a
    spurious candidate the signatures then refuse); bands are grouped with numpy sorts (``_lsh_pairs``, each
    row meeting at most ``max_postings`` earlier rows per band); a second pass recomputes the signatures of
    the candidate rows only, to confirm each pair by its estimated Jaccard. Memory: those few arrays of a
    number a row; time: linear."""
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=cfg.minhash_threshold, num_perm=cfg.num_perm)  # only for datasketch's b, r
    perms = MinHash(num_perm=cfg.num_perm, seed=1, scheme="affine32").permutations
    mult = np.random.default_rng(0).integers(1, 2**63, size=lsh.r, dtype=np.uint64) | np.uint64(1)  # odd

    def signature(inf: frozenset[str]) -> np.ndarray:
        m = MinHash(num_perm=cfg.num_perm, seed=1, permutations=perms, scheme="affine32")
        m.update_batch([g.encode() for g in inf])
        return m.hashvalues

    n = len(texts)
    digests, nums = np.zeros((n, 2), dtype=np.uint64), np.zeros(n, dtype=np.int64)
    keys = np.zeros((n, lsh.b), dtype=np.uint32)
    usable = np.zeros(n, dtype=bool)  # has informative n-grams and is no exact copy
    for i, t in enumerate(texts):
        f = features(t, cfg.near_ngram)
        digests[i], nums[i] = np.frombuffer(f.digest, dtype=np.uint64), f.numbers
        if inf := f.grams - common:
            bands = signature(inf)[: lsh.b * lsh.r].reshape(lsh.b, lsh.r).astype(np.uint64)
            keys[i], usable[i] = (bands * mult).sum(axis=1) >> np.uint64(32), True  # a hash of the band (mod 2^64)
    dups = _exact(digests)
    usable[[d.row for d in dups]] = False
    later, earlier = _lsh_pairs(keys, usable, nums if cfg.numbers_must_match else None, cfg.max_postings)
    del keys
    need = np.unique(np.concatenate([later, earlier]))
    sig = np.zeros((len(need), cfg.num_perm), dtype=np.uint32)  # (affine32: values < 2^32)
    wanted = np.zeros(n, dtype=bool)
    wanted[need] = True
    for i, t in enumerate(texts):  # the candidates' signatures, recomputed (no signature was kept)
        if wanted[i]:
            sig[np.searchsorted(need, i)] = signature(features(t, cfg.near_ngram).grams - common)
    a, b = np.searchsorted(need, later), np.searchsorted(need, earlier)
    score = np.concatenate([(sig[a[k:k + 65536]] == sig[b[k:k + 65536]]).mean(axis=1)
                            for k in range(0, len(a), 65536)] or [np.zeros(0)])
    ok = score >= cfg.minhash_threshold
    later, earlier, score = later[ok], earlier[ok], score[ok]
    kept = np.ones(n, dtype=bool)
    kept[[d.row for d in dups]] = False
    for k in np.lexsort((earlier, -score, later)):  # by row; best score, then earliest row, first
        j, i = int(later[k]), int(earlier[k])
        if kept[j] and kept[i]:
            kept[j] = False
            dups.append(Dup(j, i, "minhash", round(float(score[k]), 3)))
    return sorted(dups, key=lambda d: d.row)


def _exact(digests: np.ndarray) -> list[Dup]:
    """Rows whose digest an earlier row has, each naming the first row with it (a stable sort of the digests)."""
    order = np.lexsort((digests[:, 1], digests[:, 0]))  # stable: equal digests stay in row order
    sd = digests[order]
    new_run = np.r_[True, np.any(sd[1:] != sd[:-1], axis=1)]
    first = order[np.flatnonzero(new_run)][np.cumsum(new_run) - 1]
    return [Dup(int(j), int(i), "exact", 1.0) for j, i in zip(order[~new_run], first[~new_run], strict=True)]


def _lsh_pairs(keys: np.ndarray, usable: np.ndarray, nums: np.ndarray | None, cap: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pairs (later row, earlier row), unique: rows with the same key in some band (and the same
    numbers, unless ``nums`` is None), each row paired with the first ``cap`` rows of its bucket. (datasketch's
    in-memory ``MinHashLSH`` keeps ~350 bytes a band a row in Python dicts, 6.4 KB a row at num_perm 128: 6 GB
    at a million rows; sorting each band's keys with numpy needs a few arrays of one integer a row.)"""
    rows = np.flatnonzero(usable)
    pairs = []
    for k in range(keys.shape[1]):
        band = keys[rows, k]
        order = np.argsort(band, kind="stable")  # equal keys stay in row order
        sb = band[order]
        new_run = np.r_[True, sb[1:] != sb[:-1]]
        pos = np.flatnonzero(~new_run)  # positions in a bucket after its first row
        start = np.flatnonzero(new_run)[np.cumsum(new_run)[pos] - 1]  # where each one's bucket starts
        for d in range(cap):
            first = start + d
            m = first < pos
            if not m.any():
                break
            later, earlier = rows[order[pos[m]]], rows[order[first[m]]]
            if nums is not None:
                same = nums[later] == nums[earlier]
                later, earlier = later[same], earlier[same]
            pairs.append(np.unique((later << 32) | earlier))
    if not pairs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    key = np.unique(np.concatenate(pairs))
    return key >> 32, key & 0xFFFFFFFF


METHODS: dict[str, Callable[[Texts, Any, frozenset[str]], list[Dup]]] = {
    "ngram": near_ngram, "minhash": near_minhash,
}


def resolve_method(cfg: Any, rows: int) -> str:
    """``auto``: MinHash-LSH from ``auto_minhash_rows`` rows on, the n-gram index below."""
    if cfg.method != "auto":
        return cfg.method
    return "minhash" if rows >= cfg.auto_minhash_rows else "ngram"


def find_duplicates(texts: Texts, cfg: Any) -> tuple[str, list[Dup]]:
    """The method used and every duplicate (exact or near) of ``texts`` (a list, or a column of a Parquet file
    read a batch at a time: ``schema.Column``), first occurrence kept."""
    method = resolve_method(cfg, len(texts))
    common = boilerplate(texts, cfg.near_ngram, cfg.boilerplate_frac, cfg.df_sample)
    dups = METHODS[method](texts, cfg, common)
    named = {d.of for d in dups}  # an exact copy of a near duplicate names the row that was kept:
    root = {d.row: d.of for d in dups if d.row in named}  # (only the rare duplicate another one names)
    return method, [d if d.of not in root else Dup(d.row, root[d.of], d.method, d.score) for d in dups]
