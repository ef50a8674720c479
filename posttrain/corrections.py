"""TIS: corrections of samples drawn by a policy other than the one the trainer scores (one signature:
``fn(old_logp [B, T], sampler_logp [B, T], mask [B, T], cap) -> weights [B, T]``, detached), applied to the
policy-gradient term only. Today: the sampler/trainer mismatch of one policy (vLLM's kernels, bf16); the home of
off-policy corrections to come.

Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's and OpenRLHF's
TIS. Log-ratios are clamped before the exp as everywhere in ``posttrain.algos``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.algos import LOG_RATIO_CLAMP


def tis_token(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling, per token: w_t = min(pi_trainer(y_t) / pi_sampler(y_t), cap). [B, T]

    The sampler (vLLM: other kernels, bf16) and the trainer disagree slightly on the same tokens, so the
    samples are a little off-policy for the trainer; weighting each token's policy-gradient term by w_t
    corrects toward the trainer's own distribution, truncated at ``cap`` to bound the variance (Yao et al.
    2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's and OpenRLHF's TIS).
    ``old_logp``: the trainer's log-probs of the policy that sampled; 0 where ``mask`` is 0."""
    w = torch.exp((old_logp - sampler_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
    return (w * mask).detach()


def tis_sequence(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling, per sequence: every token of a sequence gets
    w = min(prod_t pi_trainer(y_t) / pi_sampler(y_t), cap) = min(exp(sum_t (old - sampler)), cap). [B, T]
    (the sequence-level ratio: unbiased for sequence-level objectives, higher variance than per token)."""
    s = ((old_logp - sampler_logp) * mask).sum(-1, keepdim=True)
    w = torch.exp(s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
    return (w.expand_as(old_logp) * mask).detach()


TIS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "token": tis_token, "sequence": tis_sequence,
}
