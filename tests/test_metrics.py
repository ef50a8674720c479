import math

import pytest

from posttrain.metrics import bootstrap_ci, maj_at_k, pass_at_k


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


def test_maj_at_k():
    answers = ["3", "5", "5", None, "3", "3"]
    correct = [True, False, False, False, True, True]
    assert maj_at_k(answers, correct, 3) is False  # 5 wins 2-1
    assert maj_at_k(answers, correct, 6) is True  # 3 wins 3-2; None does not vote
    assert maj_at_k(["3", "5"], [True, False], 2) is True  # tie -> first seen
    assert maj_at_k([None, None], [False, False], 2) is False


def test_bootstrap_ci():
    assert bootstrap_ci([0.5] * 20) == (0.5, 0.5)
    lo, hi = bootstrap_ci([0.0] * 50 + [1.0] * 50, n_boot=2000)
    assert lo < 0.5 < hi and 0.35 < lo and hi < 0.65  # ~ 0.5 +- 1.96 * 0.05
