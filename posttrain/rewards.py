"""REWARDS registry: per-sample reward functions, picked by name in ``params.yaml``.

One signature: ``fn(s: Sample, **kwargs) -> float | None``. ``None`` means *unscorable* (e.g. the gold
answer cannot be parsed): such a sample is counted and kept out of the update, never given a free reward.
Functions are module-level (picklable, so a process pool can run them; math-verify must not run in a
non-main thread).

Specs in params: ``reward.rewards: [{name: correct, weight: 1.0}, {name: format, weight: 0.1},
{name: overlong, weight: 1.0, kwargs: {buffer: 16}}]``. The total is the weighted sum; it is None when any
weighted component is None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.tasks import get_task, mathfmt


@dataclass(frozen=True)
class Sample:
    """What a reward sees of one completion."""

    completion: str
    answer: str  # gold
    task: str  # key of posttrain.tasks.TASKS
    num_tokens: int
    max_new_tokens: int
    finish_reason: str = "stop"


def correct(s: Sample) -> float | None:
    """1.0 / 0.0 by the task's own verifier (exact integer for ``arith``; math-verify for ``math``)."""
    ok = get_task(s.task).verify(s.answer, s.completion)
    return None if ok is None else float(ok)


def math_verify(s: Sample) -> float | None:
    """1.0 / 0.0 by math-verify whatever the task (``verify(gold, pred)``); None if the gold is unparseable."""
    ok = mathfmt.verify(s.answer, s.completion)
    return None if ok is None else float(ok)


_ARITH_FORMAT = re.compile(r"(?:[^\n]*;)?answer: -?\d+")


def format_reward(s: Sample) -> float:
    """1.0 when the completion ends in exactly one well-formed final answer, else 0.0.

    ``arith``: the whole completion matches ``[<steps>;]answer: <int>``; ``math``: exactly one ``\\boxed{}``
    and the generation stopped at EOS (not cut off).
    """
    if s.task == "arith":
        return float(s.completion.count("answer:") == 1 and _ARITH_FORMAT.fullmatch(s.completion) is not None)
    return float(s.completion.count("\\boxed{") == 1 and s.finish_reason == "stop")


def overlong(s: Sample, buffer: int = 16) -> float:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), with L_max = max_new_tokens, L_cache = buffer.

    0 if len <= L_max - L_cache; (L_max - L_cache - len) / L_cache in the buffer zone; -1 beyond L_max
    (a completion cut at max_new_tokens has len == L_max, which the formula already maps to -1).
    """
    lmax, lcache, n = s.max_new_tokens, min(buffer, s.max_new_tokens), s.num_tokens
    if n <= lmax - lcache:
        return 0.0
    if n <= lmax:
        return (lmax - lcache - n) / lcache
    return -1.0


REWARDS: dict[str, Callable[..., float | None]] = {
    "correct": correct,
    "math_verify": math_verify,
    "format": format_reward,
    "overlong": overlong,
}


def combine(s: Sample, specs: Sequence[Any]) -> tuple[float | None, dict[str, float | None]]:
    """Weighted sum of the configured rewards, and each component (by name). None if any is None."""
    parts: dict[str, float | None] = {}
    total: float | None = 0.0
    for spec in specs:
        v = REWARDS[spec.name](s, **spec.kwargs)
        parts[spec.name] = v
        if spec.weight != 0:
            total = None if v is None or total is None else total + spec.weight * v
    return total, parts


def score_rows(rows: Sequence[dict[str, Any]], specs: Sequence[Any]) -> list[dict[str, Any]]:
    """Add ``reward`` (None = unscorable) and ``rewards`` (JSON of components) to rollout rows.

    The one scoring path: the reward stage and every RL step call this. Runs in the calling (main)
    thread, as math-verify requires.
    """
    out = []
    for r in rows:
        s = Sample(r["completion"], r["answer"], r["task"], len(r["token_ids"]), r["max_new_tokens"],
                   r["finish_reason"])
        total, parts = combine(s, specs)
        out.append({**r, "reward": total, "rewards": json.dumps(parts)})
    return out


def is_correct(rewards_json: str) -> bool | None:
    """Whether a scored sample is correct: its ``correct`` (else ``math_verify``) component is 1.0."""
    parts = json.loads(rewards_json)
    for key in ("correct", "math_verify"):
        if key in parts:
            return None if parts[key] is None else parts[key] == 1.0
    return None


def pass_rates(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-prompt pass rate over scorable samples (``schema.PASS_RATE_SCHEMA``), in first-seen order."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["prompt_id"], []).append(r)
    out = []
    for pid, group in by.items():
        verdicts = [is_correct(r["rewards"]) for r in group]
        scorable = [v for v in verdicts if v is not None]
        rewards = [r["reward"] for r in group if r["reward"] is not None]
        out.append({"prompt_id": pid, "n": len(group), "scorable": len(scorable), "n_correct": sum(scorable),
                    "pass_rate": sum(scorable) / len(scorable) if scorable else None,
                    "mean_reward": sum(rewards) / len(rewards) if rewards else None})
    return out
