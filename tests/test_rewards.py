import pickle
from types import SimpleNamespace

import pytest

from posttrain.rewards import REWARDS, Sample, combine


def _s(completion, answer="33166", task="arith", n=20, max_new=80, finish="stop"):
    return Sample(completion, answer, task, n, max_new, finish)


COT = "8*7+0=56 6;3*7+5=26 66;7*7+2=51 166;4*7+5=33 33166;answer: 33166"


@pytest.mark.parametrize("completion,correct,fmt", [
    (COT, 1.0, 1.0),
    ("answer: 33166", 1.0, 1.0),
    ("answer: 33167", 0.0, 1.0),
    ("answer: 1;answer: 33166", 1.0, 0.0),  # the last answer is verified, but two answers are bad format
    ("4738*7=", 0.0, 0.0),  # only the prompt echoed
    ("", 0.0, 0.0),
    ("33166", 0.0, 0.0),  # number without the answer marker
    ("answer: 33166 and more text", 1.0, 0.0),
])
def test_arith_reward_table(completion, correct, fmt):
    assert REWARDS["correct"](_s(completion)) == correct
    assert REWARDS["format"](_s(completion)) == fmt


@pytest.mark.parametrize("completion,correct,fmt", [
    ("so \\boxed{72}", 1.0, 1.0),
    ("first \\boxed{72} then \\boxed{70}", 0.0, 0.0),  # several boxed answers: a set, never the gold
    ("the question says 72 apples? I do not know", 0.0, 0.0),  # number only from the prompt echo
    ("", 0.0, 0.0),
])
def test_math_reward_table(completion, correct, fmt):
    s = _s(completion, answer="72", task="math")
    assert REWARDS["correct"](s) == correct
    assert REWARDS["math_verify"](s) == correct
    assert REWARDS["format"](s) == fmt


def test_unparseable_gold_is_unscorable_not_free():
    assert REWARDS["correct"](_s("answer: 1", answer="n/a")) is None
    assert REWARDS["math_verify"](_s("\\boxed{1}", answer="\\frac{", task="math")) is None


@pytest.mark.parametrize("n,expected", [(10, 0.0), (64, 0.0), (72, -0.5), (80, -1.0)])
def test_overlong_soft_punishment(n, expected):
    # L_max 80, L_cache 16: zero up to 64 tokens, then linear to -1 at 80: (80 - 16 - 72) / 16 = -0.5
    assert REWARDS["overlong"](_s("x", n=n), buffer=16) == pytest.approx(expected)


def test_combine_weights_and_unscorable():
    specs = [SimpleNamespace(name="correct", weight=1.0, kwargs={}),
             SimpleNamespace(name="format", weight=0.1, kwargs={})]
    total, parts = combine(_s("answer: 33166"), specs)
    assert total == pytest.approx(1.1) and parts == {"correct": 1.0, "format": 1.0}
    total, parts = combine(_s("answer: 1", answer="n/a"), specs)
    assert total is None and parts["correct"] is None


def test_rewards_are_picklable():
    for fn in REWARDS.values():
        assert pickle.loads(pickle.dumps(fn)) is fn
    s = _s(COT)
    assert pickle.loads(pickle.dumps(s)) == s
