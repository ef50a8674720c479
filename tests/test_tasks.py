import random

import pytest

from posttrain.config import CodeTask
from posttrain.tasks import arith, code, get_task, mathfmt


def test_chain_of_thought_hand_checked():
    # 4738*7: 8*7=56 -> write 6 carry 5; 3*7+5=26 -> 66 carry 2; 7*7+2=51 -> 166 carry 5; 4*7+5=33 -> 33166
    assert arith.chain_of_thought(4738, 7) == "8*7+0=56 6;3*7+5=26 66;7*7+2=51 166;4*7+5=33 33166;answer: 33166"
    # 10*9: 0*9=0 -> 0 carry 0; 1*9+0=9 -> 90
    assert arith.chain_of_thought(10, 9) == "0*9+0=0 0;1*9+0=9 90;answer: 90"


def test_cot_answer_is_the_product_for_many_operands():
    rng = random.Random(1)
    for _ in range(500):
        a, b = arith.sample_operands(rng, 1, 6, 0, 9)
        cot = arith.chain_of_thought(a, b)
        assert arith.verify(str(a * b), cot) is True
        assert int(cot.split(";")[-2].split(" ")[-1]) == a * b  # the last partial is the full product


def test_sampling_is_deterministic_and_in_range():
    draw = [arith.sample_operands(random.Random(7), 2, 4, 2, 9) for _ in range(2)]
    assert draw[0] == draw[1]
    rng = random.Random(0)
    for _ in range(1000):
        a, b = arith.sample_operands(rng, 2, 4, 2, 9)
        assert 10 <= a <= 9999 and 2 <= b <= 9


@pytest.mark.parametrize("completion,expected", [
    ("answer: 33166", True),
    ("8*7+0=56 6;answer: 1;answer: 33166", False),  # two answers: hedging, whichever comes last
    ("answer: 33166;answer: 1", False),
    ("33166", False),  # no answer marker
    ("", False),
    ("answer: 033166", True),  # integer comparison
])
def test_arith_verify(completion, expected):
    assert arith.verify("33166", completion) is expected


def test_arith_unparseable_gold_is_unscorable():
    assert arith.verify("abc", "answer: 1") is None


def test_gsm8k_adapter_strips_calculator_annotations():
    row = {"question": "Q?", "answer": "48/2 = <<48/2=24>>24 clips.\n#### 1,072"}
    out = mathfmt.from_gsm8k(row)
    assert out["answer"] == "1072"
    assert "<<" not in out["solution"] and out["solution"].endswith("\\boxed{1072}.")
    with pytest.raises(ValueError):
        mathfmt.from_gsm8k({"question": "Q?", "answer": "no marker"})


def test_math_adapter_takes_boxed_from_solution():
    assert mathfmt.from_math({"problem": "p", "solution": "so \\boxed{\\frac{1}{2}} done"})["answer"] == "\\frac{1}{2}"
    assert mathfmt.last_boxed("\\boxed{a} and \\boxed{b{c}}") == "b{c}"


@pytest.mark.parametrize("gold,completion,expected", [
    ("72", "so the answer is \\boxed{72}", True),
    ("72", "\\boxed{71}", False),
    ("\\frac{1}{2}", "\\boxed{0.5}", True),
    ("72", "", False),
    ("72", "I think \\boxed{72} but actually \\boxed{70}", False),  # several answers: no credit
    ("72", "The question has 72 apples", False),  # a number without an answer anchor does not count
    ("72", "The answer is 72.", True),
])
def test_math_verify(gold, completion, expected):
    assert mathfmt.verify(gold, completion) is expected


def test_math_verify_order_and_unscorable_gold():
    # an unparseable gold is never a free "correct"
    assert mathfmt.verify("", "\\boxed{1}") is None
    assert mathfmt.gold_ok("72") and not mathfmt.gold_ok("")


def test_task_registry():
    assert get_task("arith").extract("x;answer: 12") == "12"
    with pytest.raises(KeyError, match="known"):
        get_task("nope")


def test_a_generated_problem_is_shown_in_both_formats_though_it_carries_its_solution():
    # curate stores the generator's line-per-step solution with the problem; the SFT demos render it per style, so
    # `direct` must still be the one-expression form, or `sft.phases[*].cot_frac` does nothing on the code task
    p, t, s = code.generate(random.Random(3), CodeTask(min_steps=2, max_steps=2))
    task = get_task("code")
    assert task.render(p, t, s, "cot") == s
    direct = task.render(p, t, s, "direct")
    assert direct == code.render(p, t, None, "direct") and direct.startswith(" return") and "\n" not in direct
    human = "def g(x):\n    '''Twice x.'''\n"  # a problem that is not the synthetic task's renders its solution
    assert task.render(human, "assert g(1) == 2", "    return 2 * x\n", "direct") == "    return 2 * x\n"


def test_a_gsm8k_source_reads_only_problems_of_at_most_max_steps_calculations(tmp_path):
    """max_steps counts the reference solution's <<a*b=c>> annotations: rows of 1, 2 and 3 calculations with
    max_steps 2 -> the first two are read; any other format refuses the key at load."""
    import json

    from posttrain.config import ConfigError, FileSource, MathTask, parse_params
    from posttrain.sources import read_source
    from tests.conftest import tiny_raw

    rows = [{"question": f"q{k}", "answer": "".join(f"a <<{i}+1={i + 1}>>{i + 1}\n" for i in range(k)) + f"#### {k}"}
            for k in (1, 2, 3)]
    f = tmp_path / "g.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [mathfmt.gsm8k_steps(r) for r in rows] == [1, 2, 3]
    src = FileSource(name="g", path=str(f), format="gsm8k", max_steps=2)
    assert [obj["answer"] for _, obj, _ in read_source(src, MathTask(), 0)] == ["1", "2"]
    raw = tiny_raw(tmp_path)
    raw["curate"]["decontam"]["benchmarks"] = [{"kind": "file", "name": "m", "path": str(f), "format": "math",
                                                "max_steps": 2}]
    with pytest.raises(ConfigError, match=r"curate.decontam.benchmarks\[0\].max_steps: .*counts GSM8K"):
        parse_params(raw)
