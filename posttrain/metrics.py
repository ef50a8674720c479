"""Evaluation metrics: unbiased pass@k, maj@k and percentile-bootstrap confidence intervals."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

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


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool | None], k: int) -> bool:
    """Majority vote over the first ``k`` samples' extracted answers (None = no answer, no vote).

    Ties go to the answer seen first. True when the winning answer's sample is correct.
    """
    votes = [(a, bool(c)) for a, c in zip(answers[:k], correct[:k], strict=True) if a is not None]
    if not votes:
        return False
    counts = Counter(a for a, _ in votes)
    top = max(counts.values())
    winner = next(a for a, _ in votes if counts[a] == top)
    return next(c for a, c in votes if a == winner)


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
