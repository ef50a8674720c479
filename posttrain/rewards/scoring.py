"""Scoring: a batch of samples' weighted rewards and their components; rows in, scored rows out; pass rates.

``combine`` is the one place a reward function is called (built-in by name, or a plug-in by
``package.module:function``): once per reward spec per batch, ``fn(samples, **kwargs)``, one value per sample.
A function that raises, or returns the wrong number of values, fails that component for the whole batch (each
sample None). What a function cannot score is ``None`` and never a free reward: a value that is not a finite
number (or an ``Exception``, which ``per_sample`` returns for a sample it raised on) scores ``None`` for that
sample's component, and the reason is kept in the components' JSON under ``"error"`` (the reward audit counts
them). A function that raises ``StageError`` (``SandboxUnavailable``: code cannot be run safely here) stops the
stage instead. A function may return :class:`~posttrain.rewards.builtin.Scored` (value, why): the why is kept under
``"why"``. A pool that times out or loses a worker (``posttrain.rewards.pool``) records the same way.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from posttrain.config.names import LEARNED_REWARDS
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


def warm(specs: Sequence[Spec]) -> None:
    """Prepare what each reward keeps per process (its function's ``warm(**kwargs)``: the reward model's
    weights), before the first batch. A failure is left for that batch's call to record, sample by sample."""
    for s in specs:
        try:  # (resolve too: a plug-in that fails to import here must not fail pebble's initializer, which would
            # end every worker and break the pool; its batch call records the error per sample instead)
            prepare = getattr(resolve(s.name), "warm", None)
            if prepare is not None:
                prepare(**s.kwargs)
        except Exception:  # noqa: S112
            continue


def is_learned(name: str) -> bool:
    """Whether a reward is a model's judgement rather than a verifier's (the audit's learned section): a
    ``LEARNED_REWARDS`` name, or a plug-in whose function sets ``learned = True``. A plug-in that does not import
    is not (its samples fail where it is called, each with the reason)."""
    if name in LEARNED_REWARDS:
        return True
    try:
        return bool(getattr(resolve(name), "learned", False))
    except Exception:
        return False


def _checked(name: str, v: Any) -> tuple[float | None, str | None, str | None]:
    """One value a reward function returned for one sample: the float (or None), why it was refused (None when it
    was not), and the reward's own note (``Scored``'s why)."""
    note = None
    if isinstance(v, Exception):  # (per_sample: the reward raised for this sample alone)
        return None, f"{name} raised {type(v).__name__}", None
    if isinstance(v, Scored):
        v, note = v
    if v is None:
        return None, None, note
    if isinstance(v, numbers.Real):
        f = float(v)
        return (f, None, note) if math.isfinite(f) else (None, f"{name} returned {f}", note)
    return None, f"{name} returned {type(v).__name__}", note


def _call(spec: Any, samples: Sequence[Sample]) -> list[tuple[float | None, str | None, str | None]]:
    """One reward function over a batch: each sample's (value, refusal, note). A function that raises, returns
    something that is not a sequence, or returns a sequence of the wrong length, fails the whole batch for that
    component (each sample None, the error kept); ``StageError`` stops the stage."""
    n = len(samples)
    try:
        got = resolve(spec.name)(samples, **spec.kwargs)
    except StageError:  # a refusal (no sandbox here: SandboxUnavailable): the stage stops with one line
        raise
    except Exception as e:  # a reward's bug must not end a run; it is counted and shown in the audit
        return [(None, f"{spec.name} raised {type(e).__name__}", None)] * n
    if isinstance(got, str | bytes | dict) or not hasattr(got, "__len__") or not hasattr(got, "__iter__"):
        return [(None, f"{spec.name} returned {type(got).__name__}, not one value per sample", None)] * n
    if len(got) != n:
        return [(None, f"{spec.name} returned {len(got)} values for {n} samples", None)] * n
    return [_checked(spec.name, v) for v in got]


def combine(samples: Sequence[Sample], specs: Sequence[Any]) -> list[tuple[float | None, dict[str, Any]]]:
    """Each sample's weighted sum of the configured rewards, and its components (by name): one call of each reward
    function for the whole batch. A total is None if any weighted component is None.

    A component that raises or returns a non-number is None, and ``parts["error"]`` says which and why."""
    out = []
    calls = [(spec, _call(spec, samples)) for spec in specs]
    for i in range(len(samples)):
        parts: dict[str, Any] = {}
        total: float | None = 0.0
        error = None
        notes: dict[str, str] = {}
        for spec, values in calls:
            v, why, note = values[i]
            if note is not None:
                notes[spec.name] = note
            parts[spec.name] = v
            error = error or why
            if spec.weight != 0:
                total = None if v is None or total is None else total + spec.weight * v
        if error is not None:
            parts[ERROR_KEY] = error
        if notes:
            parts[WHY_KEY] = notes
        out.append((total, parts))
    return out


def merge(a: tuple[float | None, dict[str, Any]], b: tuple[float | None, dict[str, Any]], order: Sequence[str]
          ) -> tuple[float | None, dict[str, Any]]:
    """One sample's ``combine`` over two disjoint sets of specs, as one ``combine`` over both: totals summed
    (None if either is), components in ``order`` (the specs' names), the first error, the notes of both."""
    (ta, pa), (tb, pb) = a, b
    parts: dict[str, Any] = {n: pa[n] if n in pa else pb.get(n) for n in order}
    error = pa.get(ERROR_KEY) or pb.get(ERROR_KEY)
    if error is not None:
        parts[ERROR_KEY] = error
    notes = {**pa.get(WHY_KEY, {}), **pb.get(WHY_KEY, {})}
    if notes:
        parts[WHY_KEY] = notes
    return (None if ta is None or tb is None else ta + tb), parts


def failed(specs: Sequence[Any], why: str) -> tuple[None, dict[str, Any]]:
    """What a sample scores when it could not be scored at all (timeout, dead worker): None everywhere."""
    return None, {**{s.name: None for s in specs}, ERROR_KEY: why}


def sample_of(r: dict[str, Any]) -> Sample:
    """What a reward sees of a rollout row (``num_tokens``, when given, spares reading ``token_ids``): of a
    multi-turn tool rollout, the model's turns and tokens alone (``model_text``, ``model_tokens``), never a
    tool's observation."""
    if r.get("model_text") is not None:
        text, n = r["model_text"], r["model_tokens"]
    else:
        text, n = r["completion"], r.get("num_tokens")
        n = len(r["token_ids"]) if n is None else n  # rows sampled in memory: their token ids
    return Sample(text, r["answer"], r["task"], n, r["max_new_tokens"], r["finish_reason"],
                  r.get("prompt", ""), int(r.get("tool_calls") or 0))


def score_rows(rows: Sequence[dict[str, Any]], specs: Sequence[Any], pool: Any = None) -> list[dict[str, Any]]:
    """Add ``reward`` (None = unscorable) and ``rewards`` (JSON of components) to rollout rows.

    The one scoring path: the reward stage and every RL step call this. ``pool``: a
    ``posttrain.rewards.RewardPool`` (entered); None scores here, the whole batch in one ``combine`` (in the
    calling thread, as math-verify requires). Either way the results are the same."""
    samples = [sample_of(r) for r in rows]
    scored = pool.score(samples, specs) if pool is not None else combine(samples, specs)
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
