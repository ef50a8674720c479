"""Deduplication that scales and keeps distinct problems apart: exact duplicates by digest, near duplicates
by a bounded n-gram index (``ngram``) or by MinHash-LSH (``minhash``, ``datasketch``) whose index is spilled
to disk, so its memory does not grow with the rows.

Why partly hand-written: ``datasketch`` gives MinHash and the LSH bands (used for large sets), but no
library gives the rules that keep distinct maths problems apart, which is what matters here:

- **Exact**: a 16-byte blake2b digest of the normalised token stream (``decontam.words``: NFKC, casefold,
  LaTeX read as plain maths, punctuation split), so the index holds a digest a row, never the text.
- **Boilerplate**: word n-grams (within sentences, so reordered sentences give the same set) found in more
  than ``boilerplate_frac`` of the rows, counted on an evenly spaced sample of at most ``df_sample`` rows,
  are neither indexed nor scored: a shared instruction template (DAPO-Math-17k's, "Please reason step by
  step...") cannot make two problems look alike, and a copy wrapped in a common template is still caught.
- **Numbers decide**: two rows are near duplicates only if they hold the same numbers in the same order with
  the same signs and operators, sentence by sentence (digit runs, number words, ``+ - * / = ^`` and
  plus/minus/times; ``numbers_must_match``). "Simplify √50" and "Simplify √72" are two problems, and so are
  "60 miles in 2 hours" and "2 miles in 60 hours"; a re-spaced, re-cased, reordered, LaTeX-rewritten or
  templated copy keeps its numbers.
- ``ngram`` (``dedup.ngram``): score = shared informative n-grams / the smaller row's count (an edited copy,
  or a copy inside a wrapper); posting lists of at most ``max_postings`` rows, so no quadratic walk; in
  memory (grows with distinct n-grams): the method below ``auto_minhash_rows`` rows.
- ``minhash`` (``dedup.minhash``): estimated Jaccard of informative n-grams; the digests and LSH band keys
  go to hash partitions on disk (``dedup.spill``) and are grouped a partition at a time. Catches copies
  (Jaccard), not a copy inside a rare wrapper (containment): that is the n-gram index's job.

First occurrence kept; a duplicate names the kept row it repeats.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.dedup.found import Dup, Found
from posttrain.dedup.minhash import near_minhash
from posttrain.dedup.ngram import near_ngram
from posttrain.dedup.text import Features, Texts, boilerplate, features, maths

__all__ = ["METHODS", "Dup", "Features", "Found", "Texts", "boilerplate", "features", "find_duplicates", "maths",
           "resolve_method"]

METHODS: dict[str, Callable[[Texts, Any, frozenset[str], Path], Found]] = {
    "ngram": near_ngram,
    "minhash": near_minhash,
}


def resolve_method(cfg: Any, rows: int) -> str:
    """``auto``: MinHash-LSH from ``auto_minhash_rows`` rows on, the n-gram index below."""
    if cfg.method != "auto":
        return cfg.method
    return "minhash" if rows >= cfg.auto_minhash_rows else "ngram"


def find_duplicates(texts: Texts, cfg: Any, scratch: Path | None = None) -> tuple[str, Found]:
    """The method used and every duplicate (exact or near) of ``texts`` (a list, or a column of a Parquet file
    read a batch at a time: ``schema.Column``), first occurrence kept, sorted by row. ``scratch``: where the
    MinHash index is spilled (a temporary folder inside it; the system's temporary folder by default)."""
    method = resolve_method(cfg, len(texts))
    common = boilerplate(texts, cfg.near_ngram, cfg.boilerplate_frac, cfg.df_sample)
    with tempfile.TemporaryDirectory(prefix="dedup-", dir=scratch) as tmp:
        return method, METHODS[method](texts, cfg, common, Path(tmp)).rooted()
