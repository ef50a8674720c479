"""Scoring: a sample's weighted reward and its components; rows in, scored rows out; pass rates.

``combine`` is the one place a reward function is called (built-in by name, or a plug-in by
``package.module:function``). What a function cannot score is ``None`` and never a free reward: a function
that raises, or returns something that is not a finite number, scores ``None`` for that component, and the
reason is kept in the components' JSON under ``"error"`` (the reward audit counts them). A function that
raises ``StageError`` (``SandboxUnavailable``: code cannot be run safely here) stops the stage instead. A
function may return :class:`~posttrain.rewards.builtin.Scored` (value, why): the why is kept under
``"why"``. A pool that times out or loses a worker (``posttrain.rewards.pool``) records the same way.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from posttrain.config.plugins import is_plugin, load_reward
from posttrain.errors import StageError
from posttrain.rewards.builtin import REWARDS, Sample, Scored

ERROR_KEY = "error"  # in the components' JSON: why a sample (or one of its components) could not be scored
WHY_KEY = "why"  # in the components' JSON: {component: why it is not full marks}, for rewards that say (Scored)


class Spec(NamedTuple):
    """A reward spec as the workers get it (``config.RewardSpec`` minus pydantic): cheap to pickle."""

    name: str
    weight: float
    kwargs: dict[str, Any]


def specs_of(specs: Sequence[Any]) -> tuple[Spec, ...]:
    """``reward.rewards`` (or anything with ``name``, ``weight``, ``kwargs``) as plain ``Spec`` tuples."""
    return tuple(Spec(s.name, s.weight, dict(s.kwargs)) for s in specs)


@functools.cache
def resolve(name: str) -> Callable[..., Any]:
    """The function a spec names: a key of ``REWARDS``, or a plug-in ``package.module:function``."""
    return load_reward(name) if is_plugin(name) else REWARDS[name]


def _checked(name: str, v: Any) -> tuple[float | None, str | None]:
    """A reward function's return value as a float or None, and why it was refused (None when it was not)."""
    if v is None:
        return None, None
    if isinstance(v, numbers.Real):
        f = float(v)
        return (f, None) if math.isfinite(f) else (None, f"{name} returned {f}")
    return None, f"{name} returned {type(v).__name__}"


def combine(s: Sample, specs: Sequence[Any]) -> tuple[float | None, dict[str, Any]]:
    """Weighted sum of the configured rewards, and each component (by name). None if any weighted one is None.

    A component that raises or returns a non-number is None, and ``parts["error"]`` says which and why."""
    parts: dict[str, Any] = {}
    total: float | None = 0.0
    error = None
    notes: dict[str, str] = {}
    for spec in specs:
        try:
            got = resolve(spec.name)(s, **spec.kwargs)
            if isinstance(got, Scored):
                got, note = got
                if note is not None:
                    notes[spec.name] = note
            v, why = _checked(spec.name, got)
        except StageError:  # a refusal (no sandbox here: SandboxUnavailable): the stage stops with one line
            raise
        except Exception as e:  # a reward's bug must not end a run; it is counted and shown in the audit
            v, why = None, f"{spec.name} raised {type(e).__name__}"
        parts[spec.name] = v
        error = error or why
        if spec.weight != 0:
            total = None if v is None or total is None else total + spec.weight * v
    if error is not None:
        parts[ERROR_KEY] = error
    if notes:
        parts[WHY_KEY] = notes
    return total, parts


def failed(specs: Sequence[Any], why: str) -> tuple[None, dict[str, Any]]:
    """What a sample scores when it could not be scored at all (timeout, dead worker): None everywhere."""
    return None, {**{s.name: None for s in specs}, ERROR_KEY: why}


def sample_of(r: dict[str, Any]) -> Sample:
    """What a reward sees of a rollout row (``num_tokens``, when given, spares reading ``token_ids``)."""
    n = r["num_tokens"] if "num_tokens" in r else len(r["token_ids"])
    return Sample(r["completion"], r["answer"], r["task"], n, r["max_new_tokens"], r["finish_reason"],
                  r.get("prompt", ""), int(r.get("tool_calls") or 0))


def score_rows(rows: Sequence[dict[str, Any]], specs: Sequence[Any], pool: Any = None) -> list[dict[str, Any]]:
    """Add ``reward`` (None = unscorable) and ``rewards`` (JSON of components) to rollout rows.

    The one scoring path: the reward stage and every RL step call this. ``pool``: a
    ``posttrain.rewards.RewardPool`` (entered); None scores here, one sample at a time (in the calling
    thread, as math-verify requires). Either way the results are the same."""
    samples = [sample_of(r) for r in rows]
    scored = pool.score(samples, specs) if pool is not None else [combine(s, specs) for s in samples]
    return [{**r, "reward": total, "rewards": json.dumps(parts)} for r, (total, parts) in zip(rows, scored,
                                                                                           strict=True)]


def is_correct(rewards_json: str) -> bool | None:
    """Whether a scored sample is correct: its ``correct`` (else ``math_verify``, else ``code_tests``) component
    is 1.0."""
    parts = json.loads(rewards_json)
    for key in ("correct", "math_verify", "code_tests"):
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
