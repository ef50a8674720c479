"""Evaluation metrics: unbiased pass@k, maj@k, Wilson intervals for proportions, percentile-bootstrap
intervals (over problems) for means of per-problem values, and paired intervals for differences (Newcombe's
hybrid score interval for paired 0/1 outcomes, the paired bootstrap otherwise).

Hand-written because each is a few lines of numpy and the field's libraries (scipy, statsmodels) would be
a heavy dependency for them; every formula is tested against hand-computed values."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples (Chen et al. 2021, Codex).

    pass@k = 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k/i) for stability.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _majority_correct(answers: Sequence[str | None], correct: Sequence[bool | None]) -> bool:
    """Majority vote over extracted answers (None = no vote); ties go to the answer seen first."""
    votes = [(a, bool(c)) for a, c in zip(answers, correct, strict=True) if a is not None]
    if not votes:
        return False
    counts = Counter(a for a, _ in votes)
    top = max(counts.values())
    winner = next(a for a, _ in votes if counts[a] == top)
    return next(c for a, c in votes if a == winner)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool | None], k: int) -> float:
    """maj@k of one problem from its ``n`` samples: the mean, over the ``n // k`` disjoint blocks of ``k``
    consecutive samples, of whether the block's majority answer is correct.

    Samples are exchangeable, so each block is an unbiased draw of maj@k and the mean uses (nearly) every
    sample, as pass@k does; the ``n mod k`` trailing samples are in no block. k = n is the plain majority of
    all samples. Ties go to the answer seen first within the block (a random tie-break, by exchangeability).
    """
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n} k={k}")
    blocks = [_majority_correct(answers[i : i + k], correct[i : i + k]) for i in range(0, n - k + 1, k)]
    return float(np.mean(blocks))


Z95 = 1.959963984540054  # standard normal quantile at 0.975


def wilson_ci(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927): never zero-width at 0% or 100%, unlike
    a percentile bootstrap or the Wald interval. (nan, nan) for n = 0. ``successes`` may be fractional (the
    sum of per-problem rates that are all 0 or 1 within ``BINARY_EPS``)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return float(lo), float(hi)


BINARY_EPS = 0.01  # a per-problem rate within this of 0 or 1 is a decided problem (pass@8 of 64 at c >= 27)


def near_binary(x: np.ndarray, eps: float = BINARY_EPS) -> bool:
    """True when every value is within ``eps`` of 0 or of 1: the values are 0/1 outcomes for an interval."""
    return bool(x.size) and bool(np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) <= eps))


def newcombe_paired_ci(a: Sequence[float], b: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """Interval of p_b - p_a for paired 0/1 outcomes (``a[i]``, ``b[i]``: two models on problem i): Newcombe's
    hybrid score interval (Newcombe 1998, Stat. Med. 17:873, method 10), built from the two Wilson intervals
    and the phi correlation of the 2x2 table; phi = 0 where a margin is empty, as the paper sets it. Unlike a
    bootstrap of the differences it never collapses to a point when both models sit at 0% or 100%: 100 of
    100 against 100 of 100 gives +-0.037, the Wilson half-room of each."""
    x, y = np.rint(np.asarray(a, dtype=float)), np.rint(np.asarray(b, dtype=float))
    n = x.size
    if n == 0:
        return (float("nan"), float("nan"))
    both, only_b = float(np.sum((x == 1) & (y == 1))), float(np.sum((x == 0) & (y == 1)))
    only_a, neither = float(np.sum((x == 1) & (y == 0))), float(np.sum((x == 0) & (y == 0)))
    p1, p2 = (both + only_b) / n, (both + only_a) / n  # p1 = p_b, p2 = p_a
    (l1, u1), (l2, u2) = wilson_ci(both + only_b, n, z), wilson_ci(both + only_a, n, z)
    denom = (both + only_b) * (only_a + neither) * (both + only_a) * (only_b + neither)
    phi = (both * neither - only_b * only_a) / np.sqrt(denom) if denom > 0 else 0.0
    delta = np.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    eps = np.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return float(max(-1.0, p1 - p2 - delta)), float(min(1.0, p1 - p2 + eps))


def paired_rate_ci(a: Sequence[float], b: Sequence[float], n_boot: int = 1000, seed: int = 0
                   ) -> tuple[float, float]:
    """Interval of mean(b) - mean(a) for per-problem rates in [0, 1] of two models on the same problems:
    Newcombe's paired interval where both are 0/1 outcomes (``near_binary``), the paired bootstrap otherwise
    (which would collapse to +0.0 [+0.0, +0.0] for two models at 100% on every problem)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.size != y.size:
        raise ValueError(f"paired values need equal lengths, got {x.size} and {y.size}")
    if near_binary(x) and near_binary(y):
        return newcombe_paired_ci(x, y)
    return paired_bootstrap_ci(x, y, n_boot, seed)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], n_boot: int = 1000, seed: int = 0,
                        alpha: float = 0.05) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(b) - mean(a) over problems resampled *jointly* (``a[i]`` and
    ``b[i]`` are two models on the same problem i): the problem-to-problem variation both share cancels,
    which is what makes a model-vs-model ordering decidable."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    return bootstrap_ci(np.asarray(b, dtype=float) - np.asarray(a, dtype=float), n_boot, seed, alpha)


def bootstrap_ci(values: Sequence[float], n_boot: int = 1000, seed: int = 0, alpha: float = 0.05
                 ) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem ``values`` (resampling problems)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def rate_ci(values: Sequence[float], n_boot: int = 1000, seed: int = 0) -> tuple[float, float]:
    """Interval of the mean of per-problem rates in [0, 1] (pass@k, maj@k): the percentile bootstrap over
    problems, except when every problem sits within ``BINARY_EPS`` of 0 or 1 (``near_binary``), where
    resampling barely moves the mean and the bootstrap interval collapses towards a point ([1.0, 1.0] for
    pass@64 = 100%; [0.99999, 1.0] for pass@8 of 64 samples at c = 56 of 64 everywhere). There the rates are
    0/1 outcomes, and the Wilson interval of their sum over n problems says how far the truth can be: 100 of
    100 -> [0.963, 1.0] (Wilson 1927; a Jeffreys interval needs a Beta quantile this pipeline does not
    otherwise import, and agrees to the third decimal here)."""
    x = np.asarray(values, dtype=float)
    if near_binary(x):
        return wilson_ci(float(x.sum()), int(x.size))
    return bootstrap_ci(x, n_boot, seed)


# Per-problem metrics reported as plain means, without an interval (lengths, the truncated share and the share
# refused by a verifier guard describe the completions; they are not accuracies to compare).
NO_INTERVAL = frozenset({"len", "greedy_len", "truncated", "guarded"})


def paired_table(per_a: dict[str, dict[str, Any]], per_b: dict[str, dict[str, Any]], n_boot: int, seed: int,
                 skip: Callable[[str], bool] = lambda key: False) -> dict[str, dict[str, Any]]:
    """B - A per metric over the problem ids both have (``per_*``: problem id -> per-problem metrics): each
    side's mean, the mean difference, its paired 95% interval (:func:`paired_rate_ci`; (nan, nan) for a key in
    ``NO_INTERVAL``) and the problems counted. Keys for which ``skip`` says so are left out. What the report
    stage and ``posttrain compare`` both print."""
    ids = [i for i in per_a if i in per_b]
    out: dict[str, dict[str, Any]] = {}
    for key in (k for k in dict.fromkeys(k for i in ids for k in per_a[i]) if not skip(k)):
        both = [i for i in ids if key in per_a[i] and key in per_b[i]]
        if not both:
            continue
        x, y = [float(per_a[i][key]) for i in both], [float(per_b[i][key]) for i in both]
        ci = paired_rate_ci(x, y, n_boot, seed) if key not in NO_INTERVAL else (float("nan"), float("nan"))
        out[key] = {"a": round(float(np.mean(x)), 4), "b": round(float(np.mean(y)), 4),
                    "diff": round(float(np.mean(y) - np.mean(x)), 4), "ci": [round(v, 4) for v in ci], "n": len(both)}
    return out
