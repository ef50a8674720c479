"""Advantage estimators, policy losses, aggregation and KL on tiny tensors, values computed by hand."""

import math

import pytest
import torch

from posttrain import algos
from posttrain.algos import ADVANTAGES, LossCfg, aggregate, ppo_clip

R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
ALL = torch.ones_like(R, dtype=torch.bool)


def test_grpo():
    # group 1: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 2: zero variance -> 0 advantage
    adv = ADVANTAGES["grpo"](R, ALL)
    torch.testing.assert_close(adv, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025], [0.0] * 4]),
                               atol=1e-5, rtol=0)


def test_dr_grpo():
    adv = ADVANTAGES["dr_grpo"](R, ALL)  # r - mean, no std
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4]))


def test_rloo():
    # for r=1: 1 - (0 + 0 + 1) / 3 = 2/3; for r=0: 0 - (1 + 0 + 1) / 3 = -2/3
    adv = ADVANTAGES["rloo"](R, ALL)
    torch.testing.assert_close(adv, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4]))


def test_reinforce_pp():
    # batch mean 6/8 = 0.75; unbiased var = (6 * 0.25^2 + 2 * 0.75^2) / 7 = 1.5 / 7; std = 0.462910
    # r=1: 0.25 / 0.462910 = 0.540062; r=0: -0.75 / 0.462910 = -1.620185
    adv = ADVANTAGES["reinforce_pp"](R, ALL)
    a, b = 0.540062, -1.620185
    torch.testing.assert_close(adv, torch.tensor([[a, b, b, a], [a, a, a, a]]), atol=1e-5, rtol=0)


def test_grpo_batch_std():
    # group-centred (+-0.5, then 0) divided by the batch std 0.462910 -> +-1.080123
    adv = ADVANTAGES["grpo_batch_std"](R, ALL)
    torch.testing.assert_close(adv, torch.tensor([[1.080123, -1.080123, -1.080123, 1.080123], [0.0] * 4]),
                               atol=1e-5, rtol=0)


def test_unscorable_samples_are_excluded_and_get_zero():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    valid = torch.tensor([[True, True, False, True]])
    # valid rewards 1, 0, 1: mean 2/3; deviations 1/3, -2/3, 1/3; unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3
    adv = ADVANTAGES["grpo"](r, valid)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([[(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("ratio,adv,expected,clipped", [
    (1.5, 1.0, -1.28, True),  # pg1 = -1.5, pg2 = -1.28 (clip-higher 0.28): max = -1.28
    (1.5, -1.0, 1.5, False),  # pg1 = 1.5, pg2 = 1.28: max = 1.5
    (0.5, 1.0, -0.5, False),  # pg1 = -0.5, pg2 = -0.8: max = -0.5
    (0.5, -1.0, 0.8, True),  # pg1 = 0.5, pg2 = 0.8: max = 0.8
    (1.0, 2.0, -2.0, False),
])
def test_ppo_clip_asymmetric(ratio, adv, expected, clipped):
    cfg = LossCfg(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, c = ppo_clip(torch.tensor([[math.log(ratio)]]), torch.zeros(1, 1), torch.tensor([adv]), cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert bool(c.item()) is clipped


def test_dual_clip_caps_negative_advantage_loss():
    cfg = LossCfg(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0)
    # ratio 4, adv -1: pg1 = 4, pg2 = 1.2, max = 4, capped at -adv * c = 3
    loss, c = ppo_clip(torch.tensor([[math.log(4.0)]]), torch.zeros(1, 1), torch.tensor([-1.0]), cfg)
    assert loss.item() == pytest.approx(3.0) and bool(c.item())
    loss, _ = ppo_clip(torch.tensor([[math.log(4.0)]]), torch.zeros(1, 1), torch.tensor([1.0]), cfg)
    assert loss.item() == pytest.approx(-1.2)  # positive advantage: dual-clip does not apply


def test_aggregation_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(x, m, "token-mean", 2, 4, 4).item() == pytest.approx(10 / 4)  # (1+2+3+4) / 4 tokens
    assert aggregate(x, m, "seq-mean-token-mean", 2, 4, 4).item() == pytest.approx(3.0)  # (2 + 4) / 2
    assert aggregate(x, m, "seq-mean-token-sum-norm", 2, 4, 4).item() == pytest.approx(10 / 8)  # 10 / (2 * 4)
    with pytest.raises(ValueError, match="known"):
        aggregate(x, m, "nope", 2, 4, 4)


@pytest.mark.parametrize("mode", algos.AGGREGATIONS)
def test_loss_invariant_to_micro_batch_split(mode):
    """1 x 8 and 8 x 1 give the same loss and the same gradient."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(8, 6, generator=g) * 0.1 - 1
    old = logp + torch.randn(8, 6, generator=g) * 0.05
    adv = torch.randn(8, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.3).long()
    mask[:, 0] = 1
    n_seq, n_tok = 8, int(mask.sum())
    cfg = LossCfg(0.2, 0.28)

    def loss_of(idx, p):
        loss, _ = ppo_clip(p[idx], old[idx], adv[idx], cfg)
        return aggregate(loss, mask[idx], mode, n_seq, n_tok, 6)

    p1 = logp.clone().requires_grad_()
    full = loss_of(slice(None), p1)
    full.backward()
    p8 = logp.clone().requires_grad_()
    total = sum(loss_of(slice(i, i + 1), p8) for i in range(8))
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(p8.grad, p1.grad)


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert algos.kl_k1(logp, ref).item() == pytest.approx(math.log(2))  # log 0.5 - log 0.25
    # k3: d = ref - logp = -log 2; exp(d) - d - 1 = 0.5 + 0.693147 - 1
    assert algos.kl_k3(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    assert algos.kl_k3(logp, logp).item() == 0.0


def test_entropy_of_uniform_logits():
    assert algos.entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))


# student [0.5, 0.5], teacher [0.25, 0.75] at one position
S = torch.log(torch.tensor([[[0.5, 0.5]]]))
T = torch.log(torch.tensor([[[0.25, 0.75]]]))


def test_forward_and_reverse_kl_hand_values():
    # KL(T||S) = 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099
    assert algos.forward_kl(S, T).item() == pytest.approx(0.130812, abs=1e-6)
    # KL(S||T) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.346574 - 0.202733
    assert algos.reverse_kl(S, T).item() == pytest.approx(0.143841, abs=1e-6)


def test_generalized_jsd_hand_values():
    # beta 0.5: M = [0.375, 0.625]; KL(T||M) = 0.035375, KL(S||M) = 0.032269; JSD = (0.035375 + 0.032269) / 2
    assert algos.generalized_jsd(S, T, 0.5).item() == pytest.approx(0.033822, abs=1e-6)
    assert algos.generalized_jsd(S, T, 0.0).item() == pytest.approx(algos.forward_kl(S, T).item())
    assert algos.generalized_jsd(S, T, 1.0).item() == pytest.approx(algos.reverse_kl(S, T).item())


@pytest.mark.parametrize("name", sorted(algos.DIVERGENCES))
def test_identical_student_and_teacher_give_zero_loss_and_gradient(name):
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    s = logits.clone().requires_grad_()
    loss = algos.DIVERGENCES[name](torch.log_softmax(s, -1), torch.log_softmax(logits, -1), 0.5).sum()
    loss.backward()
    assert abs(loss.item()) < 1e-6
    assert s.grad.abs().max().item() < 1e-6
