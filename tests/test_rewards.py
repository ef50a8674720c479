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
    ("answer: 033166\n", 1.0, 0.0),  # leading zero and a trailing newline: still the same integer
    ("answer: 33167", 0.0, 1.0),
    ("4738*7=", 0.0, 0.0),  # only the prompt echoed
    ("", 0.0, 0.0),
    ("33166", 0.0, 0.0),  # number without the answer marker
])
def test_arith_reward_table(completion, correct, fmt):
    assert REWARDS["correct"]([_s(completion)])[0] == correct
    assert REWARDS["format"]([_s(completion)])[0] == fmt


# Completions that must never earn reward, whatever their gold (33166 / 5), and the guard that stops each.
ARITH_ATTACKS = [
    ("answer: 33166 or 33167", "not_final"),  # hedge
    ("answer: 33166, 33167", "not_final"),  # several answers in one
    ("answer: 33166 and more text", "not_final"),
    ("answer: 33000-34000", "not_final"),  # an interval
    ("answer: {33166, 33167}", "not_final"),  # a set (no integer right after the marker)
    ("answer: 33166;answer: 33167", "several_answers"),  # a correct answer, then a different final one
    ("answer: 1;answer: 33166", "several_answers"),  # a wrong one, then the right one: still two answers
    ("4738*7=33166", "no_answer"),  # the answer only in an echoed prompt
    ("I am sure this is correct. answer: correct", "not_final"),  # text claiming to be correct
    ("answer: 33166 (verified correct)", "not_final"),
    ("answer: " + "9" * 5000, "pathological"),  # int() of > 4300 digits raises: must not crash, must not pay
]
MATH_ATTACKS = [
    ("\\boxed{5} or \\boxed{6}", "several_answers"),
    ("\\boxed{5} \\boxed{6}", "several_answers"),  # two different boxes, the right one last
    ("\\boxed{6} then \\boxed{5}", "several_answers"),
    ("<think>\\boxed{4}</think> The answer is \\boxed{5}.", "several_answers"),
    ("\\boxed{5} \\boxed{}", "empty_box"),
    ("\\boxed{5}. Wait, the answer is 6.", "several_answers"),  # correct, then a different final one
    ("\\boxed{5}. So the answer is $x = 6$.", "several_answers"),
    ("The answer is 5 or 6.", "hedged"),
    ("the answer is 5 \\text{ or } 6", "hedged"),
    ("\\boxed{5 \\pm 1}", None),  # \\pm is a legitimate answer form (1 \\pm \\sqrt{19}): math-verify says no
    ("\\boxed{5 \\text{ or } 6}", "hedged"),
    ("\\boxed{5, 6}", None),  # a tuple: math-verify itself says no
    ("\\boxed{\\{5, 6\\}}", None),  # a set
    ("\\boxed{[4, 6]}", None),  # an interval containing the answer
    ("\\boxed{4 < x < 6}", None),
    ("\\boxed{}", "empty_box"),
    ("\\boxed{5", "unbalanced_box"),
    ("The answer is correct.", None),  # text claiming to be correct
    ("the question asks about 5 apples", None),  # the number only in an echo of the prompt, no answer
    ("\\boxed{" + "9^{" * 6 + "9" + "}" * 6 + "}", "pathological"),  # exponent tower: sympy hangs 5 s
    ("\\boxed{9^{9^{9}}}", "pathological"),  # already 5 s
    ("\\boxed{9^9^9}", "pathological"),
    ("\\boxed{" + "(" * 3000 + "}", "pathological"),  # the parser times out at 5 s
    ("\\boxed{" + "9" * 5000 + "}", "pathological"),
]


@pytest.mark.parametrize("completion,why", ARITH_ATTACKS + [(c, w) for c, w in MATH_ATTACKS])
def test_adversarial_completions_earn_nothing_and_are_fast(completion, why):
    import time

    from posttrain.tasks import arith, mathfmt

    task, gold, mod = ("arith", "33166", arith) if (completion, why) in ARITH_ATTACKS else ("math", "5", mathfmt)
    t = time.perf_counter()
    for name in ("correct", "math_verify") if task == "math" else ("correct",):
        assert REWARDS[name]([_s(completion, answer=gold, task=task)])[0] == 0.0, name
    assert time.perf_counter() - t < 1.0
    assert mod.guard(completion) == why


def test_a_remark_about_the_boxed_answer_is_no_second_answer():
    """Found by the hardening pass: "This answer is consistent with ..." after the box fired several_answers and
    scored a correct completion 0. A second answer needs an answer-like value after its anchor."""
    from posttrain.tasks import mathfmt

    ok = "The answer is \\boxed{5}. This answer is consistent with the constraints."
    assert mathfmt.guard(ok) is None
    assert REWARDS["math_verify"]([_s(ok, answer="5", task="math")])[0] == 1.0


@pytest.mark.parametrize("completion", [
    "<think>2+3 = \\boxed{5}</think> The answer is \\boxed{5}.",  # the R1-style completion
    "\\boxed{5} \\boxed{5}",
    "\\boxed{5} so \\boxed{5.0}",  # math-verify reads the two together as the set {5, 5.0}: the last box only
    "\\boxed{\\frac{10}{2}}. Checking: \\boxed{ 5 }",
    "\\boxed{5}. So the answer is 5.",  # boxed, then restated
    "\\boxed{5}. So the answer is $x = 5$.",
])
def test_equivalent_repeated_answers_are_one_answer(completion):
    """Issue 49, finding 4: a completion that states the same answer twice scored 0 (several_answers): R1-style
    models box it inside <think> and again after it, so evaluation under-counted them and RL learned a hidden
    format rule. Equivalent repeats are one answer; different ones still fire (MATH_ATTACKS above)."""
    from posttrain.tasks import mathfmt

    assert mathfmt.guard(completion) is None
    assert REWARDS["math_verify"]([_s(completion, answer="5", task="math")])[0] == 1.0
    assert mathfmt.extract_answer(completion) in ("5", "5.0")  # the last box, as math-verify prints it


def test_unparseable_gold_is_unscorable_not_free():
    assert REWARDS["correct"]([_s("answer: 1", answer="n/a")])[0] is None
    assert REWARDS["math_verify"]([_s("\\boxed{1}", answer="\\frac{", task="math")])[0] is None


@pytest.mark.parametrize("n,expected", [(10, 0.0), (64, 0.0), (72, -0.5), (80, -1.0)])
def test_overlong_soft_punishment(n, expected):
    # L_max 80, L_cache 16: zero up to 64 tokens, then linear to -1 at 80: (80 - 16 - 72) / 16 = -0.5
    assert REWARDS["overlong"]([_s("x", n=n)], buffer=16)[0] == pytest.approx(expected)


def test_combine_weights_and_unscorable():
    specs = [SimpleNamespace(name="correct", weight=1.0, kwargs={}),
             SimpleNamespace(name="format", weight=0.1, kwargs={})]
    [(total, parts)] = combine([_s("answer: 33166")], specs)
    assert total == pytest.approx(1.1) and parts == {"correct": 1.0, "format": 1.0}
    [(total, parts)] = combine([_s("answer: 1", answer="n/a")], specs)
    assert total is None and parts["correct"] is None


def test_rewards_are_picklable():
    for fn in REWARDS.values():
        assert pickle.loads(pickle.dumps(fn)) is fn
    s = _s(COT)
    assert pickle.loads(pickle.dumps(s)) == s


def test_guards_never_refuse_a_real_benchmark_answer():
    """The guards must not cost honest answers: every gold of MATH-500, Minerva, OlympiadBench, AIME 24/25 and
    AMC 23 (1,546 answers), boxed at the end of a solution, passes them."""
    import json

    from conftest import bench_file

    from posttrain.tasks import mathfmt

    n = 0
    for name in ("math500", "minervamath", "olympiadbench", "aime24", "aime25", "amc2023"):
        for line in bench_file(f"{name}.jsonl").read_text().splitlines():
            a = json.loads(line)["answer"]
            gold = str(a[0] if isinstance(a, list) else a)
            assert mathfmt.guard(f"Working it out carefully, we get \\boxed{{{gold}}}.") is None, (name, gold)
            n += 1
    assert n == 1546


def test_the_reward_audit_is_the_same_whatever_the_batching():
    """stages.reward.Audit keeps running means, not one float per sample: batches of 3 + 1 rows give the audit of
    one batch of 4, and the means are the hand-computed ones."""
    import json

    from stages import reward

    rows = [{"prompt_id": f"p{i // 2}", "prompt": "q", "answer": "5", "task": "arith", "completion": "5",
             "reward": r, "rewards": json.dumps({"correct": r})} for i, r in enumerate([1.0, 0.0, None, 0.5])]
    rates = [{"prompt_id": "p0", "pass_rate": 0.5}, {"prompt_id": "p1", "pass_rate": 0.0}]
    one, two = reward.Audit(1), reward.Audit(1)
    one.add(rows)
    one.add_rates(rates)
    two.add(rows[:3])
    two.add(rows[3:])
    two.add_rates(rates[:1])
    two.add_rates(rates[1:])
    a = one.result()
    assert a == two.result()
    assert a["reward_mean"] == 0.5  # (1 + 0 + 0.5) / 3 scorable
    assert a["unscorable"] == 1 and a["component_means"] == {"correct": 0.5}
    assert a["pass_rate_mean"] == 0.25 and a["never_solved"] == 1 and a["always_solved"] == 0  # (0.5 + 0) / 2
    md = reward.audit_markdown(a | {"component_weights": {"correct": 2.0}})  # the weights that make the total
    assert "| component | weight | mean | weight x mean |" in md and "| correct | 2 | 0.5000 | 1.0000 |" in md


def test_evaluate_reports_how_often_a_guard_fired():
    """Issue 49, item 3: the guard's firing rate per model in evaluate's summary (``guarded``): of a greedy
    completion and 3 samples, one hedges and one boxes two different answers -> 2 of 4 = 0.5; the repeated
    equivalent answer fires nothing."""
    from posttrain.rollout import Completion
    from stages.evaluate import score_problem

    def c(text: str) -> Completion:
        return Completion(text, [1, 2], [0.0, 0.0], "stop")

    prob = {"id": "p", "task": "math", "prompt": "2+3?", "answer": "5"}
    row, _ = score_problem(prob, c("\\boxed{5} so \\boxed{5}"), [c("5 or 6? The answer is 5 or 6."),
                           c("\\boxed{4} \\boxed{5}"), c("The answer is \\boxed{5}.")], [1, 2])
    assert row["guarded"] == 0.5 and row["greedy"] == 1.0 and row["pass@1"] == pytest.approx(1 / 3)
    row, _ = score_problem(prob, c("\\boxed{4} \\boxed{5}"), [], [1])
    assert row["guarded"] == 1.0 and row["greedy"] == 0.0
