"""Advantage estimators, policy losses, aggregation and KL on tiny tensors, values computed by hand."""

import math

import pytest
import torch

from posttrain import algos, divergences
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


@pytest.mark.parametrize("name", sorted(algos.POLICY_LOSSES))
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_every_policy_loss_is_zero_with_zero_gradient_at_zero_advantage(name, dual_clip):
    """The contract rl.update relies on to skip zero-advantage sequences: at adv 0 the loss is 0 and its
    gradient too, at any ratio (here exp(+-2), exp(+-0.1), 1: inside and outside the clip range)."""
    logp = torch.tensor([[2.0, -2.0, 0.1, -0.1, 0.0]], requires_grad=True)
    loss, _ = algos.POLICY_LOSSES[name](logp, torch.zeros(1, 5), torch.zeros(1), LossCfg(0.2, 0.28, dual_clip))
    loss.sum().backward()
    assert loss.detach().abs().max().item() == 0.0 and logp.grad.abs().max().item() == 0.0


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
    # k2: 0.5 * (log 0.5 - log 0.25)^2 = 0.5 * (ln 2)^2
    assert algos.kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    # k3: d = ref - logp = -log 2; exp(d) - d - 1 = 0.5 + 0.693147 - 1
    assert algos.kl_k3(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    assert algos.kl_k3(logp, logp).item() == 0.0
    assert "k1" not in algos.KL_ESTIMATORS  # as a loss its expected gradient is 0: noise only


def test_kl_gradients_two_tokens():
    """d/d logp of each estimator, two tokens, by hand:
    token 1: logp = ln 0.5, ref = ln 0.25; token 2: logp = ln 0.25, ref = ln 0.5.
    k3 = exp(ref - logp) - (ref - logp) - 1 -> d/dlogp = 1 - exp(ref - logp): 1 - 0.5 = 0.5; 1 - 2 = -1.
    k2 = (logp - ref)^2 / 2 -> d/dlogp = logp - ref: ln 2 = 0.693147; -ln 2."""
    ref = torch.log(torch.tensor([0.25, 0.5]))
    for name, expected in (("k3", [0.5, -1.0]), ("k2", [math.log(2), -math.log(2)])):
        logp = torch.log(torch.tensor([0.5, 0.25])).requires_grad_()
        algos.KL_ESTIMATORS[name](logp, ref).sum().backward()
        torch.testing.assert_close(logp.grad, torch.tensor(expected), atol=1e-6, rtol=0)


def test_kl_expected_gradients_on_policy():
    """Over a 2-token vocabulary pi = softmax(theta), the exact on-policy expectation of each estimator's
    gradient, sum_y pi(y) * d k(log pi(y), log ref(y)) / d theta, equals the gradient of a true KL:
    k2 -> KL(pi || ref) (reverse KL), k3 -> KL(ref || pi). By hand at theta = (0, 0) (pi = [0.5, 0.5]),
    ref = [0.25, 0.75]: d KL(pi||ref)/d theta_0 = pi_0 (log(pi_0/ref_0) - KL(pi||ref))
    = 0.5 (ln 2 - 0.143841) = 0.274653; d KL(ref||pi)/d theta_0 = pi_0 - ref_0 = 0.25."""
    ref = torch.log(torch.tensor([0.25, 0.75]))
    for name, expected in (("k2", 0.274653), ("k3", 0.25)):
        theta = torch.zeros(2, requires_grad=True)
        logpi = torch.log_softmax(theta, -1)
        k = algos.KL_ESTIMATORS[name](logpi, ref)  # [2]: the estimator at each possible sample
        grads = [torch.autograd.grad(k[y], theta, retain_graph=True)[0] for y in range(2)]
        expect = sum(logpi[y].exp().detach() * grads[y] for y in range(2))
        torch.testing.assert_close(expect, torch.tensor([expected, -expected]), atol=1e-6, rtol=0)
    # and k1 = logp - ref, as a loss, has zero expected gradient: sum_y pi(y) d log pi(y) = d sum_y pi(y) = 0
    theta = torch.zeros(2, requires_grad=True)
    logpi = torch.log_softmax(theta, -1)
    g = sum(logpi[y].exp().detach() * torch.autograd.grad(logpi[y], theta, retain_graph=True)[0] for y in range(2))
    assert g.abs().max().item() < 1e-7


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_extreme_logprob_at_a_padded_position_stays_finite(estimator):
    """ref_logp is 0 at padded positions; a -100 log-prob there (exp(100) overflows fp32) must give a finite
    loss and finite gradients after masking, for the policy loss and the KL."""
    logp = torch.tensor([[-0.5, -100.0]], requires_grad=True)
    old = torch.tensor([[-0.5, 0.0]])
    ref = torch.tensor([[-0.7, 0.0]])
    mask = torch.tensor([[1, 0]])
    pg, _ = ppo_clip(logp, old, torch.tensor([1.0]), LossCfg(0.2, 0.28))
    loss_tok = pg + 0.1 * algos.KL_ESTIMATORS[estimator](logp, ref)
    loss = aggregate(loss_tok, mask, "token-mean", 1, 1, 2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1].item() == 0.0  # nothing flows from the padded position
    # the same with the extreme value in the old log-prob (ratio exp(+100))
    logp2 = torch.tensor([[-0.5, 0.0]], requires_grad=True)
    pg2, _ = ppo_clip(logp2, torch.tensor([[-0.5, -100.0]]), torch.tensor([-1.0]), LossCfg(0.2, 0.28))
    loss2 = aggregate(pg2, mask, "token-mean", 1, 1, 2)
    loss2.backward()
    assert torch.isfinite(loss2) and torch.isfinite(logp2.grad).all()


# student [0.5, 0.5], teacher [0.25, 0.75] at one position
S = torch.log(torch.tensor([[[0.5, 0.5]]]))
T = torch.log(torch.tensor([[[0.25, 0.75]]]))


def test_forward_and_reverse_kl_hand_values():
    # KL(T||S) = 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099
    assert divergences.forward_kl(S, T).item() == pytest.approx(0.130812, abs=1e-6)
    # KL(S||T) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.346574 - 0.202733
    assert divergences.reverse_kl(S, T).item() == pytest.approx(0.143841, abs=1e-6)


def test_generalized_jsd_hand_values():
    # beta 0.5: M = [0.375, 0.625]; KL(T||M) = 0.035375, KL(S||M) = 0.032269; JSD = (0.035375 + 0.032269) / 2
    assert divergences.generalized_jsd(S, T, 0.5).item() == pytest.approx(0.033822, abs=1e-6)
    assert divergences.generalized_jsd(S, T, 0.0).item() == pytest.approx(divergences.forward_kl(S, T).item())
    assert divergences.generalized_jsd(S, T, 1.0).item() == pytest.approx(divergences.reverse_kl(S, T).item())


@pytest.mark.parametrize("name", sorted(divergences.DIVERGENCES))
def test_identical_student_and_teacher_give_zero_loss_and_gradient(name):
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    s = logits.clone().requires_grad_()
    loss = divergences.DIVERGENCES[name](torch.log_softmax(s, -1), torch.log_softmax(logits, -1), 0.5).sum()
    loss.backward()
    assert abs(loss.item()) < 1e-6
    assert s.grad.abs().max().item() < 1e-6


def test_positive_negative_sample_reinforcement_by_hand():
    """Zhu et al. 2025: rewards [1, 0, 1, 0(unscorable)] of one group.
    PSR:  [+1, 0, +1, 0]; NSR: [0, -1, 0, 0]; W-REINFORCE (lambda 0.1): [+0.1, -1, +0.1, 0]. No baseline: an
    all-correct group keeps its PSR signal (GRPO would give it 0)."""
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    assert algos.ADVANTAGES["psr"](r, valid).tolist() == [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    assert algos.ADVANTAGES["nsr"](r, valid).tolist() == [[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    w = algos.ADVANTAGES["w_reinforce"](r, valid)
    assert torch.allclose(w, torch.tensor([[0.1, -1.0, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1]]))
    assert algos.ADVANTAGES["grpo"](r, valid)[1].abs().sum() == 0


@pytest.mark.parametrize("adv", ["psr", "nsr", "w_reinforce"])
def test_no_baseline_estimators_refuse_dynamic_sampling(adv):
    from posttrain.config import Rl

    with pytest.raises(ValueError, match="no per-group baseline"):
        Rl(advantage=adv, dynamic_sampling="skip")
    Rl(advantage=adv, dynamic_sampling="off")


def test_truncated_importance_sampling_weights_by_hand():
    from posttrain.corrections import CORRECTIONS

    def tis(level, *args):
        return CORRECTIONS[f"tis_{level}"](*args[:3], cap=args[3]).weights

    ln = torch.log
    # trainer probs 0.5, 0.2, 0.9 (third token padding); sampler probs 0.25, 0.4, 0.3
    old = ln(torch.tensor([[0.5, 0.2, 0.9], [0.6, 0.9, 0.1]]))
    sampler = ln(torch.tensor([[0.25, 0.4, 0.3], [0.1, 0.3, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # per token: 0.5/0.25 = 2 -> min(2, 2) = 2; 0.2/0.4 = 0.5; padding 0 | 0.6/0.1 = 6 -> 2; 0.9/0.3 = 3 -> 2; 1
    torch.testing.assert_close(tis("token", old, sampler, mask, 2.0),
                               torch.tensor([[2.0, 0.5, 0.0], [2.0, 2.0, 1.0]]))
    # per sequence: 2 * 0.5 = 1 (padding excluded) -> 1 | 6 * 3 * 1 = 18 -> capped at 2
    torch.testing.assert_close(tis("sequence", old, sampler, mask, 2.0),
                               torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]))
    # cap 1.5: tokens 2 -> 1.5, 0.5 stays; sequence 1 stays
    torch.testing.assert_close(tis("token", old[:1], sampler[:1], mask[:1], 1.5), torch.tensor([[1.5, 0.5, 0.0]]))
    assert not tis("token", old.requires_grad_(), sampler, mask, 2.0).requires_grad  # a weight, not a path


def test_entropy_token_selection_by_hand():
    from posttrain.algos import TOKEN_SELECTIONS

    ent = torch.tensor([0.1, 0.9, 0.5, 0.8, 0.2])
    # rho 0.4 of 5 tokens: k = ceil(2.0) = 2 -> the two highest entropies, 0.9 (index 1) and 0.8 (index 3)
    assert TOKEN_SELECTIONS["top_entropy"](ent, 0.4).tolist() == [False, True, False, True, False]
    assert TOKEN_SELECTIONS["bottom_entropy"](ent, 0.4).tolist() == [True, False, True, False, True]
    # rho 0.3: k = ceil(1.5) = 2 as well; rho 0.2: k = 1 -> index 1 alone
    assert TOKEN_SELECTIONS["top_entropy"](ent, 0.2).tolist() == [False, True, False, False, False]
    # ties go to the earlier token: three equal entropies, k = ceil(0.6) = 1 -> the first
    assert TOKEN_SELECTIONS["top_entropy"](torch.tensor([0.5, 0.5, 0.5]), 0.2).tolist() == [True, False, False]
    assert TOKEN_SELECTIONS["all"](ent, 0.2).all() and TOKEN_SELECTIONS["top_entropy"](ent, 1.0).all()


def test_prior_fused_baseline_by_hand():
    from posttrain.algos import ADVANTAGES, fuse

    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    valid = torch.ones_like(r, dtype=torch.bool)
    prior = torch.tensor([[0.5, 8.0], [0.1, 20.0], [0.2, 8.0]])
    b, accepted = fuse(r, valid, prior)
    # row 0: mean 0.25, pooled (8*0.5 + 4*0.25)/12 = 5/12 = 0.41667; z = 0.25/sqrt(0.41667*0.58333*(1/4+1/8)) = 0.83
    # row 1: mean 1, pooled (2 + 4)/24 = 0.25; z = 0.9/sqrt(0.25*0.75*(1/4+1/20)) = 3.79 > 1.96: rejected, b = 1
    # row 2: mean 0, pooled 1.6/12 = 0.13333; z = 0.2/sqrt(0.13333*0.86667*0.375) = 0.96: accepted
    assert accepted.tolist() == [True, False, True]
    assert b.tolist() == pytest.approx([5 / 12, 1.0, 1.6 / 12], abs=1e-6)
    adv = ADVANTAGES["prior_fused"](r, valid, prior)
    assert adv[0].tolist() == pytest.approx([7 / 12, -5 / 12, -5 / 12, -5 / 12], abs=1e-6)
    assert adv[1].abs().sum() == 0  # rejected prior, all correct: no signal (as a group mean)
    assert adv[2].tolist() == pytest.approx([-1.6 / 12] * 4, abs=1e-6)  # a zero-variance group still learns
    # no prior: the group mean (Dr. GRPO); an unscorable sample gets 0 and is not counted
    valid[0, 3] = False
    no_prior = ADVANTAGES["prior_fused"](r, valid)
    assert no_prior[0].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0], abs=1e-6)
    assert torch.allclose(no_prior[1:], ADVANTAGES["dr_grpo"](r, valid)[1:])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "grpo_batch_std", "reinforce_pp"])
@pytest.mark.parametrize("value,g", [(0.1, 8), (1.1, 12), (1.0, 4)])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(name, value, g):
    """Found by the hardening pass: eight rewards of 0.1 (a weighted reward) gave GRPO advantages of up to 7.4e-3,
    twelve of 1.1 up to 0.106: the fp32 mean is not exactly the value, the std is residue, and dividing by
    std + 1e-6 blows the residue up. A zero-signal group must not train (with rl.dynamic_sampling: off)."""
    r = torch.full((2, g), value)
    r[1] = torch.linspace(0, 1, g)  # a group with signal beside it, for the batch-level estimators
    valid = torch.ones_like(r, dtype=torch.bool)
    adv = ADVANTAGES[name](r, valid, None)
    if name == "reinforce_pp":  # one baseline for the batch: only a batch of equal rewards is zero-signal
        assert torch.equal(ADVANTAGES[name](r[:1], valid[:1], None), torch.zeros(1, g))
    else:
        assert torch.equal(adv[0], torch.zeros(g))
    assert adv[1].abs().sum() > 0  # the other group keeps its signal


def test_reinforce_pp_normalises_over_tokens_as_the_paper():
    """Found by the hardening pass: REINFORCE++ (Eq. 10; verl's masked_whiten of per-token returns) normalises
    over tokens, and this normalised over sequences (gap 0.71 with varied lengths).
    r = [1, 0], lengths [3, 1]: token mean 3/4 = 0.75; unbiased token variance (3 * 0.25^2 + 1 * 0.75^2) / (4 - 1)
    = 0.25, std 0.5; adv = [(1 - 0.75) / 0.5, (0 - 0.75) / 0.5] = [0.5, -1.5]."""
    r, valid = torch.tensor([[1.0, 0.0]]), torch.ones(1, 2, dtype=torch.bool)
    adv = ADVANTAGES["reinforce_pp"](r, valid, None, torch.tensor([[3, 1]]))
    assert adv[0].tolist() == pytest.approx([0.5, -1.5], abs=1e-5)
    # equal lengths [2, 2]: tokens [1, 1, 0, 0], mean 0.5, unbiased variance 4 * 0.25 / 3 = 1/3: adv = +-0.866
    # (over sequences, variance 0.5 / 1: +-0.707; the unbiased correction counts tokens, not sequences)
    same = ADVANTAGES["reinforce_pp"](r, valid, None, torch.tensor([[2, 2]]))
    assert same[0].tolist() == pytest.approx([0.866025, -0.866025], abs=1e-5)
