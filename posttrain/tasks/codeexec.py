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
``abs``: the tests keep the harness's and the builtins), calling its verdict function through ``__main__``, a late
verdict from ``atexit``, an ``__eq__`` that always says yes, reading the expected value from the test's bytecode,
scanning memory for the nonce (its own, or its parent's through ``/proc``), extra "tests" or a float ``passed``.
What it costs: a second interpreter start per completion, and tests see the solution's results by value (a test
that checks an argument mutated in place, or calls a method of a returned object, fails: HumanEval and the
synthetic task have none).

Sandbox settings: ``sandbox:`` of params.yaml reaches every process of a stage (reward workers included) through
the environment (``config.sandbox.from_env``; the runner sets it); without it, the defaults.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.config.sandbox import SandboxCfg, from_env
from posttrain.tasks import code

HARNESS = r'''
import builtins, ctypes, json, os, subprocess, sys
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: no reading this process's memory or fds
    os._exit(126)
_nonce = sys.stdin.readline().strip()
_out = os.fdopen(os.dup(1), "w")
_tests = [(compile(src, "tests.py", "exec"), is_test) for src, is_test in json.load(open("tests.json"))]
os.remove("tests.json")  # the solution's process cannot read the expected values
_total = sum(t for _, t in _tests)
def _verdict(stage, passed, why):
    _out.write("\n" + _nonce + " " + json.dumps({"stage": stage, "passed": passed, "total": _total, "why": why}) + "\n")
    _out.flush()
exec(open("codec.py").read())
_req_r, _req_w = os.pipe()
_ret_r, _ret_w = os.pipe()
_sol = subprocess.Popen([sys.executable, "-E", "-s", "-B", "runner.py", str(_req_r), str(_ret_w)],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        pass_fds=(_req_r, _ret_w))
os.close(_req_r); os.close(_ret_w)
_to, _from = os.fdopen(_req_w, "w"), os.fdopen(_ret_r, "r")
class SolutionRaised(Exception):
    pass
def _ask(msg):
    try:
        _to.write(json.dumps(msg) + "\n"); _to.flush()
        line = _from.readline()
        if line:
            return json.loads(line)
    except (OSError, ValueError):
        pass
    return {"raise": "timeout" if _sol.wait() in (-9, -24) else "exited"}  # SIGKILL / SIGXCPU: a CPU limit
def _proxy(name):
    def call(*args, **kwargs):
        r = _ask({"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)})
        if not isinstance(r, dict) or "value" not in r:
            raise SolutionRaised(str(r.get("raise", "malformed")) if isinstance(r, dict) else "malformed")
        return decode(r["value"])
    call.__name__ = name
    return call
_hello = _ask({"hello": True})
if not isinstance(_hello, dict) or "names" not in _hello or not isinstance(_hello["names"], dict):
    stage = _hello.get("stage") if isinstance(_hello, dict) and _hello.get("stage") in ("parse", "run") else "run"
    why = _hello.get("raise") if isinstance(_hello, dict) else None
    _verdict(stage, 0, str(why)[:80] if why else "no answer")
    raise SystemExit(0)
_g = {"__name__": "tests", "_eq": lambda got, want, _t=type: _t(got) is _t(want) and got == want}
for _n, _v in _hello["names"].items():  # never over the harness's own names or a builtin the tests use
    if isinstance(_n, str) and _n.isidentifier() and _n not in _g and not hasattr(builtins, _n):
        _g[_n] = _proxy(_n) if _v == "callable" else decode(_v)
_passed, _first = 0, None
for _c, _is_test in _tests:
    try:
        exec(_c, _g)
        _passed += _is_test
    except BaseException as e:
        _first = _first or (str(e)[:80] if isinstance(e, SolutionRaised) else type(e).__name__)
_verdict("tests", _passed, _first)
'''

RUNNER = r'''
import json, os, sys
_req, _ret = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
exec(open("codec.py").read())
def _send(m):
    _ret.write(json.dumps(m) + "\n")
    _ret.flush()
_req.readline()  # hello
try:
    _code = compile(open("solution.py").read(), "solution.py", "exec")
except BaseException as e:
    _send({"stage": "parse", "raise": type(e).__name__})
    raise SystemExit(0)
_g = {"__name__": "solution"}
try:
    exec(_code, _g)
except BaseException as e:
    _send({"stage": "run", "raise": type(e).__name__})
    raise SystemExit(0)
_send({"names": {k: "callable" if callable(v) else encode(v) for k, v in list(_g.items()) if not k.startswith("__")}})
for _line in _req:
    _m = json.loads(_line)
    try:
        _v = _g[_m["call"]](*decode(_m["args"]), **decode(_m["kwargs"]))
        _send({"value": encode(_v)})
    except BaseException as e:
        _send({"raise": type(e).__name__})
'''

CODEC = r'''
class Opaque:
    """A value that is not plain data (an object of the solution's own class, a module, a function): equal to
    nothing, so no test that compares it passes."""
    def __init__(self, name):
        self.name = name
    def __eq__(self, other):
        return False
    def __ne__(self, other):
        return True
    def __hash__(self):
        return id(self)
    def __repr__(self):
        return "<" + self.name + ">"
_SEQ = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_SEQ_OF = {v: k for k, v in _SEQ.items()}
def encode(v, _d=0):
    t = type(v)
    try:
        if _d > 64:
            return {"o": "too deep"}
        if v is None:
            return None
        if t is bool:
            return {"b": v}
        if t is int:
            return {"i": str(v)}
        if t is float:
            return {"f": repr(v)}
        if t is str:
            return {"s": v}
        if t in _SEQ:
            return {_SEQ[t]: [encode(x, _d + 1) for x in v]}
        if t is dict:
            return {"d": [[encode(k, _d + 1), encode(x, _d + 1)] for k, x in v.items()]}
        if t is bytes:
            return {"y": v.hex()}
        if t is complex:
            return {"c": [repr(v.real), repr(v.imag)]}
    except Exception:
        return {"o": "unencodable " + t.__name__}
    return {"o": t.__name__}
def decode(v, _d=0):
    if v is None:
        return None
    try:
        (k, x), = v.items()
        if _d > 64:
            return Opaque("too deep")
        if k == "b" and type(x) is bool:
            return x
        if k == "i" and type(x) is str and len(x) <= 5000:
            return int(x)
        if k == "f" and type(x) is str:
            return float(x)
        if k == "s" and type(x) is str:
            return x
        if k in _SEQ_OF and type(x) is list:
            return _SEQ_OF[k](decode(e, _d + 1) for e in x)
        if k == "d" and type(x) is list:
            return {decode(a, _d + 1): decode(b, _d + 1) for a, b in x}
        if k == "y" and type(x) is str:
            return bytes.fromhex(x)
        if k == "c" and type(x) is list:
            return complex(float(x[0]), float(x[1]))
        if k == "o":
            return Opaque(str(x)[:40])
    except Exception:
        pass
    return Opaque("malformed")
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
                                                            "tests.json": json.dumps(stmts), "runner.py": RUNNER,
                                                            "codec.py": CODEC})
    lines = [line for line in r.stdout.splitlines() if line.startswith(nonce + " ")]
    if len(lines) != 1:
        return Verdict(0, total, r.status if r.status != "ok" and not lines else "no verdict" if not lines
                       else "malformed verdict")
    return _read_verdict(lines[0][len(nonce) + 1 :], total)


_STAGES = ("parse", "run", "tests")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
    why = _CONTROL.sub("", why)[:80] if why else None
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
