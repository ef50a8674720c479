"""What dedup reads of a text: its exact key, its word n-grams, its numbers, and the boilerplate n-grams of a
set (the rules are the package docstring's)."""


from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

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
