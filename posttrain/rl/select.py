"""Which prompts RL trains on, in what order, and what it believes of each before sampling.

- ``PROMPT_SELECTIONS``: registry of prompt selections by the reward stage's pass rates of the SFT policy, one
  signature ``fn(pool, rates, cfg: config.RlSelect) -> pool`` (``prompts.PromptPool``, the rates a table).
- ``PromptCursor``: prompts in seeded per-epoch permutations; its position is part of the checkpoint.
- ``PriorState``: a per-prompt prior of the mean reward for ``algos.prior_fused`` (V0.5-style), started from
  the reward stage's measurement and updated after every step; checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from posttrain import algos
from posttrain.rl.prompts import IdIndex, PromptPool


@dataclass
class PromptCursor:
    """Walks ``n`` prompts in per-epoch permutations of ``seed``; ``pos`` counts prompts handed out."""

    n: int
    seed: int
    pos: int = 0
    _perms: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.pos, self.n)
            if epoch not in self._perms:
                self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
            out.append(int(self._perms[epoch][i]))
            self.pos += 1
        return out

    def between(self, start: int, end: int) -> list[int]:
        """What ``take`` handed out from position ``start`` to ``end`` (a fresh walk: this cursor is untouched)."""
        return PromptCursor(self.n, self.seed, start).take(end - start)


# ----------------------------------------------------------------------------------- prompt selection
# Which training prompts RL uses (one signature): fn(pool, rates, cfg: config.RlSelect) -> pool, where ``pool`` is
# the train split (``prompts.PromptPool``) and ``rates`` the reward stage's per-prompt rows as a table (pass_rate
# of the SFT policy over its G samples; ``prompts.read_rates``). Vectorised over the table: no row becomes a dict.


def _in_band(pool: PromptPool, rates: pa.Table, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """The pool's rows whose pass rate lies in [min_pass_rate, max_pass_rate] (in pool order), and their rates."""
    at = pc.index_in(pool.ids, value_set=rates.column("prompt_id").combine_chunks())  # null: not measured
    rate = pc.take(rates.column("pass_rate"), at).to_numpy(zero_copy_only=False).astype(float)  # NaN: unknown
    rows = np.flatnonzero((rate >= cfg.min_pass_rate) & (rate <= cfg.max_pass_rate))
    return rows, rate[rows]


def pass_band(pool: PromptPool, rates: pa.Table, cfg: Any) -> PromptPool:
    """Every prompt whose SFT pass rate lies in [min_pass_rate, max_pass_rate] (unmeasured ones dropped): the
    band where a group of samples can disagree (DAPO-style filtering)."""
    return pool.subset(_in_band(pool, rates, cfg)[0])


def top_variance(pool: PromptPool, rates: pa.Table, cfg: Any) -> PromptPool:
    """1-shot RLVR (Wang et al. 2025): the ``top_k`` prompts of the band with the largest reward variance
    p (1 - p), p the SFT policy's pass rate (the paper ranks by the variance of each example's accuracy over a
    full RL run; the pass rate the pipeline already measured stands in for that history). Ties keep the
    problems' order. E.g. rates 0.5, 0.9, 0.3 -> variances 0.25, 0.09, 0.21 -> top 2: the first and third."""
    rows, rate = _in_band(pool, rates, cfg)
    top = np.argsort(-(rate * (1 - rate)), kind="stable")[: cfg.top_k]
    return pool.subset(rows[np.sort(top)])


def every_prompt(pool: PromptPool, rates: pa.Table, cfg: Any) -> PromptPool:
    """The whole train split, measured by the reward stage or not (the pass-rate bounds are not used): RL draws
    from every prompt instead of the ``rollout.num_prompts`` the reward stage measured, so a run of S steps of B
    prompts sees S x B distinct prompts while the split holds them. Prompts no group can disagree on are left to
    ``rl.dynamic_sampling``; ``prior_fused`` starts an unmeasured prompt from no prior."""
    return pool


PROMPT_SELECTIONS: dict[str, Callable[[PromptPool, pa.Table, Any], PromptPool]] = {
    "pass_band": pass_band, "top_variance": top_variance, "all": every_prompt,
}


@dataclass
class PriorState:
    """Per-prompt prior of the mean reward, (p, n): value and pseudo-count, for ``algos.prior_fused``.

    Starts from the reward stage's measurement of the SFT policy (mean reward over its scorable samples); after
    every step each trained prompt's prior becomes the step's baseline (the fused one when the prior was
    accepted, else the group mean alone with the group's count), and its count halves (``DECAY``: the policy
    moved, so older evidence weighs less), capped at ``MAX_COUNT``. E.g. (0.5, 8) then r = [1, 0, 0, 0]:
    accepted, b = 5/12 -> (0.4167, min(8 + 4, 64) * 0.5 = 6)."""

    p: dict[str, float] = field(default_factory=dict)  # the priors updated since the start (checkpointed)
    n: dict[str, float] = field(default_factory=dict)
    # the reward stage's priors, read from its columns (ids, mean reward, scorable count): not copied into p and n,
    # so a pool of 10^6 prompts holds (and checkpoints) a dict entry only for the prompts trained on
    base: tuple[IdIndex, np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)
    DECAY = 0.5
    MAX_COUNT = 64.0

    @classmethod
    def from_rates(cls, rates: pa.Table) -> PriorState:
        """From the pass-rate rows (``prompts.read_rates``) with a mean reward over at least one scorable sample."""
        if "mean_reward" not in rates.column_names:
            return cls()
        ok = rates.filter(pc.and_(pc.is_valid(rates.column("mean_reward")), pc.greater(rates.column("scorable"), 0)))
        return cls(base=(IdIndex(ok.column("prompt_id").combine_chunks()),
                         *(ok.column(c).to_numpy().astype(float) for c in ("mean_reward", "scorable"))))

    def get(self, i: str) -> tuple[float, float]:
        """(p, n) of prompt ``i``: its latest update, else the reward stage's, else (0, 0)."""
        if i in self.p:
            return self.p[i], self.n[i]
        if self.base is not None and (k := self.base[0].find(i)) >= 0:
            return float(self.base[1][k]), float(self.base[2][k])
        return 0.0, 0.0

    def tensor(self, ids: Sequence[str]) -> torch.Tensor:
        """[N, 2] (p, n) of ``ids``; (0, 0) for a prompt without a prior."""
        return torch.tensor([self.get(i) for i in ids])

    def update(self, ids: Sequence[str], r: torch.Tensor, valid: torch.Tensor) -> None:
        b, accepted = algos.fuse(r, valid, self.tensor(ids))
        g = valid.float().sum(1)
        for k, i in enumerate(ids):
            if g[k] == 0:
                continue
            n = self.get(i)[1] + float(g[k]) if accepted[k] else float(g[k])
            self.p[i], self.n[i] = float(b[k]), min(n, self.MAX_COUNT) * self.DECAY
