"""Throughput of the code verifier (``posttrain.tasks.codeexec``) on HumanEval's canonical solutions against their
own tests: the harness that runs the solution in its own process and compares by value (now) against the one it
replaced (``BEFORE``: the solution exec'd in the harness's own interpreter, which the completion could forge;
kept here verbatim only as the baseline), at ``sandbox.workers`` 2. Arms alternate within the run (now, before,
now, before, ...), every repeat is reported; each arm must pass all 164.

    python benchmarks/code_verifier.py --repeats 3   # prints a table, writes benchmarks/results/code_verifier.json

Needs humaneval.jsonl in ``$POSTTRAIN_BENCH`` (docs/real-models.md#benchmark-files).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from posttrain.config import SandboxCfg
from posttrain.tasks import code, codeexec

ROOT = Path(__file__).resolve().parents[1]
HUMANEVAL = Path(os.environ.get("POSTTRAIN_BENCH", ".")) / "humaneval.jsonl"

BEFORE = r'''
import json, os, sys
_nonce = sys.stdin.readline().strip()
_out = os.fdopen(os.dup(1), "w")
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
os.remove("tests.json")
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


def before(prompt: str, completion: str, tests: str, cfg: SandboxCfg) -> bool:
    """All tests passed, by the replaced harness (the baseline arm)."""
    stmts = code.tests_of(tests)
    nonce = secrets.token_hex(16)
    r = codeexec.sandbox(cfg).run(BEFORE, stdin=nonce + "\n", files={"solution.py": code.program(prompt, completion),
                                                                    "tests.json": json.dumps(stmts)})
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(nonce + " "):
            v = json.loads(line[len(nonce) + 1 :])
            return v["passed"] == sum(t for _, t in stmts)
    return False


def now(prompt: str, completion: str, tests: str, cfg: SandboxCfg) -> bool:
    codeexec._run_tests.cache_clear()  # no verdict from the cache: every repeat runs
    return codeexec.run_tests(prompt, completion, tests, cfg).all_passed


def arm(fn, items: list[tuple[str, str, str]], cfg: SandboxCfg) -> dict:
    with ThreadPoolExecutor(cfg.workers) as ex:
        t = time.perf_counter()
        ok = list(ex.map(lambda it: fn(*it, cfg), items))
        dt = time.perf_counter() - t
    return {"problems": len(items), "passed": sum(ok), "seconds": round(dt, 2),
            "problems_per_s": round(len(items) / dt, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "code_verifier.json")
    a = ap.parse_args()
    rows = [json.loads(x) for x in HUMANEVAL.read_text().splitlines()]
    items = [(r["prompt"], r["canonical_solution"], f"{r['test']}\ncheck({r['entry_point']})") for r in rows]
    cfg = SandboxCfg(workers=a.workers)
    runs: dict[str, list[dict]] = {"now": [], "before": []}
    for i in range(a.repeats):
        for name, fn in (("now", now), ("before", before)) if i % 2 == 0 else (("before", before), ("now", now)):
            runs[name].append(arm(fn, items, cfg))
            print(f"repeat {i} {name}: {runs[name][-1]}", flush=True)
    print("\n| arm | problems/s, every repeat | passed |\n|---|---|---:|")
    for name, rs in runs.items():
        print(f"| {name} | {', '.join(str(r['problems_per_s']) for r in rs)} | {rs[0]['passed']}/{rs[0]['problems']} |")
    ratios = [n["problems_per_s"] / b["problems_per_s"] for n, b in zip(runs["now"], runs["before"], strict=True)]
    print("now / before per repeat:", ", ".join(f"{r:.2f}" for r in ratios))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"settings": {"repeats": a.repeats, "workers": a.workers, "cpu": platform.processor()
                                              or platform.machine()}, "runs": runs,
                                 "ratio_now_over_before": [round(r, 3) for r in ratios]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
