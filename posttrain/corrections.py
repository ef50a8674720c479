"""Off-policy corrections: the CORRECTIONS registry, for samples drawn by a policy (the sampler, or behaviour
policy) other than the one the trainer scores. Today that is the sampler/trainer mismatch of one policy (vLLM's
kernels, bf16 against the trainer's); once generation runs ahead of training, staleness as well.

One signature, one call site (``posttrain.rl.update.policy_update``)::

    fn(old_logp [B, T], sampler_logp [B, T], mask [B, T], **kwargs) -> Correction(weights, capped, masked)

``old_logp``: the trainer's log-probs of the tokens under the policy that sampled them; ``sampler_logp``: the
sampler's own. ``weights`` [B, T] are detached, 0 wherever ``mask`` is 0 or the correction drops the token, and
multiply the policy-gradient term only (not the KL or entropy terms). ``capped`` / ``masked`` [B, T] (bool, False
at padding) say which tokens a cap truncated and which a band dropped: the update logs their shares
(``tis_capped``, ``is_masked``). With ``r_t = pi_trainer(y_t) / pi_sampler(y_t) = exp(old_t - sampler_t)``:

- ``tis_token``: ``w_t = min(r_t, cap)``; ``tis_sequence``: ``w = min(prod_t r_t, cap)`` for every token of a
  sequence (truncated IS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training"; verl's and OpenRLHF's TIS).
- ``mis_token``: ``w_t = 1[low <= r_t <= high]``; ``mis_sequence``: ``w = 1[low <= (prod_t r_t)^(1/|y|) <= high]``
  for every token of a sequence (masked IS as rejection: tokens, or whole sequences by their geometric-mean
  ratio, outside the band get no gradient, the rest are left unweighted; Liu, Li, Yao et al. 2025, "When Speed
  Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch": token and geometric-level
  rejection sampling, verl's ``rollout_rs``). The geometric mean is length-invariant: the product ratio of a
  long sequence leaves any fixed band on a per-token gap of 1e-3, the geometric mean does not.
- ``icepop``: ``w_t = r_t * 1[low <= r_t <= high]`` (double-sided token masking that keeps the IS weight inside
  the band; IcePop, Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
  Thinking Model" (Ring-1T), alpha = low = 0.5, beta = high = 5).

``decoupled_ppo_loss`` (AReaL's objective, not a registry entry and not wired into the loop: it needs a proximal
policy distinct from the behaviour policy, which exists only once generation runs ahead of training) is here as a
pure, tested function for that loop.

Written by hand: each is a few tensor operations on the trainer's own tensors (verl's and TRL's versions live
inside their trainers). Log-ratios are clamped before the exp as everywhere in ``posttrain.algos``; the band's
bounds (config: 1e-6 <= low <= 1 <= high <= 1e6) lie inside the clamp's exp(+-20), so the clamp never flips a
band decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from posttrain.algos import LOG_RATIO_CLAMP, LossCfg, ppo_clip


class Correction(NamedTuple):
    """What one correction gives the update: per-token weights and which tokens were capped or masked."""

    weights: torch.Tensor  # [B, T] float, detached; 0 at padding and at masked tokens
    capped: torch.Tensor  # [B, T] bool: tokens whose weight a cap truncated (False at padding)
    masked: torch.Tensor  # [B, T] bool: tokens a band dropped (weight 0; False at padding)


def _log_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    return (old_logp - sampler_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _seq_log_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t (old - sampler) over each sequence's tokens [B, 1]."""
    return ((old_logp - sampler_logp).detach() * mask).sum(-1, keepdim=True)


def _none(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(mask, dtype=torch.bool)


def tis_token(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
              cap: float = 2.0) -> Correction:
    """Truncated importance sampling, per token: w_t = min(pi_trainer(y_t) / pi_sampler(y_t), cap). [B, T]

    The sampler (vLLM: other kernels, bf16) and the trainer disagree slightly on the same tokens, so the
    samples are a little off-policy for the trainer; weighting each token's policy-gradient term by w_t
    corrects toward the trainer's own distribution, truncated at ``cap`` to bound the variance (Yao et al.
    2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's and OpenRLHF's TIS)."""
    w = torch.exp(_log_ratio(old_logp, sampler_logp)).clamp(max=cap) * mask
    return Correction(w, (w >= cap) & (mask > 0), _none(mask))


def tis_sequence(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                 cap: float = 2.0) -> Correction:
    """Truncated importance sampling, per sequence: every token of a sequence gets
    w = min(prod_t pi_trainer(y_t) / pi_sampler(y_t), cap) = min(exp(sum_t (old - sampler)), cap). [B, T]
    (the sequence-level ratio: unbiased for sequence-level objectives, higher variance than per token)."""
    s = _seq_log_ratio(old_logp, sampler_logp, mask)
    w = torch.exp(s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap).expand_as(old_logp) * mask
    return Correction(w, (w >= cap) & (mask > 0), _none(mask))


def _band(log_r: torch.Tensor, low: float, high: float) -> torch.Tensor:
    r = torch.exp(log_r)
    return (r >= low) & (r <= high)


def mis_token(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
              low: float = 0.5, high: float = 2.0) -> Correction:
    """Masked importance sampling per token (token-level rejection): w_t = 1 if low <= r_t <= high else 0,
    r_t = pi_trainer(y_t) / pi_sampler(y_t). Tokens the two policies disagree on too much get no policy
    gradient; the others are not reweighted (Liu, Li, Yao et al. 2025, "When Speed Kills Stability"; verl's
    token rejection sampling). [B, T]"""
    keep = _band(_log_ratio(old_logp, sampler_logp), low, high)
    on = mask > 0
    return Correction(keep.to(mask.dtype) * mask, _none(mask), ~keep & on)


def mis_sequence(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                 low: float = 0.5, high: float = 2.0) -> Correction:
    """Masked importance sampling per sequence by the geometric-mean ratio (geometric-level rejection):
    rho = exp(mean_t (old_t - sampler_t)) = (prod_t r_t)^(1/|y|); every token of a sequence gets w = 1 if
    low <= rho <= high, else 0 (Liu, Li, Yao et al. 2025, "When Speed Kills Stability": Geo-RS; length-invariant,
    where the product ratio of a long sequence leaves any band on tiny per-token gaps). [B, T]"""
    n = mask.sum(-1, keepdim=True).clamp_min(1)
    mean_log_r = (_seq_log_ratio(old_logp, sampler_logp, mask) / n).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    keep = _band(mean_log_r, low, high).expand_as(old_logp)
    on = mask > 0
    return Correction(keep.to(mask.dtype) * mask, _none(mask), ~keep & on)


def icepop(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
           low: float = 0.5, high: float = 5.0) -> Correction:
    """IcePop (Ling Team 2025, Ring-1T, "Every Step Evolves"): double-sided token masking with the IS weight
    kept inside the band, w_t = r_t if low <= r_t <= high else 0 (the paper's alpha = 0.5, beta = 5). [B, T]"""
    log_r = _log_ratio(old_logp, sampler_logp)
    keep = _band(log_r, low, high)
    on = mask > 0
    return Correction(torch.exp(log_r) * keep * mask, _none(mask), ~keep & on)


CORRECTIONS: dict[str, Callable[..., Correction]] = {
    "tis_token": tis_token, "tis_sequence": tis_sequence, "mis_token": mis_token, "mis_sequence": mis_sequence,
    "icepop": icepop,
}


def decoupled_ppo_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor, adv: torch.Tensor,
                       mask: torch.Tensor, cfg: LossCfg, cap: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
    Language Reasoning", eq. 5): the clip is taken against the proximal policy, the importance weight against
    the behaviour policy that sampled::

        loss_t = w_t * max(-A u_t, -A clip(u_t, 1 - eps_low, 1 + eps_high)),
        u_t = pi_theta(y_t) / pi_prox(y_t),   w_t = pi_prox(y_t) / pi_behav(y_t)  (detached)

    ``logp`` [B, T] (with gradient), ``prox_logp`` (the proximal policy: the trainer's weights before this
    update), ``behav_logp`` (the policy that generated, possibly several versions older), ``adv`` [B] (one
    per sequence), ``mask`` [B, T]; ``cfg``: the clip (and dual clip) of ``algos.ppo_clip``. With ``cap`` a
    token whose w_t exceeds it is dropped (w_t = 0; AReaL's ``behav_imp_weight_cap``). With prox = behav (the
    synchronous loop) this is ``ppo_clip``. Returns (loss [B, T], 0 at padding; clipped [B, T] bool). Not
    wired into the loop (see the module docstring)."""
    loss, clipped = ppo_clip(logp, prox_logp, adv, cfg)
    w = torch.exp(_log_ratio(prox_logp, behav_logp))
    if cap is not None:
        w = torch.where(w <= cap, w, torch.zeros_like(w))
    w = w * mask
    return loss * w, clipped & (mask > 0)
