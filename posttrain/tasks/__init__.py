"""Task definitions: how a problem is generated, rendered as a demonstration and verified.

``TASKS`` maps a task kind (``params.yaml: task.kind``, and the ``task`` column of every data row) to a
:class:`Task` of module-level functions (picklable, for process pools). ``ADAPTERS`` maps a source's
``format`` to the function that reads one of its rows, ``FORMAT_TASK`` the formats that imply a task.

``verify`` takes a batch of ``(prompt, gold, completion)``: the code task runs each completion's tests in the
sandbox, many at once; the string tasks check them one by one (``_each``).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.tasks import arith, code, codeexec, mathfmt

Check = tuple[str, str, str]  # (prompt, gold answer, completion)


@dataclass(frozen=True)
class Task:
    verify: Callable[[Sequence[Check]], list[bool | None]]  # correct? / None = unscorable, for each
    gold_ok: Callable[[str], bool]  # can this gold answer be scored at all?
    render: Callable[[str, str, str | None, str], str]  # (prompt, answer, solution, 'cot'|'direct') -> text
    extract: Callable[[str], str | None]  # completion -> its final answer as a string (for maj@k votes)
    guard: Callable[[str], str | None]  # completion -> why it can never earn reward (hedge, several answers...)
    generate: Callable[[random.Random, Any], tuple[str, str, str]] | None = None  # (rng, task cfg) -> problem
    answer_is_tests: bool = False  # the gold is test source (bounded by validation.max_tests_chars)
    # prompt -> (tool, argument) a tool-use SFT demo calls (then answers directly); None: no tool demo for the task
    tool_call: Callable[[str], tuple[str, str] | None] | None = None


def _each(verify: Callable[[str, str], bool | None], items: Sequence[Check]) -> list[bool | None]:
    return [verify(gold, completion) for _, gold, completion in items]


def _arith_problem(rng: random.Random, cfg: Any) -> tuple[str, str, str]:
    a, b = arith.sample_operands(rng, cfg.min_digits, cfg.max_digits, cfg.min_multiplier, cfg.max_multiplier)
    prompt, answer = arith.make_problem(a, b)
    return prompt, answer, arith.chain_of_thought(a, b)


TASKS: dict[str, Task] = {
    "arith": Task(verify=functools.partial(_each, arith.verify), gold_ok=arith.gold_ok, render=arith.render,
                  extract=arith.extract_answer, guard=arith.guard, generate=_arith_problem,
                  tool_call=arith.tool_call),
    "code": Task(verify=codeexec.verify_many, gold_ok=code.gold_ok, render=code.render, extract=code.extract,
                 guard=code.guard, generate=code.generate, answer_is_tests=True),
    "math": Task(verify=functools.partial(_each, mathfmt.verify), gold_ok=mathfmt.gold_ok, render=mathfmt.render,
                 extract=mathfmt.extract_answer, guard=mathfmt.guard),
}
ADAPTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {**mathfmt.ADAPTERS,
                                                                   "humaneval": code.from_humaneval}
FORMAT_TASK = {"humaneval": "code"}  # formats whose rows belong to one task whatever task.kind is


def get_task(kind: str) -> Task:
    try:
        return TASKS[kind]
    except KeyError:
        raise KeyError(f"unknown task {kind!r}; known: {sorted(TASKS)}") from None


def verify_all(items: Sequence[tuple[str, str, str, str]]) -> list[bool | None]:
    """``(task, prompt, gold, completion)`` of any tasks -> verdicts in order: one ``verify`` call per task."""
    out: list[bool | None] = [None] * len(items)
    for kind in dict.fromkeys(t for t, *_ in items):
        idx = [i for i, it in enumerate(items) if it[0] == kind]
        for i, v in zip(idx, get_task(kind).verify([items[i][1:] for i in idx]), strict=True):
            out[i] = v
    return out
