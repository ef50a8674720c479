"""One RL step's samples: rollout -> reward, DAPO dynamic sampling and the adaptive prior budget.

The same ``sample_rows`` as the rollout stage and the same ``score_rows`` as the reward stage, so the loop
samples and scores exactly as the standalone stages do. Under torchrun every rank samples and scores its
contiguous share of each round's prompts (whole groups on one rank) and the rows are gathered, so every rank
holds the whole step (dynamic sampling and group advantages are computed on all of it, identically).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain import algos, distributed, seeds
from posttrain.config import Rl
from posttrain.rewards import RewardPool, score_rows
from posttrain.rl.select import PriorState, PromptCursor
from posttrain.rollout import RolloutBackend, SamplingParams, sample_rows


@dataclass
class StepBatch:
    """What one step collected: the groups that enter the update, every group sampled (for the shard)."""

    groups: list[list[dict[str, Any]]]
    sampled: list[list[dict[str, Any]]]
    zero_var_frac: float  # share of zero-variance groups in the first round
    rounds: int  # refill rounds beyond the first
    gen_s: float
    reward_s: float


def collect_step(backend: RolloutBackend, tokenizer: Any, prompts: Sequence[dict[str, Any]], cursor: PromptCursor,
                 cfg: Rl, reward_specs: Sequence[Any], seed: int, policy: str, prior: PriorState | None = None,
                 pool: RewardPool | None = None) -> StepBatch:
    """Rollout -> reward for one step, with DAPO dynamic sampling (``cfg.dynamic_sampling``).

    ``off`` keeps every group; ``skip`` drops zero-variance groups (no signal under a group baseline);
    ``refill`` samples further prompts until ``prompts_per_step`` groups with signal are found or
    ``max_refill_rounds`` extra rounds are spent. Round ``k`` is seeded ``seeds.refill_round`` (``seeds.rank``).

    With ``prior`` and ``cfg.prior_budget`` > 0 (the adaptive rollout budget of V0.5 / Reinforce-Ada): a
    prompt whose prior the group rejects (``algos.fuse``'s test) gets G more samples from the same policy, in
    order, until the step's budget of extra samples is spent; their mean reward replaces the stale prior
    (count: their number), so the fused baseline rests on fresh evidence. They are recorded (in ``sampled``)
    but not trained on. Seeded ``seeds.prior_round``. ``pool``: where rewards are scored (None: in this thread).
    """
    d = distributed.current()
    g, b, sp = cfg.samples_per_prompt, cfg.prompts_per_step, cfg.sampling
    groups: list[list[dict[str, Any]]] = []
    sampled: list[list[dict[str, Any]]] = []
    gen_s = reward_s = zero_frac = 0.0
    rounds, budget = 0, cfg.prior_budget if prior is not None else 0

    def sample(batch: Sequence[dict[str, Any]], round_seed: int) -> list[dict[str, Any]]:
        nonlocal gen_s, reward_s
        rows, secs = sample_rows(backend, tokenizer, d.shard(batch), g,
                                 SamplingParams(sp.temperature, sp.top_p, sp.max_new_tokens,
                                                seeds.rank(round_seed, d.rank)),
                                 policy=policy, chunk_prompts=max(1, cfg.generate_batch_size // g))
        gen_s += secs
        t = time.time()
        rows = d.gather_shards(score_rows(rows, reward_specs, pool))
        reward_s += time.time() - t
        return rows

    while True:
        batch = [prompts[i] for i in cursor.take(b - len(groups))]
        rows = sample(batch, seeds.refill_round(seed, rounds))
        zv = zero_variance(*reward_matrix(rows, g)).tolist()
        if rounds == 0:
            zero_frac = sum(zv) / len(zv)
        for i, z in enumerate(zv):
            sampled.append(rows[i * g : (i + 1) * g])
            if cfg.dynamic_sampling == "off" or not z:
                groups.append(sampled[-1])
        if budget >= g:  # after the round's groups: sampled[: B * G] stays the first round
            s_prior = seeds.prior_round(seed, rounds)
            extra = refresh_priors(prior, rows, g, budget // g, lambda bt, s=s_prior: sample(bt, s),
                                   {p["id"]: p for p in batch})
            sampled += extra
            budget -= g * len(extra)
        if cfg.dynamic_sampling != "refill" or len(groups) >= b or rounds >= cfg.max_refill_rounds:
            break
        rounds += 1
    return StepBatch(groups[:b], sampled, zero_frac, rounds, gen_s, reward_s)


def refresh_priors(prior: PriorState, rows: Sequence[dict[str, Any]], g: int, max_prompts: int,
                   sample: Callable[[list[dict[str, Any]]], list[dict[str, Any]]], by_id: dict[str, dict[str, Any]]
                   ) -> list[list[dict[str, Any]]]:
    """The adaptive budget (``collect_step``): the prompts of ``rows`` whose prior their group rejects, at most
    ``max_prompts`` of them, get G fresh samples (``sample(problems)``), whose mean reward replaces the prior.
    Returns those extra groups, their samples numbered G..2G-1 (distinct from the trained group's)."""
    r, valid = reward_matrix(rows, g)
    ids = [rows[k * g]["prompt_id"] for k in range(len(rows) // g)]
    _, accepted = algos.fuse(r, valid, prior.tensor(ids))
    stale = [i for k, i in enumerate(ids) if not accepted[k] and prior.n.get(i, 0.0) > 0][:max_prompts]
    if not stale:
        return []
    extra = sample([by_id[i] for i in stale])
    er, ev = reward_matrix(extra, g)
    out = []
    for j, i in enumerate(stale):
        if ev[j].any():
            prior.p[i], prior.n[i] = float(er[j][ev[j]].mean()), float(ev[j].sum())
        out.append([{**x, "sample": x["sample"] + g} for x in extra[j * g : (j + 1) * g]])
    return out


def reward_matrix(rows: Sequence[dict[str, Any]], g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by prompt (G consecutive) -> rewards [N, G] (0 where unscorable) and valid [N, G]."""
    r = torch.tensor([0.0 if x["reward"] is None else float(x["reward"]) for x in rows]).view(-1, g)
    valid = torch.tensor([x["reward"] is not None for x in rows]).view(-1, g)
    return r, valid


def zero_variance(r: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] True where every valid reward of the group is equal (or fewer than two are valid)."""
    big = torch.finfo(r.dtype).max
    hi = torch.where(valid, r, torch.full_like(r, -big)).max(1).values
    lo = torch.where(valid, r, torch.full_like(r, big)).min(1).values
    return (hi <= lo) | (valid.sum(1) < 2)
