"""Which prompts RL trains on, in what order, and what it believes of each before sampling.

- ``PROMPT_SELECTIONS``: registry of prompt selections by the reward stage's pass rates of the SFT policy, one
  signature ``fn(problems, rates, cfg: config.RlSelect) -> problems``.
- ``PromptCursor``: prompts in seeded per-epoch permutations; its position is part of the checkpoint.
- ``PriorState``: a per-prompt prior of the mean reward for ``algos.prior_fused`` (V0.5-style), started from
  the reward stage's measurement and updated after every step; checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from posttrain import algos


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


# ----------------------------------------------------------------------------------- prompt selection
# Which training prompts RL uses (one signature): fn(problems, rates, cfg: config.RlSelect) -> problems, where
# ``rates`` are the reward stage's per-prompt rows (pass_rate of the SFT policy over its G samples).


def _in_band(problems: list[dict[str, Any]], rates: Sequence[dict[str, Any]], cfg: Any
             ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    rate = {r["prompt_id"]: float(r["pass_rate"]) for r in rates if r["pass_rate"] is not None}
    return [p for p in problems if cfg.min_pass_rate <= rate.get(p["id"], -1.0) <= cfg.max_pass_rate], rate


def pass_band(problems: list[dict[str, Any]], rates: Sequence[dict[str, Any]], cfg: Any) -> list[dict[str, Any]]:
    """Every prompt whose SFT pass rate lies in [min_pass_rate, max_pass_rate] (unmeasured ones dropped): the
    band where a group of samples can disagree (DAPO-style filtering)."""
    return _in_band(problems, rates, cfg)[0]


def top_variance(problems: list[dict[str, Any]], rates: Sequence[dict[str, Any]], cfg: Any
                 ) -> list[dict[str, Any]]:
    """1-shot RLVR (Wang et al. 2025): the ``top_k`` prompts of the band with the largest reward variance
    p (1 - p), p the SFT policy's pass rate (the paper ranks by the variance of each example's accuracy over a
    full RL run; the pass rate the pipeline already measured stands in for that history). Ties keep the
    problems' order. E.g. rates 0.5, 0.9, 0.3 -> variances 0.25, 0.09, 0.21 -> top 2: the first and third."""
    band, rate = _in_band(problems, rates, cfg)
    ranked = sorted(range(len(band)), key=lambda i: -rate[band[i]["id"]] * (1 - rate[band[i]["id"]]))
    return [band[i] for i in sorted(ranked[: cfg.top_k])]


PROMPT_SELECTIONS: dict[str, Callable[[list[dict[str, Any]], Sequence[dict[str, Any]], Any], list[dict[str, Any]]]] = {
    "pass_band": pass_band, "top_variance": top_variance,
}


@dataclass
class PriorState:
    """Per-prompt prior of the mean reward, (p, n): value and pseudo-count, for ``algos.prior_fused``.

    Starts from the reward stage's measurement of the SFT policy (mean reward over its scorable samples); after
    every step each trained prompt's prior becomes the step's baseline (the fused one when the prior was
    accepted, else the group mean alone with the group's count), and its count halves (``DECAY``: the policy
    moved, so older evidence weighs less), capped at ``MAX_COUNT``. E.g. (0.5, 8) then r = [1, 0, 0, 0]:
    accepted, b = 5/12 -> (0.4167, min(8 + 4, 64) * 0.5 = 6)."""

    p: dict[str, float] = field(default_factory=dict)
    n: dict[str, float] = field(default_factory=dict)
    DECAY = 0.5
    MAX_COUNT = 64.0

    @classmethod
    def from_rates(cls, rates: Sequence[dict[str, Any]]) -> PriorState:
        ok = [x for x in rates if x.get("mean_reward") is not None and x.get("scorable")]
        return cls({x["prompt_id"]: float(x["mean_reward"]) for x in ok}, {x["prompt_id"]: float(x["scorable"])
                                                                          for x in ok})

    def tensor(self, ids: Sequence[str]) -> torch.Tensor:
        """[N, 2] (p, n) of ``ids``; (0, 0) for a prompt without a prior."""
        return torch.tensor([[self.p.get(i, 0.0), self.n.get(i, 0.0)] for i in ids])

    def update(self, ids: Sequence[str], r: torch.Tensor, valid: torch.Tensor) -> None:
        b, accepted = algos.fuse(r, valid, self.tensor(ids))
        g = valid.float().sum(1)
        for k, i in enumerate(ids):
            if g[k] == 0:
                continue
            n = self.n.get(i, 0.0) + float(g[k]) if accepted[k] else float(g[k])
            self.p[i], self.n[i] = float(b[k]), min(n, self.MAX_COUNT) * self.DECAY
