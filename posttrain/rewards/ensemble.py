"""Learned-reward math (numpy, torch-free): how an ensemble's member scores become one score (``COMBINES``), and
how the scores of a completion's prefixes become a bounded per-step reward (``STEP_TRANSFORMS``).

``COMBINES``: one signature ``fn(r [N, K], lam) -> [N]``, ``r`` the K members' scores of N texts. From Coste,
Anwar, Kirk and Krueger, "Reward Model Ensembles Help Mitigate Overoptimization" (ICLR 2024, arXiv 2310.02743),
their section 3 (the digest we worked from names WCO/UWO but gives no formula;
these are the paper's):

- ``mean``: ``R_mean = (1/K) sum_i R_i``;
- ``wco`` (worst-case optimisation): ``R_WCO = min_i R_i``;
- ``uwo`` (uncertainty-weighted optimisation): ``R_UWO = (1/K) sum_i R_i - lam * (1/K) sum_i (R_i - R_mean)^2``,
  the intra-ensemble *variance* (population, 1/K), as in the paper;
- ``uwo_std``: the same with the standard deviation instead of the variance (issue 29's wording); with one
  member both UWOs are the mean.

``STEP_TRANSFORMS``: one signature ``fn(s [T], eta) -> r [T]``: ``s`` the (combined) scores of a completion's T
prefixes (a prefix ends at each step's end: process-reward-style scoring by an outcome RM), ``r`` each step's
reward; the completion's reward is ``sum(r)``, its accumulated reward. From Gao et al., "On Designing Effective
RL Reward at Training Time for LLM Reasoning" (arXiv 2410.15115), whose point is that summing raw per-step
scores lets a policy farm reward by adding (repeating) steps; Clip and Delta bound the accumulated reward
(the digest quotes "the accumulative reward of any reasoning trajectory ... upper-bounded"):

- ``raw``: ``r_t = s_t`` (unbounded in T: the hackable baseline, for experiments);
- ``clip``: ``r_t = min(s_t - eta, 0)``: every step at most 0, so ``sum(r) <= 0`` and a step scored below
  ``eta`` costs; more steps can never add reward;
- ``delta``: ``r_t = s_t - s_{t+1}`` for ``t < T``, ``r_T = s_T``: the return from step t telescopes to
  ``s_t``, so ``sum(r) = s_1`` whatever T. (Its point is per-step credit in a per-token update; this pipeline's
  update takes one scalar per completion, so under ``delta`` a completion scores its first step's score.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def mean(r: np.ndarray, lam: float) -> np.ndarray:
    """The members' mean (``lam`` unused)."""
    return r.mean(axis=1)  # [N]


def wco(r: np.ndarray, lam: float) -> np.ndarray:
    """Worst-case optimisation: the lowest member's score (``lam`` unused)."""
    return r.min(axis=1)  # [N]


def uwo(r: np.ndarray, lam: float) -> np.ndarray:
    """Uncertainty-weighted optimisation: mean minus ``lam`` times the members' variance (ddof 0)."""
    return r.mean(axis=1) - lam * r.var(axis=1)  # [N]


def uwo_std(r: np.ndarray, lam: float) -> np.ndarray:
    """Mean minus ``lam`` times the members' standard deviation (ddof 0)."""
    return r.mean(axis=1) - lam * r.std(axis=1)  # [N]


COMBINES: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {"mean": mean, "wco": wco, "uwo": uwo,
                                                                 "uwo_std": uwo_std}


def raw(s: np.ndarray, eta: float) -> np.ndarray:
    """Each step's score as its reward (``eta`` unused)."""
    return s


def clip(s: np.ndarray, eta: float) -> np.ndarray:
    """``min(s_t - eta, 0)``: no step earns more than 0."""
    return np.minimum(s - eta, 0.0)


def delta(s: np.ndarray, eta: float) -> np.ndarray:
    """``s_t - s_{t+1}``, the last step ``s_T`` (``eta`` unused)."""
    return np.append(s[:-1] - s[1:], s[-1:])


STEP_TRANSFORMS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {"raw": raw, "clip": clip, "delta": delta}


def step_ends(completion: str, sep: str) -> list[int]:
    """Where each step of ``completion`` ends (character offsets, the separator excluded), steps split on ``sep``
    and blank ones skipped; the last end is always the whole completion (its last prefix is the completion itself,
    trailing blanks included; an empty or blank completion is one step)."""
    ends, at = [], 0
    for part in completion.split(sep):
        at += len(part)
        if part.strip():
            ends.append(at)
        at += len(sep)
    if not ends:
        return [len(completion)]
    ends[-1] = len(completion)
    return ends
