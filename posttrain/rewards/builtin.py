"""The built-in rewards (the ``REWARDS`` registry), picked by name in ``params.yaml``, and ``Sample``.

One signature, batched: ``fn(samples: Sequence[Sample], **kwargs) -> Sequence[float | Scored | None]``, one value
per sample, in order (a model reward scores a whole batch in one forward). A value may be :class:`Scored` (the
value and why it is not full marks), or an ``Exception`` instance: that sample's component failed (``combine``
records it as if the reward had raised for that sample alone). ``None`` means *unscorable* (e.g. the gold
answer cannot be parsed): such a sample is counted and kept out of the update, never given a free reward.
Functions are module-level (picklable, so a process pool can run them; math-verify must not run in a
non-main thread). A reward written for one sample is decorated with :func:`per_sample`, which keeps its body
as it is (the built-ins here, and any plug-in that likes).

Specs in params: ``reward.rewards: [{name: correct, weight: 1.0}, {name: format, weight: 0.1},
{name: overlong, weight: 1.0, kwargs: {buffer: 16}}]``. The total is the weighted sum; it is None when any
weighted component is None.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.errors import StageError
from posttrain.rewards.judge import llm_judge
from posttrain.rewards.learned import reward_model
from posttrain.rewards.sample import Sample, Scored
from posttrain.tasks import code, codeexec, get_task, mathfmt

Value = float | Scored | None
BatchReward = Callable[..., Sequence[Value | Exception]]  # fn(samples, **kwargs) -> one value per sample


def per_sample(fn: Callable[..., Value]) -> BatchReward:
    """A one-sample reward ``fn(s, **kwargs)`` as a batch reward ``fn(samples, **kwargs)``: called once per sample;
    a sample for which it raises gets the exception as its value (that sample alone is unscorable, the error
    kept), except ``StageError``, which stops the stage. The result keeps ``fn``'s name, module and signature
    (picklable by reference; the plug-in check reads its kwargs)."""

    @functools.wraps(fn)
    def batch(samples: Sequence[Sample], **kwargs: Any) -> list[Value | Exception]:
        out: list[Value | Exception] = []
        for s in samples:
            try:
                out.append(fn(s, **kwargs))
            except StageError:
                raise
            except Exception as e:  # (recorded by combine as "<name> raised <type>", for this sample alone)
                out.append(e)
        return out

    return batch


@per_sample
def correct(s: Sample) -> float | None:
    """1.0 / 0.0 by the task's own verifier (exact integer for ``arith``; math-verify for ``math``; every test
    passing in the sandbox for ``code``)."""
    ok = get_task(s.task).verify([(s.prompt, s.answer, s.completion)])[0]
    return None if ok is None else float(ok)


@per_sample
def code_tests(s: Sample, mode: str = "all") -> Scored:
    """Run the completion against the gold tests in the sandbox (``posttrain.tasks.codeexec``): ``all`` 1.0 when
    every test passes, else 0.0; ``fraction``: the share of tests passed. A completion that does not parse,
    raises, times out or breaks a limit passes nothing; why is kept (``parse: SyntaxError``, ``timeout``, ...).
    None when the gold holds no test. Execution-verified rewards as in CodeRL / PRLCoder / DeepSeek-R1's code."""
    if not code.gold_ok(s.answer):
        return Scored(None, "gold has no test")
    v = codeexec.run_tests(s.prompt, s.completion, s.answer)
    return Scored(float(v.all_passed) if mode == "all" else v.fraction, v.why)


@per_sample
def math_verify(s: Sample) -> float | None:
    """1.0 / 0.0 by math-verify whatever the task (``verify(gold, pred)``); None if the gold is unparseable."""
    ok = mathfmt.verify(s.answer, s.completion)
    return None if ok is None else float(ok)


_ARITH_FORMAT = re.compile(r"(?:[^\n]*;)?answer: -?\d+")


@per_sample
def format_reward(s: Sample) -> float:
    """1.0 when the completion ends in exactly one well-formed final answer, else 0.0.

    ``arith``: the whole completion matches ``[<steps>;]answer: <int>``; ``math``: exactly one ``\\boxed{}``
    and the generation stopped at EOS (not cut off).
    """
    if s.task == "arith":
        return float(s.completion.count("answer:") == 1 and _ARITH_FORMAT.fullmatch(s.completion) is not None)
    return float(s.completion.count("\\boxed{") == 1 and s.finish_reason == "stop")


@per_sample
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


REWARDS: dict[str, BatchReward] = {
    "correct": correct,
    "math_verify": math_verify,
    "format": format_reward,
    "overlong": overlong,
    "code_tests": code_tests,
    "reward_model": reward_model,  # a batch reward: posttrain.rewards.learned
    "llm_judge": llm_judge,  # a batch reward: posttrain.rewards.judge
}
