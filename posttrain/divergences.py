"""DIVERGENCES: per-token divergences between a student's and a teacher's next-token distributions, the
distill stage's losses (``posttrain.distillation``), picked by ``distill.on_policy.divergence``.

One signature: ``fn(s_logp [..., V], t_logp [..., V], beta) -> [...]``, both arguments log-softmaxed over the
vocabulary V (the distill update calls it on [chunk, V] rows). Papers: Hinton et al. 2015 (KD, forward KL);
Agarwal et al. 2024 (GKD: on-policy, generalized JSD); Lu et al. 2025 (on-policy distillation, reverse KL).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Per-token divergences between student and teacher next-token distributions (one signature):
# fn(s_logp [B, T, V], t_logp [B, T, V], beta) -> [B, T], both arguments log-softmaxed over V.


def forward_kl(s_logp: torch.Tensor, t_logp: torch.Tensor, beta: float = 0.0) -> torch.Tensor:
    """KL(teacher || student) = sum_v p_T (log p_T - log p_S): mode-covering (classic KD, Hinton et al.)."""
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def reverse_kl(s_logp: torch.Tensor, t_logp: torch.Tensor, beta: float = 0.0) -> torch.Tensor:
    """KL(student || teacher) = sum_v p_S (log p_S - log p_T): mode-seeking; on student samples this is
    on-policy distillation (Agarwal et al. 2024, GKD; Lu et al. 2025, on-policy distillation)."""
    return (s_logp.exp() * (s_logp - t_logp)).sum(-1)


def generalized_jsd(s_logp: torch.Tensor, t_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """GKD's generalized JSD (Agarwal et al. 2024), with TRL's convention for beta:
    beta * KL(T || M) + (1 - beta) * KL(S || M), M = beta * T + (1 - beta) * S;
    beta = 0 is forward KL and beta = 1 reverse KL exactly (the formula itself tends to 0 at both ends)."""
    if beta <= 0.0:
        return forward_kl(s_logp, t_logp)
    if beta >= 1.0:
        return reverse_kl(s_logp, t_logp)
    m_logp = torch.logsumexp(torch.stack([t_logp + torch.log(torch.tensor(beta)),
                                          s_logp + torch.log(torch.tensor(1.0 - beta))]), dim=0)
    kl_t = (t_logp.exp() * (t_logp - m_logp)).sum(-1)
    kl_s = (s_logp.exp() * (s_logp - m_logp)).sum(-1)
    return beta * kl_t + (1.0 - beta) * kl_s


DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": generalized_jsd,
}
