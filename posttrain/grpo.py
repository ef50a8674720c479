"""The GRPO-family policy update and the pieces of the online loop (rollout -> reward -> update).

Everything a step needs besides rollout (``posttrain.rollout.sample_rows``) and scoring
(``posttrain.rewards.score_rows``), both shared with the standalone stages:

- ``PromptCursor``: prompts in seeded per-epoch permutations; its position is part of the checkpoint.
- ``group_advantages``: rewards [N, G] -> advantages through the ADVANTAGES registry; unscorable samples
  get no advantage and no loss.
- ``zero_variance``: DAPO dynamic sampling's test (all rewards of a group equal -> no signal).
- ``policy_update``: epochs x minibatches of optimizer steps over one rollout batch, micro-batched (exact
  gradient accumulation via ``algos.aggregate``), PPO-style ratios against old log-probs (recomputed by the
  trainer when the update is not exactly on-policy), optional KL to a frozen reference and entropy bonus.
  Returns the step's metrics (clip fraction, KL, entropy, sampler-vs-trainer log-prob gap, ...).

Under torchrun (``posttrain.distributed``) every rank samples and scores its contiguous share of each round's
prompts (whole groups on one rank) and the rows are gathered, so every rank holds the whole step (dynamic
sampling and group advantages are computed on all of it, identically); the update's minibatches are global and
each rank runs its share of every minibatch, normalised by the global counts, gradients all-reduced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from posttrain import algos, distributed
from posttrain.config import Rl
from posttrain.logprobs import token_logp_entropy
from posttrain.modeling import adapter_off
from posttrain.rewards import score_rows
from posttrain.rollout import RolloutBackend, SamplingParams, sample_rows


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


def reset_reference(ref: torch.nn.Module, policy: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """ProRL (Liu et al. 2025): a hard reset of the KL anchor to the current policy, ref <- policy (a full,
    unwrapped model), so the KL penalty restarts from 0 and stops pulling toward a policy long left behind;
    with ``opt`` the optimizer's state (Adam moments, step counts) is cleared too."""
    with torch.no_grad():
        ref.load_state_dict(policy.state_dict())
    if opt is not None:
        opt.state.clear()


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
                 cfg: Rl, reward_specs: Sequence[Any], seed: int, policy: str, prior: PriorState | None = None
                 ) -> StepBatch:
    """Rollout -> reward for one step, with DAPO dynamic sampling (``cfg.dynamic_sampling``).

    ``off`` keeps every group; ``skip`` drops zero-variance groups (no signal under a group baseline);
    ``refill`` samples further prompts until ``prompts_per_step`` groups with signal are found or
    ``max_refill_rounds`` extra rounds are spent. Round ``k`` is seeded ``seed + 17 * k`` (+ 1,000,033 x rank).

    With ``prior`` and ``cfg.prior_budget`` > 0 (the adaptive rollout budget of V0.5 / Reinforce-Ada): a
    prompt whose prior the group rejects (``algos.fuse``'s test) gets G more samples from the same policy, in
    order, until the step's budget of extra samples is spent; their mean reward replaces the stale prior
    (count: their number), so the fused baseline rests on fresh evidence. They are recorded (in ``sampled``)
    but not trained on. Seeded ``seed + 17 * k + 5`` for round ``k``.
    """
    d = distributed.current()
    g, b, sp = cfg.group_size, cfg.prompts_per_step, cfg.sampling
    groups: list[list[dict[str, Any]]] = []
    sampled: list[list[dict[str, Any]]] = []
    gen_s = reward_s = zero_frac = 0.0
    rounds, budget = 0, cfg.prior_budget if prior is not None else 0

    def sample(batch: Sequence[dict[str, Any]], round_seed: int) -> list[dict[str, Any]]:
        nonlocal gen_s, reward_s
        rows, secs = sample_rows(backend, tokenizer, d.shard(batch), g,
                                 SamplingParams(sp.temperature, sp.top_p, sp.max_new_tokens,
                                                round_seed + 1_000_033 * d.rank),
                                 policy=policy, chunk_prompts=max(1, cfg.generate_batch_size // g))
        gen_s += secs
        t = time.time()
        rows = d.gather_shards(score_rows(rows, reward_specs))
        reward_s += time.time() - t
        return rows

    while True:
        batch = [prompts[i] for i in cursor.take(b - len(groups))]
        rows = sample(batch, seed + 17 * rounds)
        zv = zero_variance(*reward_matrix(rows, g)).tolist()
        if rounds == 0:
            zero_frac = sum(zv) / len(zv)
        for i, z in enumerate(zv):
            sampled.append(rows[i * g : (i + 1) * g])
            if cfg.dynamic_sampling == "off" or not z:
                groups.append(sampled[-1])
        if budget >= g:  # after the round's groups: sampled[: B * G] stays the first round
            extra = refresh_priors(prior, rows, g, budget // g,
                                   lambda bt, s=seed + 17 * rounds + 5: sample(bt, s), {p["id"]: p for p in batch})
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


def group_advantages(rows: Sequence[dict[str, Any]], g: int, name: str, prior: PriorState | None = None
                     ) -> list[float]:
    """Advantages of ``rows`` (G consecutive per prompt) by ``algos.ADVANTAGES[name]``; with ``prior`` its
    per-prompt (p, n) is passed in, then updated with these groups."""
    r, valid = reward_matrix(rows, g)
    ids = [rows[k * g]["prompt_id"] for k in range(len(rows) // g)]
    adv = algos.ADVANTAGES[name](r, valid, None if prior is None else prior.tensor(ids)).flatten().tolist()
    if prior is not None:
        prior.update(ids, r, valid)
    return adv


@dataclass
class Seq:
    """One training sequence: chat-formatted prompt ids, the sampled completion, and per-completion-token
    log-probs of the sampler, and (filled in by ``policy_update``) of the trainer's old policy and the reference."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logp: list[float]
    adv: float
    old_logp: list[float] | None = None
    ref_logp: list[float] | None = None
    entropy: list[float] | None = None  # per token, under the policy that sampled (token selection)
    pg_mask: list[float] | None = None  # 1 where the token carries the policy gradient (None: every token)


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit decreasing bin packing: the indices of ``lengths`` in each row, each row's total <= ``width``
    (a sequence longer than ``width`` gets a row of its own)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((k for k, f in enumerate(free) if f >= lengths[i]), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(max(width, lengths[i]))
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def batch_tensors(seqs: Sequence[Seq], pad_id: int, device: torch.device, pack: bool = False
                  ) -> dict[str, torch.Tensor]:
    """Per-sequence tensors aligned with next-token targets [B, T-1]: completion mask and every per-token
    log-prob; advantages [B]; and the model input.

    ``pack`` False: the input is the right-padded ids and attention mask [B, T]. ``pack`` True: the sequences
    are packed (``pack_rows``) into rows of W = twice the longest, with position ids restarting at 0 per
    sequence and no attention mask, which transformers turns into a block-diagonal causal mask (each
    sequence attends only to itself); ``gather`` [B, T-1] maps each (sequence, position) to its flat index
    in the packed [R, W-1] predictions. On SFT-policy samples of the default task (lengths 19-74) the
    packed input is 94% real tokens against 74% for length-sorted padded micro-batches of 64
    (``benchmarks/update.py``).
    """
    lens = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    width, b = max(lens), len(seqs)
    aligned = {k: torch.zeros((b, width - 1)) for k in ("mask", "sampler_logp", "old_logp", "ref_logp", "pg_mask")}
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        span = slice(p - 1, p - 1 + c)  # target t+1 is a completion token
        aligned["mask"][i, span] = 1
        aligned["pg_mask"][i, span] = 1 if s.pg_mask is None else torch.tensor(s.pg_mask)
        for k in ("sampler_logp", "old_logp", "ref_logp"):
            v = getattr(s, k)
            if v is not None:
                aligned[k][i, span] = torch.tensor(v)
    out = {"adv": torch.tensor([s.adv for s in seqs]), **aligned}
    if pack:
        w = 2 * width
        rows = pack_rows(lens, w)
        ids = torch.full((len(rows), w), pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), w), dtype=torch.long)
        gather = torch.zeros((b, width - 1), dtype=torch.long)
        for r, members in enumerate(rows):
            off = 0
            for i in members:
                s, n = seqs[i], lens[i]
                ids[r, off : off + n] = torch.tensor(s.prompt_ids + s.completion_ids)
                pos[r, off : off + n] = torch.arange(n)
                gather[i, : n - 1] = r * (w - 1) + off + torch.arange(n - 1)
                off += n
            # the tail after the last sequence restarts at 0 too: its own block, never gathered
            pos[r, off:] = torch.arange(w - off)
        out |= {"ids": ids, "pos": pos, "gather": gather}
    else:
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lens[i]] = torch.tensor(s.prompt_ids + s.completion_ids)
            attn[i, : lens[i]] = 1
        out |= {"ids": ids, "attn": attn}
    return {k: v.to(device) for k, v in out.items()}


@torch.no_grad()
def _fill(model: torch.nn.Module, seqs: Sequence[Seq], attr: str, pad_id: int, micro: int, pack: bool,
          temperature: float, with_entropy: bool = False) -> None:
    """Set ``seq.<attr>`` to ``model``'s log-probs of each completion token (no grad), and with
    ``with_entropy`` ``seq.entropy`` to its per-token entropies. ``model`` is a plain (unwrapped) model;
    under torchrun each rank scores its share and the values are gathered."""
    device = next(model.parameters()).device
    d = distributed.current()
    mine = d.shard(seqs)
    attrs = [attr, "entropy"] if with_entropy else [attr]
    for start in range(0, len(mine), micro):
        chunk = mine[start : start + micro]
        lp, ent = token_logp_entropy(model, batch_tensors(chunk, pad_id, device, pack), temperature,
                                     entropy="detached" if with_entropy else "off")
        for j, s in enumerate(chunk):
            span = slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.completion_ids))
            for a, x in zip(attrs, (lp, ent), strict=False):
                setattr(s, a, x[j, span].tolist())
    if d.active:
        for a in attrs:
            for s, v in zip(seqs, d.gather_shards([getattr(s, a) for s in mine]), strict=True):
                setattr(s, a, v)


def select_tokens(seqs: Sequence[Seq], name: str, rho: float) -> float:
    """Set each sequence's ``pg_mask`` by ``algos.TOKEN_SELECTIONS[name]`` over every completion token of the
    batch (its ``entropy`` filled); returns the share of tokens kept."""
    flat = torch.tensor([e for s in seqs for e in s.entropy])
    keep = algos.TOKEN_SELECTIONS[name](flat, rho).float().tolist()
    at = 0
    for s in seqs:
        s.pg_mask, at = keep[at : at + len(s.completion_ids)], at + len(s.completion_ids)
    return sum(keep) / max(len(keep), 1)


def kl_shaped_rewards(rewards: Sequence[float], sampler_logp: Sequence[Sequence[float]],
                      ref_logp: Sequence[Sequence[float]], coef: float) -> list[float]:
    """KL in the reward (RLOO, Ahmadian et al. 2024; REINFORCE++, Hu 2025): r - coef * sum_t k1_t with
    k1_t = sampler logp_t - ref logp_t of each sampled token (a constant for the gradient: it enters through
    the advantage). Sequence level: REINFORCE++'s per-token returns give the first token exactly this; later
    tokens there also drop the KL of their prefix, which is not modelled here."""
    return [r - coef * (sum(s) - sum(q)) for r, s, q in zip(rewards, sampler_logp, ref_logp, strict=True)]


def policy_update(model: torch.nn.Module, opt: torch.optim.Optimizer, seqs: Sequence[Seq], cfg: Rl, pad_id: int,
                  ref_model: torch.nn.Module | None = None, seed: int = 0) -> dict[str, float]:
    """Optimise the policy on one rollout batch; returns averaged metrics. See module docstring.

    Every forward scores logits / ``cfg.sampling.temperature``. ``ref_model`` is used for the KL loss
    (``cfg.kl_coef`` > 0); reference log-probs already on the sequences are not recomputed. A LoRA (peft)
    ``ref_model`` scores with its adapter disabled: passing the LoRA policy itself makes its frozen base the
    reference.

    ``model`` is the training handle (``distributed.Dist.wrap``; the model itself in one process): every rank
    runs the same number of micro-batches per minibatch (zero-weight repeats where it has fewer)."""
    d = distributed.current()
    device = next(model.parameters()).device
    temp = cfg.sampling.temperature
    loss_fn = algos.POLICY_LOSSES[cfg.policy_loss]
    loss_cfg = algos.LossCfg(cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
    kl_fn = algos.KL_ESTIMATORS[cfg.kl_estimator]
    tis_fn = algos.TIS[cfg.tis.mode] if cfg.tis is not None else None
    use_kl = ref_model is not None and cfg.kl_coef > 0
    norm_len = cfg.sampling.max_new_tokens
    on_policy = cfg.epochs * cfg.minibatches == 1  # then old log-probs come from the update's own forward
    selecting = cfg.token_select != "all"  # token selection needs the sampling policy's entropies first
    if not on_policy or selecting:
        _fill(d.plain(model), seqs, "old_logp", pad_id, cfg.micro_batch_size, cfg.pack, temp, with_entropy=selecting)
    pg_tokens = select_tokens(seqs, cfg.token_select, cfg.token_rho) if selecting else 1.0
    if use_kl and any(s.ref_logp is None for s in seqs):
        with adapter_off(ref_model):
            _fill(ref_model, seqs, "ref_logp", pad_id, cfg.micro_batch_size, cfg.pack, temp)

    sums = {"loss": 0.0, "clipfrac": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0, "gap": 0.0, "tis_capped": 0.0}
    ratio_max, tokens, gap_tokens, n_opt = 0.0, 0.0, 0.0, 0
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(seqs), generator=gen).tolist() if not on_policy else list(range(len(seqs)))
        for mb in np.array_split(np.asarray(order, dtype=int), cfg.minibatches):
            mb_seqs = [seqs[i] for i in mb.tolist()]
            if not mb_seqs:
                continue
            n_tok = sum(len(s.completion_ids) for s in mb_seqs)
            if not cfg.pack:  # similar lengths share a micro-batch (less padding); exact: aggregate() is order-free
                mb_seqs.sort(key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
            opt.zero_grad(set_to_none=True)
            mine = d.shard(mb_seqs)
            chunks = [mine[i : i + cfg.micro_batch_size] for i in range(0, len(mine), cfg.micro_batch_size)]
            n_micro = d.micro_count(len(chunks))
            for k in range(n_micro):
                real = k < len(chunks)  # else a zero-weight repeat, so that every rank's collectives line up
                t = batch_tensors(chunks[k] if real else (chunks or [mb_seqs[:1]])[0], pad_id, device, cfg.pack)
                m = t["mask"] if real else torch.zeros_like(t["mask"])
                with d.grad_sync(model, k == n_micro - 1):
                    logp, ent = distributed.forward(model, token_logp_entropy, t, temp,
                                                    "grad" if cfg.entropy_coef else "detached")
                    old_logp = logp.detach() if on_policy else t["old_logp"]
                    loss_tok, clipped = loss_fn(logp, old_logp, t["adv"], loss_cfg)  # [b, T-1]
                    loss_tok = loss_tok * t["pg_mask"]  # token selection (1 everywhere with token_select: all)
                    if tis_fn is not None:  # the policy-gradient term only, not the KL or entropy terms
                        w = tis_fn(old_logp, t["sampler_logp"], m, cfg.tis.cap)
                        loss_tok = loss_tok * w
                        sums["tis_capped"] += float(((w >= cfg.tis.cap) & (m > 0)).sum())
                    if use_kl:
                        kl = kl_fn(logp, t["ref_logp"])
                        loss_tok = loss_tok + cfg.kl_coef * kl
                        sums["kl"] += float((kl.detach() * m).sum())
                    if cfg.entropy_coef:
                        loss_tok = loss_tok - cfg.entropy_coef * ent
                    loss = algos.aggregate(loss_tok, m, cfg.loss_agg, len(mb_seqs), n_tok, norm_len)
                    (loss * d.loss_scale).backward()
                    sums["loss"] += float(loss.detach())
                    sums["clipfrac"] += float((clipped.float() * m).sum())
                    sums["entropy"] += float((ent.detach() * m).sum())
                    log_ratio = (logp.detach() - old_logp).clamp(-algos.LOG_RATIO_CLAMP, algos.LOG_RATIO_CLAMP)
                    ratio_max = max(ratio_max, float((torch.exp(log_ratio) * m).max()))
                    tokens += float(m.sum())
                    if epoch == 0:  # sampler vs trainer log-prob of the same tokens, before any update
                        sums["gap"] += float(((old_logp - t["sampler_logp"]).abs() * m).sum())
                        gap_tokens += float(m.sum())
            sums["grad_norm"] += d.clip_grad_norm(model, cfg.max_grad_norm)
            opt.step()
            n_opt += 1
    keys = ("loss", "clipfrac", "kl", "entropy", "gap", "tis_capped")  # every rank's share -> the batch's totals
    *totals, tokens, gap_tokens = d.sum(*(sums[k] for k in keys), tokens, gap_tokens)
    sums |= dict(zip(keys, totals, strict=True))
    ratio_max = d.max(ratio_max)
    tokens, n = max(tokens, 1.0), max(n_opt, 1)
    return {"loss": sums["loss"] / n, "clipfrac": sums["clipfrac"] / tokens, "kl": sums["kl"] / tokens,
            "entropy": sums["entropy"] / tokens, "ratio_max": ratio_max, "grad_norm": sums["grad_norm"] / n,
            "logprob_gap": sums["gap"] / max(gap_tokens, 1.0), "tis_capped": sums["tis_capped"] / tokens,
            "pg_tokens": pg_tokens, "optimizer_steps": n_opt}


def update_from_groups(model: torch.nn.Module, opt: torch.optim.Optimizer, groups: Sequence[Sequence[dict[str, Any]]],
                       cfg: Rl, prompt_ids: dict[str, list[int]], pad_id: int,
                       ref_model: torch.nn.Module | None = None, seed: int = 0, prior: PriorState | None = None
                       ) -> tuple[dict[str, float], dict[tuple[str, int], float]]:
    """Advantages over ``groups`` (``cfg.advantage``; ``prior``: per-prompt priors, read and updated), then
    ``policy_update`` on the scorable samples.

    With ``cfg.kl_reward_coef`` > 0 the rewards are first shaped by the KL to ``ref_model``
    (:func:`kl_shaped_rewards`). Returns the update's metrics ({} when nothing was scorable) and each
    sample's advantage keyed by (prompt_id, sample). Unscorable samples get an advantage of 0 and never
    enter the loss.
    """
    rows = [r for grp in groups for r in grp]
    if not rows:
        return {}, {}
    scorable = [r for r in rows if r["reward"] is not None]
    seqs = [Seq(prompt_ids[r["prompt_id"]], list(r["token_ids"]), list(r["logprobs"]), 0.0) for r in scorable]
    kl_reward = None
    if cfg.kl_reward_coef > 0 and seqs:
        if ref_model is None:
            raise ValueError("rl.kl_reward_coef > 0 needs the reference model")
        with adapter_off(ref_model):
            _fill(ref_model, seqs, "ref_logp", pad_id, cfg.micro_batch_size, cfg.pack, cfg.sampling.temperature)
        shaped = kl_shaped_rewards([r["reward"] for r in scorable], [s.sampler_logp for s in seqs],
                                   [s.ref_logp for s in seqs], cfg.kl_reward_coef)
        new = {(r["prompt_id"], r["sample"]): v for r, v in zip(scorable, shaped, strict=True)}
        rows = [{**r, "reward": new.get((r["prompt_id"], r["sample"]))} for r in rows]
        kl_reward = float(np.mean([sum(s.sampler_logp) - sum(s.ref_logp) for s in seqs]))
    adv = group_advantages(rows, cfg.group_size, cfg.advantage, prior)
    advs = {(r["prompt_id"], r["sample"]): a for r, a in zip(rows, adv, strict=True)}
    for s, r in zip(seqs, scorable, strict=True):
        s.adv = advs[(r["prompt_id"], r["sample"])]
    if not seqs:
        return {}, advs
    metrics = policy_update(model, opt, seqs, cfg, pad_id, ref_model, seed=seed)
    if kl_reward is not None:
        metrics["kl_seq"] = kl_reward  # mean per-sequence k1 sum that entered the rewards
    return metrics, advs
