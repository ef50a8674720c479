"""The GRPO-family policy update on one step's groups.

- ``update_from_groups``: rewards (optionally KL-shaped, RLOO / REINFORCE++) -> advantages through the
  ADVANTAGES registry (unscorable samples get no advantage and no loss) -> ``policy_update``.
- ``policy_update``: epochs x minibatches of optimizer steps, each one ``training.accumulate`` over the
  minibatch's sequences (exact gradient accumulation via ``algos.aggregate``); PPO-style ratios against old
  log-probs (recomputed by the trainer when the update is not exactly on-policy), optional token selection,
  an off-policy correction of the policy-gradient term (``corrections.CORRECTIONS``: one call site), KL to a
  frozen reference and entropy bonus. Returns the step's metrics (clip fraction, KL, entropy, sampler-vs-trainer
  log-prob gap, capped and masked token shares, ...).
- ``reset_reference``: ProRL's reference resets.

Under torchrun the minibatches are global; each rank runs its share of every minibatch, normalised by the
global counts, gradients all-reduced (``training.accumulate``). A rank's share is the samples it drew
(``collect``): it fills their old and reference log-probs itself, and no per-token data crosses ranks
(per-token fields are tensors on ``logprobs.Seq``; entropies and losses enter the metrics as running sums).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from posttrain import algos, corrections, distributed, training
from posttrain.config import Rl
from posttrain.distributed import placement
from posttrain.logprobs import Seq, batch_tensors, fill, filler, token_logp_entropy
from posttrain.modeling import adapter_off
from posttrain.rl.collect import StepBatch
from posttrain.rl.select import PriorState


def group_advantages(r: torch.Tensor, valid: torch.Tensor, ids: Sequence[str], lengths: torch.Tensor | None,
                     name: str, prior: PriorState | None = None) -> torch.Tensor:
    """Advantages [N, G] of groups with rewards ``r`` and ``valid`` [N, G] (prompts ``ids``, completion
    ``lengths``) by ``algos.ADVANTAGES[name]``; with ``prior`` its per-prompt (p, n) is passed in, then updated
    with these groups."""
    adv = algos.ADVANTAGES[name](r, valid, None if prior is None else prior.tensor(ids), lengths)
    if prior is not None:
        prior.update(ids, r, valid)
    return adv


def select_tokens(seqs: Sequence[Seq], name: str, rho: float, start: int = 0) -> float:
    """Set each sequence's ``pg_mask`` by ``algos.TOKEN_SELECTIONS[name]`` over every completion token of the
    batch (its ``entropy`` filled); returns the share of tokens kept. Under torchrun the selection ranks the
    whole batch's tokens: every rank's entropies are all-gathered as one float32 tensor (4 bytes a token, only
    when ``rl.token_select`` is not ``all``) and ``start`` is this rank's first token in it."""
    d = distributed.current()
    local = torch.cat([s.entropy[s.model_tokens()] for s in seqs]) if seqs else torch.zeros(0)
    keep = algos.TOKEN_SELECTIONS[name](d.gather_tensor(local), rho).float()  # [n] over the whole batch
    at = start
    for s in seqs:  # observation tokens (multi-turn tool rollouts) are never ranked, never kept
        where, n = s.model_tokens(), s.n_model_tokens()
        s.pg_mask = torch.zeros(len(s.completion_ids)).index_put((where,), keep[at : at + n]) if n else keep[at:at]
        at += n
    return float(keep.sum()) / max(keep.numel(), 1)


def seq_k1(sampler_logp: torch.Tensor, ref_logp: torch.Tensor) -> float:
    """sum_t (sampler logp_t - ref logp_t) of one sequence, each sum accumulated in float64 in token order."""
    def total(x: torch.Tensor) -> float:
        return float(np.cumsum(x.double().numpy())[-1]) if x.numel() else 0.0
    return total(sampler_logp) - total(ref_logp)


def kl_shaped_rewards(rewards: torch.Tensor, k1: torch.Tensor, coef: float) -> torch.Tensor:
    """KL in the reward (RLOO, Ahmadian et al. 2024; REINFORCE++, Hu 2025): r - coef * sum_t k1_t with
    k1_t = sampler logp_t - ref logp_t of each sampled token (``k1``: the per-sequence sums, ``seq_k1``; a
    constant for the gradient: it enters through the advantage). Sequence level: REINFORCE++'s per-token
    returns give the first token exactly this; later tokens there also drop the KL of their prefix, which is
    not modelled here."""
    return rewards - coef * k1


def policy_update(model: torch.nn.Module, opt: torch.optim.Optimizer, seqs: Sequence[Seq], cfg: Rl, pad_id: int,
                  ref_model: torch.nn.Module | None = None, seed: int = 0) -> dict[str, float]:
    """Optimise the policy on one rollout batch; returns averaged metrics. See module docstring.

    Every forward scores logits / ``cfg.sampling.temperature``. ``ref_model`` is used for the KL loss
    (``cfg.kl_coef`` > 0); reference log-probs already on the sequences are not recomputed. A LoRA (peft)
    ``ref_model`` scores with its adapter disabled: passing the LoRA policy itself makes its frozen base the
    reference.

    Sequences of advantage 0 are not run when the loss is the policy gradient alone (no KL, no entropy
    bonus): they add exactly 0 to it and to its gradient, and their tokens still count in the normaliser of
    ``rl.loss_agg``, so the update is the same (up to float summation order) at a fraction of the work, e.g.
    the groups of one reward when ``rl.dynamic_sampling`` is off. The per-token metrics (clip fraction,
    entropy, ratio max, log-prob gap, capped and masked shares) are then over the sequences that ran.

    ``model`` is the training handle (``distributed.Dist.wrap``; the model itself in one process); each
    minibatch is one ``training.accumulate`` step. ``seqs`` are this rank's sequences (every one in one
    process): the batch is every rank's, in rank order; minibatches are drawn over it and each rank runs
    the members it holds, normalised by the minibatch's global counts (gathered: one length per sequence)."""
    d = distributed.current()
    device = next(model.parameters()).device
    temp = cfg.sampling.temperature
    loss_fn = algos.POLICY_LOSSES[cfg.policy_loss]
    loss_cfg = algos.LossCfg(cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
    kl_fn = algos.KL_ESTIMATORS[cfg.kl_estimator]
    correct = corrections.CORRECTIONS[cfg.correction.name] if cfg.correction is not None else None
    use_kl = ref_model is not None and cfg.kl_coef > 0
    norm_len = cfg.sampling.max_new_tokens
    on_policy = cfg.epochs * cfg.minibatches == 1  # then old log-probs come from the update's own forward
    selecting = cfg.token_select != "all"  # token selection needs the sampling policy's entropies first
    # the batch is every rank's seqs in rank order; each rank needs only their lengths and whether their
    # advantage is 0 (two ints per sequence)
    # (the tokens of a sequence the loss sees: its model tokens; observation tokens of tool rollouts are out)
    lens_local = torch.tensor([[d.rank, s.n_model_tokens(), s.adv != 0] for s in seqs], dtype=torch.int64).view(-1, 3)
    glob = d.gather_tensor(lens_local)
    lens, offset = glob[:, 1], int((glob[:, 0] < d.rank).sum())  # [n] loss tokens; my first sequence
    # a sequence of advantage 0 adds exactly 0 to the loss and its gradient when the loss is only the policy
    # gradient (POLICY_LOSSES are 0 at adv 0; corrections and token selection scale that 0): it is not run,
    # though its tokens still count in the normaliser. Not with a KL or entropy term, which it does feed.
    skip_zero = not use_kl and not cfg.entropy_coef
    nonzero = glob[:, 2].bool()  # [n]
    if not on_policy or selecting:  # each rank scores exactly the sequences it updates
        fill(d.scoring(model), seqs, "old_logp", pad_id, cfg.micro_batch_size, cfg.pack, temp, with_entropy=selecting)
    pg_tokens = select_tokens(seqs, cfg.token_select, cfg.token_rho, int(lens[:offset].sum())) if selecting else 1.0
    need_ref = use_kl and any(s.ref_logp is None for s in seqs)
    if use_kl and placement.sharded(ref_model):  # scoring it is a collective: every rank or none (a rank with
        need_ref = bool(d.max(float(need_ref)))  # no sequence runs fillers; skipping would pair its next one)
    if need_ref:
        with adapter_off(ref_model):
            fill(ref_model, seqs, "ref_logp", pad_id, cfg.micro_batch_size, cfg.pack, temp)

    sums = {"loss": 0.0, "clipfrac": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0, "gap": 0.0, "tis_capped": 0.0,
            "is_masked": 0.0}
    ratio_max, tokens, gap_tokens, n_opt = 0.0, 0.0, 0.0, 0
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(lens), generator=gen).tolist() if not on_policy else list(range(len(lens)))
        for mb in np.array_split(np.asarray(order, dtype=int), cfg.minibatches):
            if not len(mb):
                continue
            mb_seqs = [seqs[i - offset] for i in mb.tolist() if offset <= i < offset + len(seqs)]  # mine
            n_tok, n_mb = int(lens[mb].sum()), len(mb)  # the global minibatch's
            if skip_zero and bool(nonzero[mb].any()):  # all 0: still one step on a zero gradient (AdamW moves)
                mb_seqs = [s for s in mb_seqs if s.adv != 0]
            if not cfg.pack:  # similar lengths share a micro-batch (less padding); exact: aggregate() is order-free
                mb_seqs.sort(key=lambda s: len(s.prompt_ids) + len(s.completion_ids))

            def loss_of(chunk: list[Seq], real: bool, n_seqs: int = n_mb, n_tok: int = n_tok,
                        first_pass: bool = epoch == 0) -> torch.Tensor:
                nonlocal ratio_max, tokens, gap_tokens
                t = batch_tensors(chunk or filler(pad_id), pad_id, device, cfg.pack)
                m = t["mask"]
                logp, ent = distributed.forward(model, token_logp_entropy, t, temp,
                                                "grad" if cfg.entropy_coef else "detached")
                old_logp = logp.detach() if on_policy else t["old_logp"]
                loss_tok, clipped = loss_fn(logp, old_logp, t["adv"], loss_cfg)  # [b, T-1]
                loss_tok = loss_tok * t["pg_mask"]  # token selection (1 everywhere with token_select: all)
                if correct is not None:  # the policy-gradient term only, not the KL or entropy terms
                    c = correct(old_logp, t["logprobs"], m, **cfg.correction.kwargs)
                    loss_tok = loss_tok * c.weights
                    if real:
                        sums["tis_capped"] += float(c.capped.sum())
                        sums["is_masked"] += float(c.masked.sum())
                if use_kl:
                    kl = kl_fn(logp, t["ref_logp"])
                    loss_tok = loss_tok + cfg.kl_coef * kl
                    if real:
                        sums["kl"] += float((kl.detach() * m).sum())
                if cfg.entropy_coef:
                    loss_tok = loss_tok - cfg.entropy_coef * ent
                loss = algos.aggregate(loss_tok, m, cfg.loss_agg, n_seqs, n_tok, norm_len)
                if real:
                    sums["loss"] += float(loss.detach())
                    sums["clipfrac"] += float((clipped.float() * m).sum())
                    sums["entropy"] += float((ent.detach() * m).sum())
                    log_ratio = (logp.detach() - old_logp).clamp(-algos.LOG_RATIO_CLAMP, algos.LOG_RATIO_CLAMP)
                    ratio_max = max(ratio_max, float((torch.exp(log_ratio) * m).max()))
                    tokens += float(m.sum())
                    if first_pass:  # sampler vs trainer log-prob of the same tokens, before any update
                        sums["gap"] += float(((old_logp - t["logprobs"]).abs() * m).sum())
                        gap_tokens += float(m.sum())
                return loss

            micro = training.MicroBatch(cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, training.seq_tokens)
            sums["grad_norm"] += training.accumulate(model, opt, mb_seqs, micro, loss_of, cfg.max_grad_norm,
                                                     local=True)
            n_opt += 1
    keys = ("loss", "clipfrac", "kl", "entropy", "gap", "tis_capped", "is_masked")  # every rank's share -> totals
    *totals, tokens, gap_tokens = d.sum(*(sums[k] for k in keys), tokens, gap_tokens)
    sums |= dict(zip(keys, totals, strict=True))
    ratio_max = d.max(ratio_max)
    tokens, n = max(tokens, 1.0), max(n_opt, 1)
    return {"loss": sums["loss"] / n, "clipfrac": sums["clipfrac"] / tokens, "kl": sums["kl"] / tokens,
            "entropy": sums["entropy"] / tokens, "ratio_max": ratio_max, "grad_norm": sums["grad_norm"] / n,
            "logprob_gap": sums["gap"] / max(gap_tokens, 1.0), "tis_capped": sums["tis_capped"] / tokens,
            "is_masked": sums["is_masked"] / tokens, "pg_tokens": pg_tokens, "optimizer_steps": n_opt}


def update_from_groups(model: torch.nn.Module, opt: torch.optim.Optimizer, sb: StepBatch, cfg: Rl,
                       prompt_ids: dict[str, list[int]], pad_id: int, ref_model: torch.nn.Module | None = None,
                       seed: int = 0, prior: PriorState | None = None) -> tuple[dict[str, float], torch.Tensor]:
    """Advantages over the step's used groups (``sb.used``; ``cfg.advantage``; ``prior``: per-prompt priors,
    read and updated), computed on every rank from the gathered rewards, then ``policy_update`` on the
    scorable samples this rank holds.

    With ``cfg.kl_reward_coef`` > 0 the rewards are first shaped by the KL to ``ref_model``
    (:func:`kl_shaped_rewards`): each rank scores its own samples, and one number per sample is gathered.
    Returns the update's metrics ({} when nothing was scorable) and the advantages [len(sb.used), G].
    Unscorable samples get an advantage of 0 and never enter the loss.
    """
    d = distributed.current()
    g = sb.g
    if not sb.used:
        return {}, torch.zeros(0, g)
    r, valid = sb.reward_matrix(sb.used)  # [N, G]
    mine = [(k, j, row) for k, i in enumerate(sb.used) for j, row in enumerate(sb.rows.get(i, []))
            if row["reward"] is not None]  # this rank's scorable samples: (group position, sample, row)
    seqs = [Seq(prompt_ids[row["prompt_id"]], row["token_ids"], row["logprobs"], 0.0, loss_mask=row.get("loss_mask"))
            for _, _, row in mine]
    kl_reward = None
    if cfg.kl_reward_coef > 0 and bool(valid.any()):
        if ref_model is None:
            raise ValueError("rl.kl_reward_coef > 0 needs the reference model")
        with adapter_off(ref_model):
            fill(ref_model, seqs, "ref_logp", pad_id, cfg.micro_batch_size, cfg.pack, cfg.sampling.temperature)
        k1 = d.gather_tensor(torch.tensor([[k, j, seq_k1(s.logprobs, s.ref_logp)] for (k, j, _), s
                                           in zip(mine, seqs, strict=True)], dtype=torch.float64).view(-1, 3))
        k1 = k1[np.lexsort((k1[:, 1].numpy(), k1[:, 0].numpy()))]  # in (group, sample) order on every rank
        at = (k1[:, 0].long(), k1[:, 1].long())
        r64 = sb.stats[sb.used, :, 0].clone()
        r64[at] = kl_shaped_rewards(r64[at], k1[:, 2], cfg.kl_reward_coef)
        r = torch.nan_to_num(r64, nan=0.0).float()
        kl_reward = float(np.mean(k1[:, 2].numpy()))
    adv = group_advantages(r, valid, [sb.prompt_ids[i] for i in sb.used], sb.lengths(sb.used), cfg.advantage, prior)
    for s, (k, j, _) in zip(seqs, mine, strict=True):
        s.adv = float(adv[k, j])
    if not bool(valid.any()):
        return {}, adv
    metrics = policy_update(model, opt, seqs, cfg, pad_id, ref_model, seed=seed)
    if kl_reward is not None:
        metrics["kl_seq"] = kl_reward  # mean per-sequence k1 sum that entered the rewards
    return metrics, adv


def reset_reference(ref: torch.nn.Module, policy: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """ProRL (Liu et al. 2025): a hard reset of the KL anchor to the current policy, ref <- policy (as held for
    scoring, ``Dist.scoring``: an FSDP2 reference and policy are sharded alike, each rank copies its shards), so
    the KL penalty restarts from 0 and stops pulling toward a policy long left behind;
    with ``opt`` the optimizer's state (Adam moments, step counts) is cleared too."""
    with torch.no_grad():
        ref.load_state_dict(policy.state_dict())
    if opt is not None:
        opt.state.clear()
