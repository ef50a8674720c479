"""The duplicates a method found, as four numpy columns (21 bytes a duplicate, not a Python object each: a
pool where a quarter of 10^7 rows are copies holds 2.5 * 10^6 of them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

METHOD_CODES = ("exact", "ngram", "minhash")
ITER_CHUNK = 1 << 14  # duplicates turned into Python objects at a time when iterated


@dataclass(frozen=True, slots=True)
class Dup:
    row: int  # index of the duplicate row
    of: int  # index of the kept row it repeats
    method: str  # "exact" | "ngram" | "minhash"
    score: float


class Found:
    """Duplicates sorted by row: ``row`` and ``of`` (int64), ``method`` (uint8, an index of ``METHOD_CODES``),
    ``score`` (float32, rounded to 3 places). Iterating yields :class:`Dup`, ``ITER_CHUNK`` made at a time."""

    def __init__(self, row: np.ndarray, of: np.ndarray, method: np.ndarray, score: np.ndarray) -> None:
        cols = (row.astype(np.int64, copy=False), of.astype(np.int64, copy=False),
                method.astype(np.uint8, copy=False), score.astype(np.float32, copy=False))
        if len(row) > 1 and np.any(cols[0][1:] < cols[0][:-1]):  # (sorted already: no copy)
            order = np.argsort(cols[0], kind="stable")
            cols = tuple(c[order] for c in cols)
        self.row, self.of, self.method, self.score = cols

    @classmethod
    def empty(cls) -> Found:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros(0, np.float32))

    @classmethod
    def of_list(cls, dups: list[Dup]) -> Found:
        return cls(np.array([d.row for d in dups], np.int64), np.array([d.of for d in dups], np.int64),
                   np.array([METHOD_CODES.index(d.method) for d in dups], np.uint8),
                   np.array([d.score for d in dups], np.float32))

    @classmethod
    def concat(cls, parts: list[Found]) -> Found:
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("row", "of", "method", "score")))

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, rows: slice) -> Found:
        """The duplicates in a slice of this one's (views of its columns, no copy)."""
        return Found(self.row[rows], self.of[rows], self.method[rows], self.score[rows])

    def __iter__(self) -> Iterator[Dup]:
        for k in range(0, len(self.row), ITER_CHUNK):  # (whole columns as lists: ~112 bytes a duplicate)
            part = slice(k, k + ITER_CHUNK)
            for r, o, m, s in zip(self.row[part].tolist(), self.of[part].tolist(), self.method[part].tolist(),
                                  self.score[part].tolist(), strict=True):
                yield Dup(r, o, METHOD_CODES[m], round(s, 3))

    def rooted(self) -> Found:
        """Each duplicate naming a kept row: an exact copy of a near duplicate names the
        row the near duplicate repeats (one hop is enough: a near duplicate always names a kept row)."""
        at = np.searchsorted(self.row, self.of)
        hit = at < len(self.row)
        hit[hit] = self.row[at[hit]] == self.of[hit]
        of = self.of.copy()  # (the columns may be a caller's arrays: never written)
        of[hit] = self.of[at[hit]]
        return Found(self.row, of, self.method, self.score)
