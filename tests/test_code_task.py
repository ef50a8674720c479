"""The code task (posttrain/tasks/code.py, codeexec.py): the generator, the verdict harness against reward hacks,
the ``code_tests`` reward, HumanEval rows, and the stages on ``task.kind: code``. Skipped where bubblewrap
cannot sandbox (the refusal path runs everywhere)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import REPO

from posttrain.config import CodeTask, ConfigError, SandboxCfg, parse_params
from posttrain.config.sandbox import ENV
from posttrain.errors import StageError
from posttrain.rewards import WHY_KEY, Sample, combine, is_correct, specs_of
from posttrain.sandbox import Sandbox, SandboxUnavailable
from posttrain.tasks import code, codeexec, get_task, verify_all
from tests.conftest import import_base

FAST = SandboxCfg(cpu_s=2, wall_s=5)
PROMPT = "def f(a): # odd, add 3, sum"
TESTS = "assert _eq(f([1,2,3]),10)\nassert _eq(f([2]),0)\nassert _eq(f([5,5]),16)\nassert _eq(f([-1]),2)"
FAKE = json.dumps({"stage": "tests", "passed": 4, "total": 4, "why": None})
GOOD = " a=[x for x in a if x%2]\n a=[x+3 for x in a]\n return sum(a)"


@pytest.fixture(scope="module", autouse=True)
def sandboxed() -> None:
    try:
        Sandbox(FAST)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")


@pytest.fixture(autouse=True)
def fast_limits(monkeypatch) -> None:
    monkeypatch.setenv(ENV, FAST.model_dump_json())


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_generated_problems_are_deterministic_and_their_solutions_pass_their_tests():
    cfg = CodeTask(min_steps=0, max_steps=3)
    a = [code.generate(random.Random(7), cfg) for _ in range(3)]
    assert a == [code.generate(random.Random(7), cfg) for _ in range(3)]
    rng = random.Random(1)
    probs = [code.generate(rng, cfg) for _ in range(24)]
    items = [(p, s, t) for p, t, s in probs] + [(p, code.render(p, t, None, "direct"), t) for p, t, _ in probs]
    verdicts = codeexec.run_many(items, FAST)
    failed = [(it[0], v) for it, v in zip(items, verdicts, strict=True) if not v.all_passed]
    assert not failed
    for p, t, _ in probs:  # four distinct tests, never on an empty list, and the prompt fits its bound
        assert len(set(t.splitlines())) == 4 and "f([])" not in t and len(p) <= cfg.max_prompt_chars()
    # the tests discriminate: a constant answer passes none of most problems' tests
    wrong = codeexec.run_many([(p, " return 0", t) for p, t, _ in probs], FAST)
    assert sum(v.all_passed for v in wrong) <= 3


def test_verdicts_and_the_fraction_of_tests_passed():
    # odd, add 3, sum: [1,2,3] -> 1+3 + 3+3 = 10; [2] -> 0; [5,5] -> 16; [-1] -> 2 (-1 % 2 == 1 in Python)
    assert codeexec.run_tests(PROMPT, GOOD, TESTS, FAST) == codeexec.Verdict(4, 4, None)
    # "return len(a)": 3, 1, 2, 1 -> no test passes
    v = codeexec.run_tests(PROMPT, " return len(a)", TESTS, FAST)
    assert (v.passed, v.why) == (0, "tests: AssertionError")
    # no filter: [1,2,3] -> 4+5+6 = 15 (fails), [2] -> 5 (fails), [5,5] -> 16 (passes), [-1] -> 2 (passes): 2/4
    [r] = combine([Sample(" return sum(x+3 for x in a)", TESTS, "code", 10, 80, "stop", PROMPT)],
                  specs_of([_spec("code_tests", 1.0, {"mode": "fraction"})]))
    assert r == (0.5, {"code_tests": 0.5, WHY_KEY: {"code_tests": "tests: AssertionError"}})


@pytest.mark.parametrize("completion,why", [
    (" return sum(a", "parse: SyntaxError"),
    (" return undefined_name", "tests: NameError"),
    (" return 0\nraise SystemExit(0)", "run: SystemExit"),  # exit() before the tests: a failure, never a pass
    (" return 0\nimport os\nos._exit(0)", "no verdict"),  # no verdict line at all
    (" return 0\nprint('\\nabc ' + FAKE)\nimport os\nos._exit(0)".replace("FAKE", repr(FAKE)),
     "no verdict"),  # a forged verdict without the nonce
    (" return 0\nclass A:\n def __eq__(s, o): return True\ndef f(a): return A()",
     "tests: AssertionError"),  # an object equal to everything
    (" return 0\nimport json\nT = open('tests.json').read()\ndef f(a): return 0",
     "run: FileNotFoundError"),  # the expected values are out of reach
    (" while True: pass", "timeout"),
    (" raise SystemExit(0)", "tests: SystemExit"),  # nor inside a test
])
def test_the_verdict_resists_the_common_hacks(completion, why):
    v = codeexec.run_tests(PROMPT, completion, TESTS, FAST)
    assert (v.passed, v.why) == (0, why), v


def test_a_correct_solution_that_closes_stdout_still_gets_its_verdict():
    v = codeexec.run_tests(PROMPT, GOOD + "\nimport sys\nsys.stdout.close()", TESTS, FAST)
    assert v == codeexec.Verdict(4, 4, None)


def test_a_fenced_code_block_replaces_the_completion_and_maj_votes_on_normalised_code():
    chat = "Here it is:\n```python\ndef f(a):\n    return sum(x + 3 for x in a if x % 2)\n```\nDone."
    assert codeexec.run_tests(PROMPT, chat, TESTS, FAST).all_passed
    assert code.extract(GOOD) == code.extract(" a=[x for x in a if x%2]\n a=[x+3  for x in a]\n return sum(a)  # ok")
    assert code.extract(" return sum(a") is None and code.guard("  \n") == "empty" and code.guard(GOOD) is None


def test_humaneval_rows_verify_by_their_own_tests():
    rows = [json.loads(line) for line in (REPO.parent / "shared/benchmarks/humaneval.jsonl").open()][:3]
    probs = [code.from_humaneval(r) for r in rows]
    assert all(code.gold_ok(p["answer"]) and p["answer"].endswith(f"check({r['entry_point']})\n")
               for p, r in zip(probs, rows, strict=True))
    items = [("code", p["prompt"], p["answer"], p["solution"]) for p in probs]
    items += [("code", p["prompt"], p["answer"], "    return None\n") for p in probs]
    assert verify_all(items) == [True] * 3 + [False] * 3
    with pytest.raises(ValueError, match="entry_point"):
        code.from_humaneval({"prompt": "x", "test": "y", "entry_point": "not an id"})


def test_correct_on_code_is_all_tests_and_is_correct_reads_code_tests():
    s = Sample(GOOD, TESTS, "code", 10, 80, "stop", PROMPT)
    [(total, parts)] = combine([s], specs_of([_spec("correct", 1.0, {}), _spec("code_tests", 0.0, {})]))
    assert total == 1.0 and parts == {"correct": 1.0, "code_tests": 1.0}
    assert is_correct(json.dumps({"code_tests": 1.0})) is True and is_correct(json.dumps({"code_tests": 0.5})) is False
    assert get_task("code").verify([(PROMPT, "x = 1", GOOD)]) == [None]  # a gold with no test: unscorable


def test_no_sandbox_refuses_the_stage_never_scores(monkeypatch):
    monkeypatch.setenv(ENV, SandboxCfg(bwrap="/nonexistent/bwrap").model_dump_json())
    s = Sample(GOOD, TESTS, "code", 10, 80, "stop", PROMPT)
    with pytest.raises(StageError, match="bwrap"):
        combine([s], specs_of([_spec("code_tests", 1.0, {})]))


def test_code_config_bounds_and_the_context_check(tiny):
    raw = _code_raw(tiny)
    assert parse_params(raw).task.kind == "code"
    raw["rollout"]["sampling"]["max_new_tokens"] = 120  # 35-char prompts + BOS + newline + 120 > 128
    with pytest.raises(ConfigError, match="rollout.sampling.max_new_tokens"):
        parse_params(raw)
    raw = _code_raw(tiny)
    raw["reward"]["rewards"] = [{"name": "code_tests", "kwargs": {"mode": "most"}}]
    with pytest.raises(ConfigError, match=r"reward.rewards\[0\].kwargs.mode"):
        parse_params(raw)
    raw = _code_raw(tiny)
    raw["task"]["min_steps"] = 3
    with pytest.raises(ConfigError, match="task.min_steps"):
        parse_params(raw)


@pytest.mark.slow
def test_curate_sft_rollout_reward_on_the_code_task(tiny):
    """The stages on ``task.kind: code``: problems generated, demos rendered, completions run in the sandbox;
    the audit says why rewards were not full marks."""
    from stages import curate, reward, rollout, sft

    p = parse_params(_code_raw(tiny))
    outs = {m: mod.paths(p) for m, mod in {"curate": curate, "sft": sft, "rollout": rollout,
                                           "reward": reward}.items()}
    counts = curate.run(p, {}, outs["curate"][1])
    assert counts["sft"] == 100 and counts["train"] > 0
    import_base(p)
    sft.run(p, *outs["sft"])
    rollout.run(p, *outs["rollout"])
    res = reward.run(p, *outs["reward"])
    audit = json.loads((Path(p.paths.reward_report_dir) / "audit.json").read_text())
    assert res["samples"] == 32 and res["unscorable"] == 0
    assert sum(audit["why"].values()) == 32 - round(32 * audit["component_means"]["code_tests"])


def _spec(name: str, weight: float, kwargs: dict):
    from posttrain.config import RewardSpec

    return RewardSpec(name=name, weight=weight, kwargs=kwargs)


def _code_raw(tiny: dict) -> dict:
    raw = json.loads(json.dumps(tiny))
    raw["task"] = {"kind": "code", "min_steps": 1, "max_steps": 2}
    raw["curate"]["sources"][0]["name"] = "code"
    raw["reward"]["rewards"] = [{"name": "correct", "weight": 1.0},
                                {"name": "code_tests", "weight": 0.0, "kwargs": {"mode": "fraction"}}]
    for sec in ("rollout", "rl", "evaluate"):
        raw[sec]["sampling"]["max_new_tokens"] = 80
    raw["distill"]["max_new_tokens"] = 80
    return raw
