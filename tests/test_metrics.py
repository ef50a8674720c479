import math

import pytest

from posttrain.metrics import bootstrap_ci, maj_at_k, paired_bootstrap_ci, pass_at_k, wilson_ci


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 0.4),  # c/n
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 4, 1.0),  # n-c = 3 < k: every 4-subset holds a correct sample
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (8, 0, 8, 0.0),
    (8, 8, 1, 1.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_maj_at_k_uses_every_sample():
    """maj@k = the mean, over the n // k disjoint blocks of k consecutive samples, of whether the block's
    majority answer is correct (None = no vote; a tie goes to the answer seen first in the block)."""
    answers = ["3", "5", "5", None, "3", "3"]
    correct = [True, False, False, False, True, True]
    # k = 3: blocks [3, 5, 5] -> 5 wins (wrong); [None, 3, 3] -> 3 wins (right): 1/2
    assert maj_at_k(answers, correct, 3) == 0.5
    # k = 2: [3, 5] tie -> 3 (right); [5, None] -> 5 (wrong); [3, 3] -> right: 2/3
    assert maj_at_k(answers, correct, 2) == 2 / 3
    assert maj_at_k(answers, correct, 6) == 1.0  # 3 wins 3-2 over all six
    assert maj_at_k(answers, correct, 1) == 0.5  # each sample alone: 3 of the 6 are correct
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    # 7 samples, k = 3: two blocks; the 7th sample is in no block
    assert maj_at_k(["1", "1", "2", "2", "2", "1", "1"], [True, True, False, False, False, True, True], 3) == 0.5


def test_wilson_interval_hand_values():
    # 0 of 20: lower 0, upper z^2 / (n + z^2) = 3.8415 / 23.8415 = 0.161125
    lo, hi = wilson_ci(0, 20)
    assert lo == 0.0 and math.isclose(hi, 0.161125, abs_tol=1e-5)
    lo, hi = wilson_ci(20, 20)  # symmetric: never a zero-width interval at 100%
    assert math.isclose(lo, 1 - 0.161125, abs_tol=1e-5) and hi == 1.0
    # 10 of 20: centre 0.5, half-width z * sqrt(0.25 / 20 + z^2 / 1600) / (1 + z^2 / 20)
    # = 1.959964 * sqrt(0.0125 + 0.0024010) / 1.192074 = 0.200702
    lo, hi = wilson_ci(10, 20)
    assert math.isclose(lo, 0.5 - 0.200702, abs_tol=1e-5) and math.isclose(hi, 0.5 + 0.200702, abs_tol=1e-5)


def test_paired_bootstrap_of_a_difference():
    a = [0.0] * 50 + [1.0] * 50
    assert paired_bootstrap_ci(a, a) == (0.0, 0.0)  # a model against itself: exactly no difference
    b = [1.0] + a[1:]  # one problem flips from wrong to right: difference 0.01, never negative in a resample
    lo, hi = paired_bootstrap_ci(a, b, n_boot=2000)
    assert lo == 0.0 and 0.0 < hi <= 0.04
    # unpaired, the same two means would have intervals ~ +-0.1 each: pairing is what makes this decidable
    lo_a, hi_a = bootstrap_ci(a, n_boot=2000)
    assert hi_a - lo_a > 0.15


def test_bootstrap_ci():
    assert bootstrap_ci([0.5] * 20) == (0.5, 0.5)
    lo, hi = bootstrap_ci([0.0] * 50 + [1.0] * 50, n_boot=2000)
    assert lo < 0.5 < hi and 0.35 < lo and hi < 0.65  # ~ 0.5 +- 1.96 * 0.05


def test_rate_intervals_do_not_collapse_at_0_and_100_percent():
    """Found by the hardening pass: pass@64 of 100% on 100 problems had the bootstrap interval [1.0, 1.0]
    (19 such zero-width intervals in the committed metrics). All problems at 1 (or at 0) are 0/1 outcomes: the
    Wilson interval of 100 of 100 is centre (1 + z^2/200) / (1 + z^2/100) - half, with z = 1.96:
    lower = (1 + 0.019208) / 1.038415 - 1.96 * sqrt(0.000096) / 1.038415 = 0.98150 - 0.01850 = 0.96300."""
    from posttrain.metrics import bootstrap_ci, rate_ci

    assert bootstrap_ci([1.0] * 100) == (1.0, 1.0)  # what the bootstrap alone says
    lo, hi = rate_ci([1.0] * 100)
    assert hi == 1.0 and lo == pytest.approx(0.96300, abs=1e-5)
    lo, hi = rate_ci([0.0] * 100)
    assert lo == 0.0 and hi == pytest.approx(0.03700, abs=1e-5)
    mixed = [1.0, 0.0, 0.5, 1.0]
    assert rate_ci(mixed) == bootstrap_ci(mixed)  # inside, the bootstrap as before


def test_rate_intervals_do_not_collapse_near_the_boundary():
    """Issue 49, finding 7: pass@8 from 64 samples at c = 56 is 1 - C(8,8)/C(64,8) = 1 - 2.3e-10, not exactly 1,
    so the exact-0/1 test missed it and the bootstrap gave [0.99999..., 1.0] -> '100.0 [100.0, 100.0]'.
    Within BINARY_EPS of 0 or 1 the Wilson interval of the (fractional) sum applies: 100 problems at
    1 - 2.3e-10 -> lower 0.96300 as for exactly 100 of 100 (test above)."""
    from posttrain.metrics import pass_at_k, rate_ci

    v = pass_at_k(64, 56, 8)
    assert 0 < 1 - v < 1e-9
    lo, hi = rate_ci([v] * 100)
    assert lo == pytest.approx(0.96300, abs=2e-5) and hi == pytest.approx(1.0)
    lo, hi = rate_ci([1.0] * 99 + [0.0])  # 99 of 100 decided problems: Wilson, not the bootstrap's hi = 1.0
    # centre (0.99 + 0.019208) / 1.038415 = 0.971873; half 1.959964 * sqrt(0.000099 + 0.0000960) / 1.038415
    # = 1.959964 * 0.0139655 / 1.038415 = 0.026359 -> [0.945514, 0.998232]
    assert lo == pytest.approx(0.945514, abs=1e-5) and hi == pytest.approx(0.998232, abs=1e-5)


def test_paired_intervals_do_not_collapse_at_the_ceiling():
    """Two models at 100% on every problem: the paired bootstrap said +0.0 [+0.0, +0.0]. Newcombe's paired
    interval (1998, method 10) with phi = 0 (an empty margin): delta = p_b - l_b = 1 - 0.96300, eps =
    p_a - l_a = 0.03700 -> [-0.03700, +0.03700]."""
    from posttrain.metrics import paired_rate_ci

    lo, hi = paired_rate_ci([1.0] * 100, [1.0 - 1e-9] * 100)
    assert lo == pytest.approx(-0.03700, abs=1e-5) and hi == pytest.approx(0.03700, abs=1e-5)


def test_newcombe_paired_interval_hand_values():
    """n = 20; a right on 10, b right on 12, both on those 10 (table: both 10, b only 2, a only 0, neither 8).
    p_b = 0.6, p_a = 0.5, theta = 0.1. Wilson(12, 20) = 0.583889 -+ 0.197307 = [0.386582, 0.781196];
    Wilson(10, 20) = [0.299298, 0.700702]. phi = (10*8 - 2*0) / sqrt(12*8*10*10) = 80 / 97.9796 = 0.816497.
    delta = sqrt(0.213418^2 - 2*0.816497*0.213418*0.200702 + 0.200702^2)
          = sqrt(0.045547 - 0.069946 + 0.040281) = sqrt(0.015882) = 0.126024
    eps   = sqrt(0.181196^2 - 2*0.816497*0.181196*0.200702 + 0.200702^2)
          = sqrt(0.032832 - 0.059385 + 0.040281) = sqrt(0.013728) = 0.117166
    -> [0.1 - 0.126024, 0.1 + 0.117166] = [-0.026024, 0.217166]."""
    from posttrain.metrics import newcombe_paired_ci

    a = [1.0] * 10 + [0.0] * 10
    b = [1.0] * 12 + [0.0] * 8
    lo, hi = newcombe_paired_ci(a, b)
    assert lo == pytest.approx(-0.026024, abs=2e-5) and hi == pytest.approx(0.217166, abs=2e-5)
    lo, hi = newcombe_paired_ci(b, a)  # the other order: the mirror image
    assert lo == pytest.approx(-0.217166, abs=2e-5) and hi == pytest.approx(0.026024, abs=2e-5)
