"""One RL step's samples: rollout -> reward, DAPO dynamic sampling and the adaptive prior budget.

The same ``sample_rows`` as the rollout stage and the same ``score_rows`` as the reward stage, so the loop
samples and scores exactly as the standalone stages do. Under torchrun every rank samples and scores its
contiguous share of each round's prompts (whole groups on one rank) and **keeps its own rows**: only three
numbers per sample (reward, correctness, completion length) are all-gathered, as one float64 tensor
(``Dist.gather_tensor``), so every rank holds the step's scalars and takes the same decisions (dynamic sampling,
group advantages, priors) while token ids, sampler log-probs and text stay where they were sampled. The
per-token fields of a row are numpy arrays (int32 ids, float32 log-probs: the rollout schema's types).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from posttrain import algos, distributed, seeds
from posttrain.config import Rl
from posttrain.rewards import RewardPool, is_correct, score_rows
from posttrain.rl.select import PriorState, PromptCursor
from posttrain.rollout import RolloutBackend, SamplingParams, sample_rows

Row = dict[str, Any]
REWARD, CORRECT, LENGTH, TOOL_CALLS = 0, 1, 2, 3  # the columns of StepBatch.stats
NSTATS = 4


@dataclass
class StepBatch:
    """What one step sampled. Groups are numbered in sampling order over the whole job (rounds, then the prior
    budget's extra groups); every rank holds every group's scalars, and the rows of its own groups only.

    ``stats`` [S, G, 4] float64: reward (NaN: unscorable), correct (1 / 0, NaN: unknown), the model's completion
    tokens (a tool's observation tokens left out), tool calls (0 for a single-turn completion).
    ``rows``: this rank's rows by group number. ``segments``: the groups of each sampling call, [start, end)
    (rank r holds a contiguous block of each, in rank order). ``used``: the groups that enter the update, in
    order. ``first``: the number of groups of the first round (the step's on-policy sample of the prompt set).
    """

    g: int
    prompt_ids: list[str] = field(default_factory=list)  # [S]
    stats: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 1, NSTATS, dtype=torch.float64))
    rows: dict[int, list[Row]] = field(default_factory=dict)
    segments: list[tuple[int, int]] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    first: int = 0
    zero_var_frac: float = 0.0  # share of zero-variance groups in the first round
    rounds: int = 0  # refill rounds beyond the first
    gen_s: float = 0.0
    reward_s: float = 0.0

    def add(self, prompt_ids: Sequence[str], local_rows: list[Row], shift: int = 0) -> range:
        """Append one sampling call's groups: ``prompt_ids`` (every rank's, in order) and this rank's scored rows
        (its ``Dist.shard`` of the prompts, G each, ``sample`` numbers shifted by ``shift``); gathers the
        scalars. Returns the new groups' numbers."""
        d, g = distributed.current(), self.g
        local = [_compact(r, shift) for r in local_rows]
        mine = torch.tensor([[math.nan if r["reward"] is None else float(r["reward"]), _correct(r),
                              float(_model_tokens(r)), float(r.get("tool_calls") or 0)] for r in local],
                            dtype=torch.float64).view(-1, NSTATS)
        stats = d.gather_tensor(mine).view(-1, g, NSTATS)
        if stats.shape[0] != len(prompt_ids):
            raise RuntimeError(f"{stats.shape[0]} groups gathered for {len(prompt_ids)} prompts")
        start = len(self.prompt_ids)
        lo = start + d.rank * len(prompt_ids) // d.world  # this rank's first group (Dist.shard's block)
        self.prompt_ids += list(prompt_ids)
        self.stats = torch.cat([self.stats.view(-1, g, NSTATS), stats])
        for j in range(len(local) // g):
            self.rows[lo + j] = local[j * g : (j + 1) * g]
        self.segments.append((start, len(self.prompt_ids)))
        return range(start, len(self.prompt_ids))

    def reward_matrix(self, groups: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards [N, G] float32 (0 where unscorable) and valid [N, G] of ``groups``."""
        r = self.stats[list(groups), :, REWARD]
        return torch.nan_to_num(r, nan=0.0).float(), ~torch.isnan(r)

    def lengths(self, groups: Sequence[int]) -> torch.Tensor:
        """Completion tokens [N, G] (int64) of ``groups``."""
        return self.stats[list(groups), :, LENGTH].long()

    def first_round(self) -> torch.Tensor:
        """[first * G, NSTATS] scalars of the first round's samples, in order."""
        return self.stats[: self.first].reshape(-1, NSTATS)

    @classmethod
    def from_rows(cls, rows: Sequence[Row], g: int) -> StepBatch:
        """Every group of ``rows`` (G consecutive per prompt, e.g. a persisted shard read by every rank) used,
        this rank keeping its ``Dist.shard`` of the groups: an update replayed from disk."""
        d = distributed.current()
        groups = [list(rows[i : i + g]) for i in range(0, len(rows), g)]
        sb = cls(g)
        sb.add([grp[0]["prompt_id"] for grp in groups], [r for grp in d.shard(groups) for r in grp])
        sb.used, sb.first = list(range(len(groups))), len(groups)
        return sb


def _compact(row: Row, shift: int) -> Row:
    """The row with its per-token fields as numpy arrays (and ``sample`` shifted)."""
    out = {**row, "token_ids": np.asarray(row["token_ids"], dtype=np.int32),
           "logprobs": np.asarray(row["logprobs"], dtype=np.float32), "sample": row["sample"] + shift}
    if row.get("loss_mask") is not None:  # a multi-turn tool rollout: 0 on observation tokens
        out["loss_mask"] = np.asarray(row["loss_mask"], dtype=np.int8)
    return out


def _model_tokens(row: Row) -> int:
    """The tokens the model generated: of a multi-turn tool rollout, not its observations (``model_tokens``)."""
    return row["model_tokens"] if row.get("model_tokens") is not None else len(row["token_ids"])


def _correct(row: Row) -> float:
    c = is_correct(row["rewards"]) if row.get("rewards") is not None else None
    return math.nan if c is None else float(c)


def policy_name(policy0: str, version: int) -> str:
    """The rows' ``policy`` and a vLLM engine's weight version for the weights after ``version`` updates of the
    policy whose folder digest is ``policy0``: one spelling for the synchronous loop and the overlap generators
    (k = 0 writes the same shards only while they agree)."""
    return f"{policy0}@step{version}"


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
    (count: their number), so the fused baseline rests on fresh evidence. They are recorded (numbered
    G..2G-1) but not trained on. Seeded ``seeds.prior_round``. ``pool``: where rewards are scored (None: in this
    thread).
    """
    d = distributed.current()
    g, b, sp = cfg.samples_per_prompt, cfg.prompts_per_step, cfg.sampling
    sb = StepBatch(g)
    used: list[int] = []
    budget = cfg.prior_budget if prior is not None else 0

    def sample(batch: Sequence[dict[str, Any]], round_seed: int, shift: int = 0) -> range:
        rows, secs = sample_rows(backend, tokenizer, d.shard(batch), g,
                                 SamplingParams(sp.temperature, sp.top_p, sp.max_new_tokens,
                                                seeds.rank(round_seed, d.rank)),
                                 policy=policy, chunk_prompts=max(1, cfg.generate_batch_size // g))
        sb.gen_s += secs
        t = time.time()
        out = sb.add([p["id"] for p in batch], score_rows(rows, reward_specs, pool), shift)
        sb.reward_s += time.time() - t
        return out

    while True:
        batch = [prompts[i] for i in cursor.take(b - len(used))]
        seg = sample(batch, seeds.refill_round(seed, sb.rounds))
        r, valid = sb.reward_matrix(seg)
        zv = zero_variance(r, valid).tolist()
        if sb.rounds == 0:
            sb.zero_var_frac, sb.first = sum(zv) / len(zv), len(seg)
        used += [k for k, z in zip(seg, zv, strict=True) if cfg.dynamic_sampling == "off" or not z]
        if budget >= g:  # after the round's groups: the first groups stay the first round
            s_prior, by_id = seeds.prior_round(seed, sb.rounds), {p["id"]: p for p in batch}
            stale = refresh_priors(prior, [p["id"] for p in batch], r, valid, budget // g,
                                   lambda ids, s=s_prior, p=by_id: sb.reward_matrix(sample([p[i] for i in ids], s, g)))
            budget -= g * len(stale)
        if cfg.dynamic_sampling != "refill" or len(used) >= b or sb.rounds >= cfg.max_refill_rounds:
            break
        sb.rounds += 1
    sb.used = used[:b]
    return sb


def refresh_priors(prior: PriorState, ids: Sequence[str], r: torch.Tensor, valid: torch.Tensor, max_prompts: int,
                   sample: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """The adaptive budget (``collect_step``): the prompts ``ids`` whose prior their group (rewards ``r``,
    ``valid`` [N, G]) rejects, at most ``max_prompts`` of them, get G fresh samples (``sample(ids)`` -> their
    rewards and valid [n, G]), whose mean reward replaces the prior. Returns the refreshed prompts."""
    _, accepted = algos.fuse(r, valid, prior.tensor(ids))
    stale = [i for k, i in enumerate(ids) if not accepted[k] and prior.get(i)[1] > 0][:max_prompts]
    if not stale:
        return []
    er, ev = sample(stale)
    for j, i in enumerate(stale):
        if ev[j].any():
            prior.p[i], prior.n[i] = float(er[j][ev[j]].mean()), float(ev[j].sum())
    return stale


def zero_variance(r: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] True where every valid reward of the group is equal (or fewer than two are valid)."""
    big = torch.finfo(r.dtype).max
    hi = torch.where(valid, r, torch.full_like(r, -big)).max(1).values
    lo = torch.where(valid, r, torch.full_like(r, big)).min(1).values
    return (hi <= lo) | (valid.sum(1) < 2)
