"""Running a completion against its tests in the sandbox, and reading back a verdict that the completion cannot
forge by accident or by the common reward hacks.

One sandbox (:mod:`posttrain.sandbox`) per completion: a harness (``/scratch/main.py``) reads a random nonce from
stdin, then compiles and runs ``solution.py`` (prompt + completion) in a fresh namespace and each test statement
of ``tests.py`` in that namespace, catching everything (``BaseException``: ``exit()`` inside the completion is a
failure, not a pass), and writes one line ``<nonce> <json>`` to the real stdout at the end. Only that line
counts; a run without it (killed, timed out, ``os._exit``, closed stdout) passed nothing. What holds: printing a
fake verdict (the nonce is unknown to the completion's text), exiting early, raising ``SystemExit`` in a test,
objects whose ``__eq__`` always answers yes in the synthetic task (its tests compare through the harness's
``_eq``: exact type, then value). What does not: a completion that searches the harness's own frames or memory
for the nonce or rebinds names the tests use could forge a pass. The host is safe either way (the sandbox); the
*reward* is as trustworthy as in-process execution with these guards, like HumanEval's own harness.

Sandbox settings: ``sandbox:`` of params.yaml reaches every process of a stage (reward workers included) through
the environment (``config.sandbox.from_env``; the runner sets it); without it, the defaults.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.config.sandbox import SandboxCfg, from_env
from posttrain.tasks import code

HARNESS = r'''
import json, os, sys
_nonce = sys.stdin.readline().strip()
_out = os.fdopen(os.dup(1), "w")  # the verdict's own copy of stdout: closing sys.stdout does not hide it
def _verdict(**kw):
    _out.write("\n" + _nonce + " " + json.dumps(kw) + "\n")
    _out.flush()
def _why(e):
    return type(e).__name__
def _eq(got, want, _type=type):
    return _type(got) is _type(want) and got == want
_tests = [(compile(src, "tests.py", "exec"), is_test) for src, is_test in json.load(open("tests.json"))]
_total = sum(t for _, t in _tests)
_src = open("solution.py").read()
os.remove("tests.json")  # the completion cannot read the expected values
try:
    _code = compile(_src, "solution.py", "exec")
except BaseException as e:
    _verdict(stage="parse", passed=0, total=_total, why=_why(e))
    raise SystemExit(0)
_g = {"__name__": "solution"}
try:
    exec(_code, _g)
except BaseException as e:
    _verdict(stage="run", passed=0, total=_total, why=_why(e))
    raise SystemExit(0)
_g["_eq"] = _eq
_passed, _first = 0, None
for _c, _is_test in _tests:
    try:
        exec(_c, _g)
        _passed += _is_test
    except BaseException as e:
        _first = _first or _why(e)
_verdict(stage="tests", passed=_passed, total=_total, why=_first)
'''


@dataclass(frozen=True)
class Verdict:
    """What running one completion's tests gave: tests passed of ``total``, and why not all passed
    (``parse: SyntaxError``, ``run: NameError``, ``tests: AssertionError``: where and the exception's type; or
    the sandbox's status: ``timeout``, ``memory``, ``output_limit``, ``killed``, ``no verdict``)."""

    passed: int
    total: int
    why: str | None = None

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


@functools.cache
def _sandbox(cfg_json: str):  # noqa: ANN202 (a Sandbox: imported lazily, stages without code never load it)
    from posttrain.sandbox import Sandbox

    return Sandbox(SandboxCfg.model_validate_json(cfg_json))


def sandbox(cfg: SandboxCfg | None = None):  # noqa: ANN201
    """The process's sandbox under ``cfg`` (default: the stage's ``sandbox:`` from the environment), built once
    (construction probes bubblewrap and raises ``SandboxUnavailable`` where it cannot sandbox)."""
    return _sandbox((cfg or from_env()).model_dump_json())


def run_tests(prompt: str, completion: str, tests: str, cfg: SandboxCfg | None = None) -> Verdict:
    """Run ``prompt + completion`` against the gold ``tests`` in a fresh sandbox. Never raises for what the
    completion does; raises ``SandboxUnavailable`` where nothing can be sandboxed, ``ValueError`` for a gold
    that is not Python. The last verdicts are kept: the ``correct`` and ``code_tests`` rewards of one sample run
    it once."""
    return _run_tests(prompt, completion, tests, (cfg or from_env()).model_dump_json())


@functools.lru_cache(maxsize=256)
def _run_tests(prompt: str, completion: str, tests: str, cfg_json: str) -> Verdict:
    cfg = SandboxCfg.model_validate_json(cfg_json)
    try:
        stmts = code.tests_of(tests)
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"the gold tests do not parse: {type(e).__name__}") from None
    total = sum(t for _, t in stmts)
    nonce = secrets.token_hex(16)
    r = sandbox(cfg).run(HARNESS, stdin=nonce + "\n", files={"solution.py": code.program(prompt, completion),
                                                            "tests.json": json.dumps(stmts)})
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(nonce + " "):
            v = json.loads(line[len(nonce) + 1:])
            why = None if v["passed"] == total else f"{v['stage']}: {v['why']}" if v["why"] else v["stage"]
            return Verdict(int(v["passed"]), total, why)
    return Verdict(0, total, r.status if r.status != "ok" else "no verdict")


def run_many(items: Sequence[tuple[str, str, str]], cfg: SandboxCfg | None = None) -> list[Verdict]:
    """``run_tests`` of many ``(prompt, completion, tests)``, ``sandbox.workers`` at a time (threads: each run is
    its own process, see :mod:`posttrain.sandbox.pool`), in order."""
    from concurrent.futures import ThreadPoolExecutor

    c = cfg or from_env()
    sandbox(c)  # refuse before starting anything
    with ThreadPoolExecutor(c.workers) as ex:
        return list(ex.map(lambda it: run_tests(it[0], it[1], it[2], c), items))


def verify_many(items: Sequence[tuple[str, str, str]]) -> list[bool | None]:
    """The task's verifier: ``(prompt, gold tests, completion)`` -> every test passes; None when the gold
    holds no test (unscorable)."""
    out: list[bool | None] = [None] * len(items)
    todo = [i for i, (_, g, _) in enumerate(items) if code.gold_ok(g)]
    for i, v in zip(todo, run_many([(items[i][0], items[i][2], items[i][1]) for i in todo]), strict=True):
        out[i] = v.all_passed
    return out
