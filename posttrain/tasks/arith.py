"""The embedded synthetic task: multi-digit x one-digit multiplication with a verifiable answer.

A problem is the prompt ``4738*7=``. Its chain of thought works right to left, one digit per step,
writing ``digit*b+carry=product`` and the answer digits found so far, then ``answer: <n>``::

    8*7+0=56 6;3*7+5=26 66;7*7+2=51 166;4*7+5=33 33166;answer: 33166

The bare-answer form is just ``answer: 33166``. The verifier is an exact integer comparison of the
last ``answer:`` in the completion with the gold answer.
"""

from __future__ import annotations

import random
import re

ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")


def make_problem(a: int, b: int) -> tuple[str, str]:
    """Return ``(prompt, answer)`` for ``a*b``."""
    return f"{a}*{b}=", str(a * b)


def chain_of_thought(a: int, b: int) -> str:
    """The carry-by-carry solution of ``a*b`` ending in ``answer: <a*b>`` (see module docstring)."""
    digits = [int(c) for c in reversed(str(a))]
    carry, written, steps = 0, "", []
    for i, d in enumerate(digits):
        prod = d * b + carry
        last = i == len(digits) - 1
        written = (str(prod) if last else str(prod % 10)) + written
        steps.append(f"{d}*{b}+{carry}={prod} {written}")
        carry = prod // 10
    return ";".join(steps) + f";answer: {a * b}"


def parse_prompt(prompt: str) -> tuple[int, int] | None:
    """``'4738*7='`` -> ``(4738, 7)``; None if the prompt is not of this task."""
    m = re.fullmatch(r"\s*(\d+)\*(\d)=\s*", prompt)
    return (int(m.group(1)), int(m.group(2))) if m else None


def sample_operands(
    rng: random.Random, min_digits: int, max_digits: int, min_mult: int, max_mult: int
) -> tuple[int, int]:
    """Digit count uniform in [min_digits, max_digits], then ``a`` uniform among numbers of that length."""
    d = rng.randint(min_digits, max_digits)
    lo = 10 ** (d - 1) if d > 1 else 0
    return rng.randint(lo, 10**d - 1), rng.randint(min_mult, max_mult)


def extract_answer(completion: str) -> str | None:
    """The integer after the last ``answer:`` in the completion, or None."""
    found = ANSWER_RE.findall(completion)
    return found[-1] if found else None


def gold_ok(answer: str) -> bool:
    return re.fullmatch(r"-?\d+", answer.strip()) is not None


def verify(gold: str, completion: str) -> bool | None:
    """True/False by exact integer match; None when the gold itself is not an integer (unscorable)."""
    if not gold_ok(gold):
        return None
    pred = extract_answer(completion)
    return pred is not None and int(pred) == int(gold.strip())


def render(prompt: str, answer: str, solution: str | None, style: str) -> str:
    """The demonstration completion: ``cot`` (full solution) or ``direct`` (bare answer)."""
    if style == "direct":
        return f"answer: {answer}"
    if solution:
        return solution
    ops = parse_prompt(prompt)
    if ops is None:
        raise ValueError(f"not an arith prompt: {prompt!r}")
    return chain_of_thought(*ops)
