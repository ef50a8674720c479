"""ADVANTAGES, POLICY_LOSSES, TOKEN_SELECTIONS and KL_ESTIMATORS registries, and loss aggregation (off-policy
corrections: ``posttrain.corrections``).

Names follow the papers: ``logp`` (current policy), ``old_logp`` (behaviour policy), ``ref_logp`` (frozen
reference), ``ratio = exp(logp - old_logp)``, ``adv``, ``mask`` (1 on completion tokens). Shapes in
comments: N prompts, G samples per prompt, B = N*G sequences, T completion tokens.

Advantages (one signature): ``fn(r [N, G], valid [N, G], prior [N, 2] | None, lengths [N, G] | None) -> adv
[N, G]``; invalid (unscorable) entries get 0 and are excluded from every statistic; ``prior`` (a per-prompt prior
mean reward and its pseudo-count) is used by ``prior_fused`` only, ``lengths`` (completion tokens per sample) by
``reinforce_pp`` only. Std is the unbiased sample std (as in TRL and verl).
Policy losses (one signature): ``fn(logp, old_logp, adv, cfg) -> (loss [B, T], clipped [B, T] bool)``.
Token selections (one signature): ``fn(entropy [n], rho) -> keep [n]``: which tokens the policy gradient uses.
Aggregation is separate from the loss, and exact under micro-batching: each micro-batch divides by
full-batch totals, so summing micro-batch losses gives the full-batch loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

EPS = 1e-6
# Log-ratios are clamped before any exp (as verl does): padded positions carry arbitrary log-probs, and an
# exp that overflows to inf becomes NaN once the mask multiplies it (inf * 0), poisoning loss and gradient.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _masked_mean(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1)


def _masked_std(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std over masked entries (0 when fewer than 2)."""
    mean = _masked_mean(x, m, dim)
    mean = mean.unsqueeze(dim) if dim is not None else mean
    n = m.sum(dim)
    var = (((x - mean) ** 2) * m).sum(dim) / (n - 1).clamp_min(1)
    return torch.where(n > 1, var.sqrt(), torch.zeros_like(var))


def _all_equal(r: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """True where every valid reward (of a group: ``dim=1`` -> [N, 1]; of the batch: ``dim=None`` -> scalar) is
    the same value. Such a group carries no signal, and its float mean is not exactly its value (eight rewards
    of 0.1 sum to 0.8000001 in fp32), so its advantages are set to exactly 0 rather than left as residue."""
    big = torch.finfo(r.dtype).max
    hi = torch.where(m > 0, r, torch.full_like(r, -big))
    lo = torch.where(m > 0, r, torch.full_like(r, big))
    if dim is None:
        return hi.max() <= lo.min()
    return (hi.amax(dim) <= lo.amin(dim)).unsqueeze(dim)


def grpo(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
         lengths: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): (r - group mean) / (group std + eps). r, valid: [N, G]. A group whose
    rewards are all equal gets exactly 0 (``_all_equal``)."""
    m = valid.float()
    mean = _masked_mean(r, m, 1).unsqueeze(1)  # [N, 1]
    std = _masked_std(r, m, 1).unsqueeze(1)  # [N, 1]
    adv = (r - mean) / (std + EPS) * m
    return torch.where(_all_equal(r, m, 1), torch.zeros_like(adv), adv)


def dr_grpo(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
            lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): r - group mean, no std division.
    Pair with ``seq-mean-token-sum-norm`` aggregation (no length normalisation). Equal groups: exactly 0."""
    m = valid.float()
    adv = (r - _masked_mean(r, m, 1).unsqueeze(1)) * m
    return torch.where(_all_equal(r, m, 1), torch.zeros_like(adv), adv)


def rloo(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
         lengths: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i - mean of the other valid samples of the group. Equal groups: exactly 0."""
    m = valid.float()
    n = m.sum(1, keepdim=True)  # [N, 1]
    others = ((r * m).sum(1, keepdim=True) - r * m) / (n - 1).clamp_min(1)
    adv = torch.where(n > 1, r - others, torch.zeros_like(r)) * m
    return torch.where(_all_equal(r, m, 1), torch.zeros_like(adv), adv)


def reinforce_pp(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): no per-prompt baseline; the batch's mean and std normalise the rewards over
    *tokens*, as the paper's Eq. 10 and verl do (every token carries its sequence's reward, so a sequence counts
    by its ``lengths``; without lengths, each sequence once). E.g. r = [1, 0], lengths [3, 1]: token mean
    (3 + 0) / 4 = 0.75, unbiased token variance (3 * 0.25^2 + 0.75^2) / 3 = 0.25, so adv = [0.5, -1.5] (over
    sequences it would be [0.707, -0.707]). A batch of equal rewards: 0."""
    m = valid.float() * (lengths.float() if lengths is not None else 1.0)
    adv = (r - _masked_mean(r, m)) / (_masked_std(r, m) + EPS) * valid.float()
    return torch.where(_all_equal(r, m), torch.zeros_like(adv), adv)


def grpo_batch_std(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Lite PPO (Liu et al. 2025, "Tricks or traps"): group-mean baseline, batch-level std. Equal groups: 0."""
    m = valid.float()
    centered = (r - _masked_mean(r, m, 1).unsqueeze(1)) * m
    adv = centered / (_masked_std(r, m) + EPS)
    return torch.where(_all_equal(r, m, 1), torch.zeros_like(adv), adv)


# "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning" (Zhu et al. 2025): the RLVR
# gradient split into positive- and negative-sample reinforcement, no baseline. Rewards are read as
# correctness in [0, 1] (1 correct, 0 wrong; values between interpolate linearly).
W_REINFORCE_LAMBDA = 0.1  # the paper's recommended weight of the positive samples


def psr(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None) -> torch.Tensor:
    """PSR only: +1 for a correct sample, 0 for a wrong one (reinforce successes only). r, valid: [N, G]."""
    return r * valid.float()


def nsr(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None) -> torch.Tensor:
    """NSR only: -1 for a wrong sample, 0 for a correct one (push down failures; the freed probability mass
    goes where the model's prior puts it)."""
    return (r - 1) * valid.float()


def w_reinforce(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
    """W-REINFORCE: rewards {+lambda, -1} = lambda * PSR + NSR, lambda = ``W_REINFORCE_LAMBDA`` (0.1)."""
    return (W_REINFORCE_LAMBDA * r + (r - 1)) * valid.float()


# A prior-fused group baseline (V0.5, "Generalist Value Model as a Prior for Sparse RL Rollouts", 2025): with few
# rollouts per prompt (G = 4) the group mean is a noisy baseline; a prior of the prompt's mean reward is fused
# with it when a test says the two agree. V0.5's prior is a generalist value model; ours is the pipeline's own
# measurement of the prompt: the reward stage's mean reward of the SFT policy over its G samples, then
# updated after every step (rl.select.PriorState). The test and the update rule are ours (the paper's abstract
# names neither): a two-proportion z-test, evidence that ages by half per step.
PRIOR_Z = 1.96  # |z| above this: the prior disagrees with the group (rejected), the group mean alone is used


def fuse(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused baseline b [N] and whether the prior was accepted [N]. r, valid: [N, G]; prior: [N, 2] = (p0,
    n0), the prior mean reward and its pseudo-count (0: no prior).

    Group mean m over its g valid samples; pooled = (n0 p0 + g m) / (n0 + g); the prior is accepted when
    n0 > 0 and |m - p0| / sqrt(pooled (1 - pooled) (1/g + 1/n0)) <= PRIOR_Z (a two-proportion z-test);
    then b = pooled (precision-weighted), else b = m. E.g. r = [1, 0, 0, 0], (p0, n0) = (0.5, 8): m = 0.25,
    pooled = 5/12 = 0.4167, z = 0.25 / sqrt(0.4167 * 0.5833 * 0.375) = 0.83: accepted, b = 0.4167."""
    m = valid.float()
    g = m.sum(1)
    mean = _masked_mean(r, m, 1)
    p0, n0 = prior[:, 0], prior[:, 1]
    pooled = (n0 * p0 + g * mean) / (n0 + g).clamp_min(EPS)
    var = pooled * (1 - pooled) * (1 / g.clamp_min(1) + 1 / n0.clamp_min(EPS))
    z = (mean - p0).abs() / var.clamp_min(1e-12).sqrt()
    accepted = (n0 > 0) & (g > 0) & (z <= PRIOR_Z)
    return torch.where(accepted, pooled, mean), accepted


def prior_fused(r: torch.Tensor, valid: torch.Tensor, prior: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
    """A = r - b with b the prior-fused baseline of ``fuse`` (no std division: with G = 4 the group std is as
    noisy as the mean). Without a prior (None, or n0 = 0) b is the group mean: Dr. GRPO. A group whose rewards
    are all equal still gets a signal when the prior differs from them: r = [0, 0, 0, 0] with (0.2, 8) gives
    b = 1.6 / 12 = 0.133 (z = 0.96, accepted) and A = -0.133 for each sample. r, valid: [N, G]; prior [N, 2]."""
    if prior is None:
        prior = torch.zeros((r.shape[0], 2), dtype=r.dtype)
    b, _ = fuse(r, valid, prior)
    return (r - b.unsqueeze(1)) * valid.float()


ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp, "grpo_batch_std": grpo_batch_std,
    "psr": psr, "nsr": nsr, "w_reinforce": w_reinforce, "prior_fused": prior_fused,
}


# ------------------------------------------------------------------------------------ token selection
# Which completion tokens carry the policy-gradient term (one signature): fn(entropy [n], rho) -> keep [n] bool,
# over the n completion tokens of one step's batch (flattened), entropies under the policy that sampled.
# The KL and entropy terms still apply to every token, and the loss is still normalised over every token.


def all_tokens(entropy: torch.Tensor, rho: float) -> torch.Tensor:
    """Every token (plain policy gradient)."""
    return torch.ones_like(entropy, dtype=torch.bool)


def top_entropy(entropy: torch.Tensor, rho: float) -> torch.Tensor:
    """The ceil(rho * n) highest-entropy tokens of the batch ("Beyond the 80/20 Rule", Wang et al. 2025: the
    "forking" tokens; rho = 0.2 in the paper). Ties go to the earlier token (a stable sort): deterministic."""
    k = math.ceil(rho * entropy.numel())
    keep = torch.zeros_like(entropy, dtype=torch.bool)
    keep[torch.argsort(entropy, descending=True, stable=True)[:k]] = True
    return keep


def bottom_entropy(entropy: torch.Tensor, rho: float) -> torch.Tensor:
    """The complement of ``top_entropy``: the lowest-entropy (1 - rho) share (the paper's control arm, the
    bottom 80%)."""
    return ~top_entropy(entropy, rho)


TOKEN_SELECTIONS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "all": all_tokens, "top_entropy": top_entropy, "bottom_entropy": bottom_entropy,
}


@dataclass(frozen=True)
class LossCfg:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO clip-higher: > clip_eps_low
    dual_clip: float | None = None  # Ye et al. 2020 dual-clip constant c > 1 (applies when adv < 0)


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, cfg: LossCfg
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate (Schulman et al. 2017) with asymmetric clip (DAPO) and optional dual-clip.

    logp, old_logp: [B, T]; adv: [B] (one advantage per sequence, broadcast over tokens).
    loss = max(-adv * ratio, -adv * clip(ratio, 1 - eps_low, 1 + eps_high)); with dual-clip and adv < 0 the
    loss is further capped at -adv * c.
    """
    a = adv.unsqueeze(-1)  # [B, 1]
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if cfg.dual_clip is not None:
        pg3 = -a * cfg.dual_clip
        capped = (a < 0) & (loss > pg3)
        loss = torch.where(a < 0, torch.minimum(loss, pg3), loss)
        clipped = clipped | capped
    return loss, clipped


def vanilla_pg(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, cfg: LossCfg
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclipped importance-weighted policy gradient: -adv * ratio. [B, T]"""
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return -adv.unsqueeze(-1) * ratio, torch.zeros_like(ratio, dtype=torch.bool)


# Each loss is the advantage times a function of the ratio: 0, with a 0 gradient, where adv is 0. The update
# relies on it to skip zero-advantage sequences (rl.update.policy_update; tests/test_algos.py checks each entry).
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "ppo_clip": ppo_clip, "vanilla_pg": vanilla_pg,
}

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str, n_seqs: int, n_tokens: int, norm_len: int
              ) -> torch.Tensor:
    """Reduce a per-token quantity [B, T] of one micro-batch to its share of the full-batch scalar.

    ``n_seqs`` / ``n_tokens``: totals over the *full* batch (all micro-batches), so that summing the
    micro-batch results equals aggregating the full batch at once.
    - token-mean: sum over all tokens / total tokens (DAPO).
    - seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO).
    - seq-mean-token-sum-norm: sum over all tokens / (sequences * norm_len) (Dr. GRPO; constant norm).
    """
    m = mask.to(x.dtype)
    if mode == "token-mean":
        return (x * m).sum() / max(n_tokens, 1)
    if mode == "seq-mean-token-mean":
        return ((x * m).sum(-1) / m.sum(-1).clamp_min(1)).sum() / max(n_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return (x * m).sum() / (max(n_seqs, 1) * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {AGGREGATIONS}")


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 1/2 (logp - ref_logp)^2 (Schulman 2020, "Approximating KL"). [B, T]

    As a loss its gradient is (logp - ref_logp) * d logp, whose on-policy expectation
    E_pi[(log pi - log ref) d log pi] is exactly the gradient of the reverse KL(pi || ref): the KL penalty
    the RLHF objective asks for. The log-ratio is clamped to +-20 (padded positions: no inf); verl does not clamp
    its k2, so the two differ only where |logp - ref_logp| > 20."""
    d = (logp - ref_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return 0.5 * d * d


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 >= 0 (Schulman 2020; GRPO's choice, DeepSeekMath). [B, T]

    An unbiased, low-variance *value* estimate of KL(pi || ref). As a loss, though, its gradient is
    (1 - ref/pi) * d logp, whose on-policy expectation E_pi[(1 - ref/pi) d log pi] = -sum ref d log pi is the
    gradient of the *forward* KL(ref || pi), not of KL(pi || ref) (use k2 for the
    reverse-KL gradient). The log-ratio is clamped to +-20 and k3 to 10, as in verl."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1).clamp(max=K3_CLAMP)


# Per-token KL *loss* terms. KL-in-reward (REINFORCE++ / RLOO style, ``rl.kl_reward_coef``) uses k1 = logp - ref
# of the sampled tokens, detached, in ``rl.update.kl_shaped_rewards``; k1 as a loss has zero expected gradient.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k2": kl_k2, "k3": kl_k3}
