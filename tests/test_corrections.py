"""Off-policy corrections (posttrain.corrections.CORRECTIONS): each entry's weights on small tensors, with the
expected values computed by hand in the comments; masks respected, weights detached; their config (rl.correction,
and rl.tis read as one)."""

import inspect
import math

import pytest
import torch
from conftest import repo_params

from posttrain import corrections
from posttrain.algos import LOG_RATIO_CLAMP
from posttrain.config import CORRECTION_KWARGS, ConfigError, CorrectionSpec, Rl, parse_params

# Two sequences, sampler log-probs 0, so each log-ratio log r_t = old_t. The last column of row 0 and the last two
# of row 1 are padding, with a huge ratio (e^9) that must never show.
#   row 0: log r = [0.5, -2.0, 0.0 | 9.0]  ->  r = [e^0.5 = 1.64872, e^-2 = 0.135335, 1.0]
#   row 1: log r = [2.0, 0.5 | 9.0, 9.0]   ->  r = [e^2 = 7.38906, e^0.5 = 1.64872]
OLD = torch.tensor([[0.5, -2.0, 0.0, 9.0], [2.0, 0.5, 9.0, 9.0]])
SAMPLER = torch.zeros(2, 4)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
E05, EM2, E2 = math.exp(0.5), math.exp(-2.0), math.exp(2.0)
F, T = False, True


def _run(name, **kw):
    old = OLD.clone().requires_grad_(True)  # the weights must not carry its gradient
    c = corrections.CORRECTIONS[name](old, SAMPLER, MASK, **kw)
    assert not c.weights.requires_grad
    assert c.weights.shape == c.capped.shape == c.masked.shape == (2, 4)
    assert not (c.capped & (MASK == 0)).any() and not (c.masked & (MASK == 0)).any()  # never at padding
    return c


def test_tis_token_caps_each_tokens_ratio():
    # cap 1.5: row 0 -> [min(1.6487, 1.5) = 1.5 (capped), 0.1353, 1.0, pad 0]; row 1 -> [1.5 (capped), 1.5 (capped)]
    c = _run("tis_token", cap=1.5)
    torch.testing.assert_close(c.weights, torch.tensor([[1.5, EM2, 1.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))
    assert c.capped.tolist() == [[T, F, F, F], [T, T, F, F]] and not c.masked.any()


def test_tis_sequence_caps_the_product_of_a_sequences_ratios():
    # row 0: prod r = e^(0.5 - 2 + 0) = e^-1.5 = 0.22313 (under the cap) on each of its 3 tokens;
    # row 1: e^(2 + 0.5) = e^2.5 = 12.18 -> the cap 2 on both tokens (capped)
    c = _run("tis_sequence", cap=2.0)
    w0 = math.exp(-1.5)
    torch.testing.assert_close(c.weights, torch.tensor([[w0, w0, w0, 0.0], [2.0, 2.0, 0.0, 0.0]]))
    assert c.capped.tolist() == [[F, F, F, F], [T, T, F, F]] and not c.masked.any()


def test_mis_token_drops_tokens_outside_the_band_and_leaves_the_rest_unweighted():
    # band [0.5, 2]: row 0: 1.6487 in (1), 0.1353 below (0, masked), 1.0 in (1); row 1: 7.389 above (0, masked),
    # 1.6487 in (1)
    c = _run("mis_token", low=0.5, high=2.0)
    assert c.weights.tolist() == [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert c.masked.tolist() == [[F, T, F, F], [T, F, F, F]] and not c.capped.any()


def test_mis_sequence_keeps_or_drops_whole_sequences_by_their_geometric_mean_ratio():
    # row 0: mean log r = (0.5 - 2 + 0) / 3 = -0.5 -> rho = e^-0.5 = 0.6065, inside [0.5, 2]: all 3 tokens weight 1
    #   (its product ratio e^-1.5 = 0.223 would have left the band: the geometric mean is length-invariant);
    # row 1: mean log r = (2 + 0.5) / 2 = 1.25 -> rho = e^1.25 = 3.49 > 2: both tokens weight 0, masked
    c = _run("mis_sequence", low=0.5, high=2.0)
    assert c.weights.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert c.masked.tolist() == [[F, F, F, F], [T, T, F, F]] and not c.capped.any()


def test_icepop_masks_both_sides_and_keeps_the_ratio_inside():
    # band [alpha, beta] = [0.5, 5]: row 0: 1.6487 in (weight 1.6487), 0.1353 below (0, masked), 1.0 in (1.0);
    # row 1: 7.389 above (0, masked), 1.6487 in (1.6487)
    c = _run("icepop", low=0.5, high=5.0)
    torch.testing.assert_close(c.weights, torch.tensor([[E05, 0.0, 1.0, 0.0], [0.0, E05, 0.0, 0.0]]))
    assert c.masked.tolist() == [[F, T, F, F], [T, F, F, F]] and not c.capped.any()
    # with beta = 8 the e^2 = 7.389 token is kept, weighted by its ratio
    c = _run("icepop", low=0.5, high=8.0)
    torch.testing.assert_close(c.weights[1], torch.tensor([E2, E05, 0.0, 0.0]))


def test_band_bounds_are_inclusive():
    # r = exactly 1 sits on both bounds of the band [1, 1]: kept (weight 1), the others masked
    c = corrections.mis_token(torch.tensor([[0.0, 0.1]]), torch.zeros(1, 2), torch.ones(1, 2), low=1.0, high=1.0)
    assert c.weights.tolist() == [[1.0, 0.0]] and c.masked.tolist() == [[F, T]]


def test_tis_weights_are_bit_identical_to_the_functions_before_the_registry():
    """The pre-registry code (posttrain/corrections.py at 9890ec2), inlined: the same weights to the bit."""
    def old_token(old_logp, sampler_logp, mask, cap):
        w = torch.exp((old_logp - sampler_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
        return (w * mask).detach()

    def old_sequence(old_logp, sampler_logp, mask, cap):
        s = ((old_logp - sampler_logp) * mask).sum(-1, keepdim=True)
        w = torch.exp(s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
        return (w.expand_as(old_logp) * mask).detach()

    g = torch.Generator().manual_seed(0)
    old, sampler = -torch.rand(8, 33, generator=g) * 3, -torch.rand(8, 33, generator=g) * 3
    mask = (torch.rand(8, 33, generator=g) > 0.2).float()
    for cap in (1.0, 1.5, 2.0, 1e6):
        assert torch.equal(corrections.tis_token(old, sampler, mask, cap).weights, old_token(old, sampler, mask, cap))
        assert torch.equal(corrections.tis_sequence(old, sampler, mask, cap).weights,
                           old_sequence(old, sampler, mask, cap))


def test_correction_kwargs_are_the_functions_own():
    """config/correction.py's CORRECTION_KWARGS (torch-free) declares each correction's keyword arguments as the
    function does: the same names and defaults."""
    assert set(CORRECTION_KWARGS) == set(corrections.CORRECTIONS)
    for name, fn in corrections.CORRECTIONS.items():
        params = list(inspect.signature(fn).parameters.values())[3:]  # after old_logp, sampler_logp, mask
        fields = CORRECTION_KWARGS[name].model_fields
        assert [p.name for p in params] == list(fields), name
        for p in params:
            assert fields[p.name].default == p.default, name


def _parse(rl):
    raw = repo_params()
    raw["rl"] = {**raw.get("rl", {}), **rl}
    return parse_params(raw)


def test_rl_tis_is_read_as_the_correction_it_names():
    """The older spelling keeps loading: rl.tis {mode, cap} -> rl.correction {name: tis_<mode>, kwargs: {cap}}."""
    assert Rl().correction is None  # the default: no correction
    assert _parse({"tis": {"mode": "sequence", "cap": 3}}).rl.correction == CorrectionSpec(
        name="tis_sequence", kwargs={"cap": 3.0})
    assert _parse({"tis": {}}).rl.correction == CorrectionSpec(name="tis_token", kwargs={"cap": 2.0})
    assert _parse({"tis": None}).rl.correction is None
    assert Rl(tis={"cap": 1.5}) == Rl(correction={"name": "tis_token", "kwargs": {"cap": 1.5}})


@pytest.mark.parametrize("rl,expected", [
    ({"correction": {"name": "mis"}}, "rl.correction.name: Value error, unknown correction 'mis'"),
    ({"correction": {"name": "mis_token", "kwargs": {"low": 1.5}}}, "rl.correction.kwargs.low: Value error, Input "
     "should be less than or equal to 1"),
    ({"correction": {"name": "icepop", "kwargs": {"high": 0.9}}}, "rl.correction.kwargs.high: Value error, Input "
     "should be greater than or equal to 1"),
    ({"correction": {"name": "mis_sequence", "kwargs": {"low": "0.5"}}}, "rl.correction.kwargs.low: Value error, "
     "Input should be a valid number"),
    ({"correction": {"name": "tis_token", "kwargs": {"low": 0.5}}}, "rl.correction.kwargs.low: Value error, unknown "
     "key (tis_token takes ['cap'])"),
    ({"correction": {"name": "tis_sequence", "kwargs": {"cap": 0.5}}}, "rl.correction.kwargs.cap: Value error"),
    ({"tis": {"cap": 0.5}}, "rl.tis.cap: Value error, Input should be greater than or equal to 1"),
    ({"tis": {"mode": "seq"}}, "rl.tis.mode: Value error"),
    ({"tis": {"cap": 2}, "correction": {"name": "icepop"}}, "rl.tis: Value error, rl.tis is the older spelling"),
])
def test_bad_corrections_are_refused_at_load_naming_the_key(rl, expected):
    with pytest.raises(ConfigError, match="^params: " + expected.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        _parse(rl)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_the_behaviour_policy():
    """AReaL's decoupled PPO, eps 0.2 both sides, u = pi / pi_prox, w = pi_prox / pi_behav:
    row 0 (A = +1):  u = [1, 1.5, 0.5 | pad],  w = [1, 2, 0.5 | pad]
      t0: max(-1, -clip(1) = -1) = -1, x w 1 = -1
      t1: max(-1.5, -1.2) = -1.2 (clipped), x 2 = -2.4
      t2: max(-0.5, -0.8) = -0.5 (not clipped: the clip only binds where it lowers the objective), x 0.5 = -0.25
    row 1 (A = -1):  u = [0.5, 1.5 | pad, pad],  w = [4, 1]
      t0: max(0.5, 0.8) = 0.8 (clipped), x 4 = 3.2;  with cap 3: w = 4 > 3 is dropped -> 0
      t1: max(1.5, 1.2) = 1.5, x 1 = 1.5
    d loss / d logp at row 0 t2 (unclipped): -A w u = -1 * 0.5 * 0.5 = -0.25; at the clipped row 0 t1: 0."""
    from posttrain.algos import LossCfg, ppo_clip

    ln = math.log
    behav = torch.tensor([[-1.0, -1.0, -1.0, 5.0], [-2.0, -2.0, 5.0, 5.0]], requires_grad=True)
    prox = behav.detach() + torch.tensor([[0.0, ln(2), -ln(2), 3.0], [ln(4), 0.0, 3.0, 3.0]])
    logp = (prox + torch.tensor([[0.0, ln(1.5), ln(0.5), 3.0], [ln(0.5), ln(1.5), 3.0, 3.0]])).requires_grad_(True)
    adv, mask, cfg = torch.tensor([1.0, -1.0]), MASK[:, :4].clone(), LossCfg(0.2, 0.2)
    mask[0] = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, clipped = corrections.decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -2.4, -0.25, 0.0], [3.2, 1.5, 0.0, 0.0]]))
    assert clipped.tolist() == [[F, T, F, F], [T, F, F, F]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad[0, 1:3], torch.tensor([0.0, -0.25]))
    assert behav.grad is None  # the importance weight is detached
    capped, _ = corrections.decoupled_ppo_loss(logp, prox, behav, adv, mask, cfg, cap=3.0)
    torch.testing.assert_close(capped[1], torch.tensor([0.0, 1.5, 0.0, 0.0]))
    # prox = behav (the synchronous loop): plain ppo_clip, masked
    same, _ = corrections.decoupled_ppo_loss(logp, prox, prox, adv, mask, cfg)
    torch.testing.assert_close(same, ppo_clip(logp, prox, adv, cfg)[0] * mask)
