"""Running a completion against its tests in the sandbox, and reading back a verdict the completion cannot reach.

One sandbox (:mod:`posttrain.sandbox`) per completion, two processes in it that share nothing but a pair of pipes:

- the **harness** (``/scratch/main.py``, ``HARNESS``) reads a random nonce from stdin and the gold tests from
  ``tests.json`` (then deletes the file), makes itself non-dumpable (no ``/proc/<pid>/mem`` or ``fd`` of it from
  another process; ``ptrace`` and ``process_vm_readv`` are refused by the seccomp filter anyway), and starts
- the **solution** (``RUNNER``, a fresh interpreter: ``solution.py`` = prompt + completion, its stdout and stderr
  to /dev/null, its stdin closed), which runs the program and then answers calls: a name and arguments in, the
  return value out, both as *plain data* (``CODEC``: None, bool, int, float, str, bytes, complex, list, tuple,
  dict, set, frozenset, tagged by exact type; anything else, an object of the solution's own class included,
  becomes an ``Opaque`` value equal to nothing).

The harness runs every test statement itself, in its own namespace, where each name the solution defined is a
proxy that asks the solution process; the comparisons (``==``, ``_eq``, ``abs(x - y) < eps``) run in the harness
on the decoded values, never on an object the solution made. It writes one line ``<nonce> <json>`` (stage,
passed, total, first failure) to the sandbox's stdout, which the solution's process does not hold. The host
reads it strictly: ``passed`` an int in [0, total] over the host's own count of tests, a known stage; anything
else, or no line (killed, timed out, the harness killed by the solution), passes nothing (the minimum, never
unscorable). What this closes (tests/test_code_task.py): patching what the harness uses (``json.dumps``,
``builtins``, its comparison helper, its list of tests), shadowing a name the tests use (a top-level ``_eq`` or
``abs``, or a helper the prompt defines: the harness runs a prompt that is a program itself, HumanEval's, and takes
from the solution only the prompt's stubs and new names, never a builtin), a module left in ``/scratch`` for a
test's import (the harness's folder is off its path), calling its verdict function through ``__main__``, a late
verdict from ``atexit``, an ``__eq__`` that always says yes, reading the expected value from the test's bytecode,
scanning memory for the nonce, extra "tests" or a float ``passed``.
What it costs: a second interpreter start per completion, and tests see the solution's results by value (a test
that checks an argument mutated in place, or calls a method of a returned object, fails: HumanEval and the
synthetic task have none).

Sandbox settings: ``sandbox:`` of params.yaml reaches every process of a stage (reward workers included) through
the environment (``config.sandbox.from_env``; the runner sets it); without it, the defaults.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from posttrain.config.sandbox import SandboxCfg, from_env
from posttrain.tasks import code
from posttrain.text import printable

# the sandbox's programs (posttrain/tasks/sandboxed/), read once as text
_HERE = Path(__file__).with_name("sandboxed")
HARNESS, RUNNER, CODEC = ((_HERE / f"{n}.py").read_text() for n in ("harness", "runner", "codec"))


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
                                                            "tests.json": json.dumps(stmts), "runner.py": RUNNER,
                                                            "prompt.py": prompt,
                                                            "codec.py": CODEC})
    lines = [line for line in r.stdout.splitlines() if line.startswith(nonce + " ")]
    if len(lines) != 1:
        return Verdict(0, total, r.status if r.status != "ok" and not lines else "no verdict" if not lines
                       else "malformed verdict")
    return _read_verdict(lines[0][len(nonce) + 1 :], total)


_STAGES = ("parse", "run", "tests")


def _read_verdict(text: str, total: int) -> Verdict:
    """The harness's line, read strictly: a known stage, ``passed`` an int in [0, ``total``] (the host's own count
    of tests), ``why`` a short string; anything else passes nothing."""
    try:
        v = json.loads(text)
        stage, passed, why = v["stage"], v["passed"], v["why"]
    except (ValueError, TypeError, KeyError):
        return Verdict(0, total, "malformed verdict")
    if stage not in _STAGES or type(passed) is not int or not 0 <= passed <= total or v.get("total") != total \
            or not (why is None or isinstance(why, str)):
        return Verdict(0, total, "malformed verdict")
    why = printable(why)[:80] if why else None
    return Verdict(passed, total, None if passed == total else f"{stage}: {why}" if why else stage)


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
