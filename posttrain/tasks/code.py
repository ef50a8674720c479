"""The code task: write a Python function; the gold answer is its tests, run in the sandbox (:mod:`.codeexec`).

**A problem** is ``prompt`` (the start of a program, ending in the function's ``def`` line or docstring) and
``answer`` (test source: every top-level ``assert`` and bare call is one test; other statements, such as
HumanEval's ``def check(candidate)``, are set-up). The program run is the prompt, a newline and the completion
(a fenced code block in the completion replaces the completion: a chat model that rewrites the whole function
redefines the prompt's one; see :func:`program`).

**The synthetic task** (``task.kind: code``), generated in-pipeline like the arithmetic one: a list pipeline
named in the prompt's comment, a few filter / map steps then one reduction::

    def f(a): # odd, add 3, sum
     a=[x for x in a if x%2]
     a=[x+3 for x in a]
     return sum(a)

That is the ``cot`` demonstration (one line per step); ``direct`` is one expression
(`` return sum([x+3 for x in [x for x in a if x%2]])``). Both are correct, as is any other program that passes
the tests: the reward is execution, never a string match. Difficulty: ``task.min_steps..max_steps`` steps
before the reduction, each drawn uniformly from every filter and map with every constant up to
``task.max_const``. Tests: ``task.num_tests`` distinct asserts on seeded random non-empty lists, comparing
through ``_eq`` (type and value, so an object whose ``__eq__`` always says yes does not pass; the harness
defines it). Everything fits the tiny model's character context (``CodeTask.max_prompt_chars``).

**HumanEval** (``format: humaneval`` of a benchmark or source): ``prompt`` as shipped, ``answer`` = its
``test`` plus ``check(<entry_point>)``, ``solution`` = the canonical body.
"""

from __future__ import annotations

import ast
import functools
import random
import re
from typing import Any

# Steps: name in the prompt -> (kind, code). ``K`` is replaced by the step's constant.
FILTERS = {"odd": "x%2", "even": "x%2==0", "pos": "x>0", "neg": "x<0", "over K": "x>K", "under K": "x<K"}
MAPS = {"square": "x*x", "double": "2*x", "negate": "-x", "add K": "x+K", "sub K": "x-K", "times K": "x*K"}
REDUCTIONS = {"sum": "sum(E)", "max": "max(E,default=0)", "min": "min(E,default=0)", "count": "len(E)",
              "list": "E"}
_FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.S)


@functools.cache
def steps_of(max_const: int) -> tuple[tuple[str, str, str], ...]:
    """Every step as (name, 'filter' | 'map', code of the condition / element expression), constants 0..max_const
    (2.. for ``times``): a problem's steps are drawn uniformly from these."""
    out = []
    for kind, table in (("filter", FILTERS), ("map", MAPS)):
        for name, c in table.items():
            ks = [str(k) for k in range(2 if name == "times K" else 0, max_const + 1)] if "K" in name else [""]
            out += [(name.replace("K", k), kind, c.replace("K", k)) for k in ks]
    return tuple(out)


def generate(rng: random.Random, cfg: Any) -> tuple[str, str, str]:
    """One problem ``(prompt, tests, cot solution)`` of the synthetic task under ``cfg`` (``config.CodeTask``)."""
    steps = [rng.choice(steps_of(cfg.max_const)) for _ in range(rng.randint(cfg.min_steps, cfg.max_steps))]
    red = rng.choice(list(REDUCTIONS))
    lim = cfg.max_const + 1  # list elements in [-lim, lim]: every step's constant can split them
    prompt = f"def f(a): # {', '.join([s[0] for s in steps] + [red])}"
    fn = _function(steps, red)
    tests: list[str] = []
    for _ in range(100 * cfg.num_tests):  # distinct tests on non-empty lists (an empty list rewards `return 0`)
        xs = [rng.randint(-lim, lim) for _ in range(rng.randint(1, cfg.max_list))]
        t = f"assert _eq(f({_lst(xs)}),{_lst(fn(xs)) if red == 'list' else fn(xs)})"
        if t not in tests:
            tests.append(t)
        if len(tests) == cfg.num_tests:
            break
    return prompt, "\n".join(tests), render(prompt, "", None, "cot", steps=steps, red=red)


def _lst(xs: Any) -> str:
    return "[" + ",".join(map(str, xs)) + "]"


def _function(steps: list[tuple[str, str, str]], red: str) -> Any:
    """The reference implementation of a pipeline (the tests' expected values), in this process."""
    def fn(a: list[int]) -> Any:
        for _, kind, code in steps:
            a = [x for x in a if eval(code, {"x": x})] if kind == "filter" else [eval(code, {"x": x}) for x in a]
        return eval(REDUCTIONS[red].replace("E", "a"))
    return fn


def parse_prompt(prompt: str) -> tuple[list[tuple[str, str, str]], str] | None:
    """``'def f(a): # odd, add 3, sum'`` -> (steps, reduction); None if not a prompt of the synthetic task."""
    m = re.fullmatch(r"def f\(a\): # (.+)", prompt.strip())
    if m is None:
        return None
    *names, red = m.group(1).split(", ")
    if red not in REDUCTIONS:
        return None
    steps = []
    for n in names:
        word, _, k = n.partition(" ")
        key = f"{word} K" if k else word
        kind = "filter" if key in FILTERS else "map" if key in MAPS else None
        if kind is None or (k and not k.isdigit()):
            return None
        steps.append((n, kind, (FILTERS if kind == "filter" else MAPS)[key].replace("K", k)))
    return steps, red


def render(prompt: str, answer: str, solution: str | None, style: str, steps: Any = None, red: str | None = None
           ) -> str:
    """The demonstration completion. A problem of the synthetic task renders ``cot`` (a line per step) or
    ``direct`` (one expression), whatever ``solution`` it carries (curate stores the generator's ``cot`` one);
    any other problem renders its ``solution`` (HumanEval's canonical body) in both styles."""
    if steps is None:
        parsed = parse_prompt(prompt)
        if parsed is None:
            if solution:
                return solution
            raise ValueError(f"not a prompt of the synthetic code task, and no solution: {prompt[:60]!r}")
        steps, red = parsed
    assert red is not None
    if style == "direct":
        e = "a"
        for _, kind, code in steps:
            e = f"[x for x in {e} if {code}]" if kind == "filter" else f"[{code} for x in {e}]"
        return f" return {REDUCTIONS[red].replace('E', e)}"
    lines = [f" a=[x for x in a if {code}]" if kind == "filter" else f" a=[{code} for x in a]"
             for _, kind, code in steps]
    return "\n".join([*lines, f" return {REDUCTIONS[red].replace('E', 'a')}"])


def program(prompt: str, completion: str) -> str:
    """The source that is run: the prompt, a newline and the completion. A completion with a fenced code block
    runs that block instead, after the prompt when the prompt is a program on its own (HumanEval's: imports and
    a stub with its docstring, which the block redefines), alone when it is not (``def f(a): # ...``)."""
    m = _FENCE.search(completion)
    if m is None:
        return f"{prompt}\n{completion}\n"
    try:
        ast.parse(prompt)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return m.group(1)
    return f"{prompt}\n{m.group(1)}"


def tests_of(answer: str) -> list[tuple[str, bool]]:
    """The gold's top-level statements as ``(source, is_test)``: asserts and bare calls are tests.
    Raises SyntaxError when the gold is not Python."""
    return [(ast.unparse(s), isinstance(s, ast.Assert | ast.Expr)) for s in ast.parse(answer).body]


def gold_ok(answer: str) -> bool:
    """The gold parses and holds at least one test."""
    try:
        return any(t for _, t in tests_of(answer))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def extract(completion: str) -> str | None:
    """What maj@k votes on: the completion's code, normalised by ``ast`` (comments and spacing gone; a body
    parsed inside a dummy function); None when it does not parse."""
    code = _FENCE.search(completion)
    src = code.group(1) if code else completion
    for text in (src, "def _():\n" + src):
        try:
            return ast.unparse(ast.parse(text))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    return None


def guard(completion: str) -> str | None:
    """Why the completion can never earn reward before it is run: ``empty`` (no code at all). Everything
    else (does not parse, raises, fails a test, hits a limit) is found by running it: the reward's reasons."""
    return "empty" if not completion.strip() else None


def from_humaneval(row: dict[str, Any]) -> dict[str, Any]:
    """HumanEval ``{prompt, test, entry_point, canonical_solution}`` -> ``{prompt, answer, solution}``."""
    p, t, e = row.get("prompt"), row.get("test"), row.get("entry_point")
    if not all(isinstance(x, str) for x in (p, t, e)):
        raise ValueError("humaneval row needs string fields 'prompt', 'test' and 'entry_point'")
    if not str(e).isidentifier():
        raise ValueError(f"entry_point {e!r} is not an identifier")
    s = row.get("canonical_solution")
    return {"prompt": p, "answer": f"{t}\ncheck({e})\n", "solution": s if isinstance(s, str) else None}
