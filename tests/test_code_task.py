"""The code task (posttrain/tasks/code.py, codeexec.py): the generator, the verdict harness against reward hacks,
the ``code_tests`` reward, HumanEval rows, and the stages on ``task.kind: code``. Skipped where bubblewrap
cannot sandbox (the refusal path runs everywhere)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import bench_file

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
    (" return 0\nimport os\nos._exit(0)", "run: exited"),  # the solution's process ends before any test
    (" return 0\nprint('\\nabc ' + FAKE)\nimport os\nos._exit(0)".replace("FAKE", repr(FAKE)),
     "run: exited"),  # a forged verdict line: the solution's stdout is not the verdict's
    (" return 0\nclass A:\n def __eq__(s, o): return True\ndef f(a): return A()",
     "tests: AssertionError"),  # an object equal to everything
    (" return 0\nimport json\nT = open('tests.json').read()\ndef f(a): return 0",
     "run: FileNotFoundError"),  # the expected values are out of reach
    (" while True: pass", "tests: timeout"),  # the solution's process past cpu_s
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
    rows = [json.loads(line) for line in bench_file("humaneval.jsonl").open()][:3]
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


MEMSCAN = r"""
import os, re
cands = set()
for line in open('/proc/self/maps'):
    a, perm = line.split()[:2]
    if 'rw' not in perm:
        continue
    lo, hi = (int(x, 16) for x in a.split('-'))
    try:
        with open('/proc/self/mem', 'rb') as m:
            m.seek(lo)
            cands.update(re.findall(rb'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])', m.read(min(hi - lo, 1 << 24))))
    except (OSError, ValueError, OverflowError):
        pass
for c in list(cands)[:200]:
    print('\n' + c.decode() + ' {"stage": "tests", "passed": 4, "total": 4, "why": null}', flush=True)
os._exit(0)
"""
# Completions that forge a verdict for a wrong solution (f returns 0, or reads the expected value), one or more per
# class of issue 49's finding 3; every one scored full marks against the harness that ran the solution in its own
# interpreter (watched: against the harness of 44954d7).
FORGERIES = {
    "json.dumps patched": " return 0\nimport json\n_d = json.dumps\njson.dumps = lambda kw, *a, **k: _d({**kw, "
                          "'passed': kw['total'], 'why': None}, *a, **k)",
    "the verdict function called": " return 0\nimport __main__, os\n__main__._verdict(stage='tests', "
                                   "passed=__main__._total, total=__main__._total, why=None)\nos._exit(0)",
    "builtins.exec patched": " return 0\nimport builtins\nbuiltins.exec = lambda *a, **k: None",
    "the comparison helper patched": " return 0\nimport __main__\n__main__._eq = lambda *a: True",
    "the list of tests replaced": " return 0\nimport __main__\n__main__._tests[:] = [(compile('pass', 't', 'exec'), "
                                  "True)] * __main__._total",
    "a late verdict from atexit": " return 0\nimport atexit, __main__\natexit.register(lambda: __main__._verdict("
                                  "stage='tests', passed=__main__._total, total=__main__._total, why=None))",
    "the expected value read from the test's bytecode":
        " import sys\n return [c for c in sys._getframe(1).f_code.co_consts if type(c) is int][-1]",
    "the nonce scanned in /proc/self/mem": " return 0\n" + MEMSCAN,
    "the comparison helper shadowed by a name": " return 0\ndef _eq(*a):\n return True",
    "the nonce found through gc": " return 0\nimport gc, os\nfor o in gc.get_objects():\n if getattr(o, '__name__', "
                                  "'') == '_verdict':\n  o(stage='tests', passed=4, total=4, why=None)\n  os._exit(0)",
}
OVERFLOWS = {  # fraction mode above 1, or a 0 turned into "unscorable"
    "extra passing tests": " return 0\nimport __main__\n__main__._tests += [(compile('pass', 't', 'exec'), True)] * 12",
    "a float passed": " return 0\nimport json\n_d = json.dumps\njson.dumps = lambda kw, *a, **k: _d({**kw, "
                      "'passed': 1e9}, *a, **k)",
    "a malformed verdict": " return 0\nimport json\n_d = json.dumps\njson.dumps = lambda kw, *a, **k: _d({**kw, "
                           "'passed': 'all'}, *a, **k)",
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_completion_cannot_forge_its_verdict(name):
    """Issue 49, finding 3: the harness exec'd the solution in the interpreter that then wrote the verdict, so these
    gave full marks to a function that returns 0 (or reads the answer out of the test). The solution now runs in its
    own process and answers calls by value; the harness compares and writes the verdict: at most the 1 of 4 that
    ``return 0`` honestly passes (f([2]) == 0)."""
    v = codeexec.run_tests(PROMPT, FORGERIES[name], TESTS, FAST)
    assert v.passed <= 1 and not v.all_passed, (name, v)


def test_a_builtin_the_tests_use_is_the_harness_own_not_the_solution_one():
    """A solution defining ``abs`` (or ``max``, ``sorted``...) at top level: the tests' ``abs`` stays the builtin.
    Before, every name the solution defined was bound into the tests' namespace, so ``def abs(x): return 0``
    passed ``assert abs(candidate(2.0) - 4.0) < 1e-6`` with a wrong candidate (watched: 1 of 1)."""
    prompt, tests = "def sq(x):\n", "def check(candidate):\n    assert abs(candidate(2.0) - 4.0) < 1e-6\ncheck(sq)\n"
    assert codeexec.run_tests(prompt, "    return 0.0\ndef abs(x):\n    return 0\n", tests, FAST).passed == 0
    assert codeexec.run_tests(prompt, "    return x * x\ndef abs(x):\n    return 0\n", tests, FAST).all_passed


def test_a_module_the_solution_writes_never_runs_in_the_harness():
    """Review: /scratch (writable by the solution) was first on the harness's import path, so a wrong function
    that wrote random.py calling ``__main__._verdict`` passed any test that imports random (HumanEval 32, 38, 50,
    53 do; watched: 1 of 1). The harness takes its own folder off the path before the solution runs."""
    prompt = "def sq(x):\n"
    tests = "def check(candidate):\n    import random\n    assert candidate(2) == 4\ncheck(sq)\n"
    plant = ("    return 0\nopen('random.py', 'w').write('import sys\\nm = sys.modules[\"__main__\"]\\n"
             "m._verdict(\"tests\", m._total, None)\\nm.os._exit(0)\\n')\n")
    assert codeexec.run_tests(prompt, plant, tests, FAST).passed == 0
    assert codeexec.run_tests(prompt, "    return x * x\n", tests, FAST).all_passed


def test_a_helper_the_prompt_defines_stays_the_prompts():
    """Review: HumanEval's tests call helpers its prompt defines (``poly`` in 32, ``encode_cyclic`` in 38); a
    completion redefining them passed with a wrong entry point (watched: 1 of 1). The prompt, when it is a program,
    runs in the harness; only its stubs (a docstring, ``pass`` or ``...`` for a body) take the solution's."""
    prompt = 'def helper(x):\n    return x + 1\n\n\ndef sq(x):\n    """x squared"""\n'
    tests = "def check(candidate):\n    assert helper(candidate(3)) == 10\ncheck(sq)\n"
    forged = "    return 0\n\n\ndef helper(x):\n    return 10\n"
    assert codeexec.run_tests(prompt, forged, tests, FAST).passed == 0
    assert codeexec.run_tests(prompt, "    return x * x\n\n\ndef helper(x):\n    return 10\n", tests, FAST).passed == 1


@pytest.mark.parametrize("name", list(OVERFLOWS))
def test_fraction_stays_in_0_1_and_a_bad_verdict_scores_the_minimum(name):
    """``fraction`` mode scored far above 1 (extra always-passing tests, a float ``passed``) and a malformed verdict
    made a 0 unscorable; now what ``return 0`` honestly earns, 1 of 4 = 0.25 (passed is the harness's own count,
    read strictly by the host), or 0.0."""
    [r] = combine([Sample(OVERFLOWS[name], TESTS, "code", 10, 80, "stop", PROMPT)],
                  specs_of([_spec("code_tests", 1.0, {"mode": "fraction"})]))
    assert r[0] is not None and 0.0 <= r[0] <= 0.25, (name, r)


@pytest.mark.parametrize("line,why", [
    ('{"stage": "tests", "passed": 5, "total": 4, "why": null}', "malformed verdict"),
    ('{"stage": "tests", "passed": 4.0, "total": 4, "why": null}', "malformed verdict"),
    ('{"stage": "tests", "passed": true, "total": 4, "why": null}', "malformed verdict"),
    ('{"stage": "other", "passed": 4, "total": 4, "why": null}', "malformed verdict"),
    ('{"stage": "tests", "passed": 4, "total": 9, "why": null}', "malformed verdict"),
    ('{"stage": "tests", "passed": 4}', "malformed verdict"),
    ("not json", "malformed verdict"),
    ('{"stage": "tests", "passed": 1, "total": 4, "why": "Assertion\\u001b[2KError\\n"}', "tests: Assertion[2KError"),
])
def test_the_host_reads_the_verdict_strictly(line, why):
    v = codeexec._read_verdict(line, 4)
    assert v.why == why and v.passed in (0, 1)
