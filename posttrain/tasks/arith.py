"""The embedded synthetic task: multi-digit x one-digit multiplication with a verifiable answer.

A problem is the prompt ``4738*7=``. Its chain of thought works right to left, one digit per step,
writing ``digit*b+carry=product`` and the answer digits found so far, then ``answer: <n>``::

    8*7+0=56 6;3*7+5=26 66;7*7+2=51 166;4*7+5=33 33166;answer: 33166

The bare-answer form is just ``answer: 33166``. The verifier is an exact integer comparison of the
completion's one final answer with the gold answer. It cannot be gamed: a completion earns nothing when
a guard (``guard``) fires: no ``answer:``, several of them, anything but the integer after it (hedges such as
``answer: 33166 or 33167``, intervals, lists), or an absurdly long number.
"""

from __future__ import annotations

import random
import re


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


FINAL_RE = re.compile(r"answer:[ \t]*(-?\d+)[ \t]*\.?\s*\Z")  # the completion ends with its one answer
MAX_DIGITS = 100  # a longer "number" is an attack on int() (Python refuses > 4300 digits), not an answer
GUARDS = ("no_answer", "several_answers", "not_final", "pathological")


def guard(completion: str) -> str | None:
    """Why the completion cannot earn reward whatever the gold (one of ``GUARDS``), or None if it can."""
    n = completion.count("answer:")
    if n == 0:
        return "no_answer"
    if n > 1:
        return "several_answers"  # e.g. a correct answer followed by a different final one
    m = FINAL_RE.search(completion)
    if m is None:
        return "not_final"  # text after the integer: a hedge, an interval, a list, a claim
    if len(m.group(1).lstrip("-")) > MAX_DIGITS:
        return "pathological"
    return None


def _canon(n: str) -> str:
    """Integer string without leading zeros ('-007' -> '-7'); string compare avoids int()'s digit limit."""
    sign = "-" if n.startswith("-") else ""
    digits = n.lstrip("-").lstrip("0") or "0"
    return "0" if digits == "0" else sign + digits


def extract_answer(completion: str) -> str | None:
    """The completion's final answer (the integer ending it), or None when a guard fires."""
    if guard(completion) is not None:
        return None
    m = FINAL_RE.search(completion)
    return _canon(m.group(1)) if m else None


def gold_ok(answer: str) -> bool:
    return re.fullmatch(r"-?\d+", answer.strip()) is not None


def verify(gold: str, completion: str) -> bool | None:
    """True/False by exact integer match of the one final answer; None when the gold itself is not an
    integer (unscorable). Guarded completions are False."""
    if not gold_ok(gold):
        return None
    pred = extract_answer(completion)
    return pred is not None and pred == _canon(gold.strip())


def tool_call(prompt: str) -> tuple[str, str] | None:
    """The calculator call a tool-use demo makes for ``prompt``: ``'4738*7='`` -> ``('calc', '4738*7')``."""
    ops = parse_prompt(prompt)
    return None if ops is None else ("calc", f"{ops[0]}*{ops[1]}")


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
