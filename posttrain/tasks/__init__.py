"""Task definitions: how a problem's completion is rendered and verified.

``TASKS`` maps a task kind (``params.yaml: task.kind``, and the ``task`` column of every data row) to a
:class:`Task` of module-level functions (picklable, for process pools).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from posttrain.tasks import arith, mathfmt


@dataclass(frozen=True)
class Task:
    verify: Callable[[str, str], bool | None]  # (gold, completion) -> correct? / None = unscorable
    gold_ok: Callable[[str], bool]  # can this gold answer be scored at all?
    render: Callable[[str, str, str | None, str], str]  # (prompt, answer, solution, 'cot'|'direct') -> text
    extract: Callable[[str], str | None]  # completion -> its final answer as a string (for maj@k votes)
    guard: Callable[[str], str | None]  # completion -> why it can never earn reward (hedge, several answers...)


TASKS: dict[str, Task] = {
    "arith": Task(verify=arith.verify, gold_ok=arith.gold_ok, render=arith.render, extract=arith.extract_answer,
                  guard=arith.guard),
    "math": Task(verify=mathfmt.verify, gold_ok=mathfmt.gold_ok, render=mathfmt.render,
                 extract=mathfmt.extract_answer, guard=mathfmt.guard),
}


def get_task(kind: str) -> Task:
    try:
        return TASKS[kind]
    except KeyError:
        raise KeyError(f"unknown task {kind!r}; known: {sorted(TASKS)}") from None
