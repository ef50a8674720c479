"""Math word-problem formats (GSM8K, MATH/AIME) and a ``math-verify`` based verifier.

``verify(gold, completion)`` wraps ``math_verify.verify(gold, pred)`` so the argument order cannot be
swapped by a caller, parses the gold once (cached), and returns None (unscorable) when the gold has no
parseable answer: an unparseable gold is never counted as correct. Call it from the main thread or a
process pool: math-verify's timeouts use signals (see ARCHITECTURE.md).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
from math_verify import verify as _mv_verify

# Predictions are read only at an anchor (\\boxed{}, "the answer is", "final answer:"): math-verify's default
# also takes any bare number, so a completion that merely echoes the question's numbers would score.
# Several boxed answers parse as a set, which never equals a single gold: hedging earns nothing.
PRED_CONFIG = [LatexExtractionConfig(try_extract_without_anchor=False),
               ExprExtractionConfig(try_extract_without_anchor=False)]

_CALC_RE = re.compile(r"<<[^>]*>>")


@functools.lru_cache(maxsize=65536)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    """math-verify's parse of a gold answer, or () when it yields no math object.

    math-verify falls back to echoing unparseable text as a string (``\\frac{`` -> ``['\\frac{']``);
    such a gold cannot be checked for equivalence, so it counts as unparseable (unscorable).
    """
    text = gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"
    parsed = tuple(parse(text))
    return parsed if any(not isinstance(x, str) for x in parsed) else ()


def gold_ok(answer: str) -> bool:
    """True when math-verify parses the gold answer into a math object."""
    return bool(answer.strip()) and len(_parse_gold(answer.strip())) > 0


def verify(gold: str, completion: str) -> bool | None:
    """math-verify equivalence of the completion's final answer with ``gold``; None if gold unparseable."""
    g = _parse_gold(gold.strip()) if gold.strip() else ()
    if not g:
        return None
    pred = parse(completion, extraction_config=PRED_CONFIG)
    if not pred:
        return False
    return bool(_mv_verify(list(g), pred))


def extract_answer(completion: str) -> str | None:
    """The completion's final answer as math-verify extracts it (its string form), or None."""
    parsed = parse(completion, extraction_config=PRED_CONFIG)
    return str(parsed[-1]) if parsed else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    j, depth = i + len("\\boxed{"), 1
    start = j
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start : j - 1] if depth == 0 else None


def from_gsm8k(row: dict[str, Any]) -> dict[str, Any]:
    """GSM8K ``{question, answer: '...#### 72'}`` -> ``{prompt, answer, solution}``."""
    q, a = row.get("question"), row.get("answer")
    if not isinstance(q, str) or not isinstance(a, str):
        raise ValueError("gsm8k row needs string fields 'question' and 'answer'")
    if "####" not in a:
        raise ValueError("gsm8k answer has no '#### <answer>' line")
    body, final = a.rsplit("####", 1)
    final = final.strip().replace(",", "")
    sol = _CALC_RE.sub("", body).strip()
    return {"prompt": q, "answer": final, "solution": f"{sol}\nThe answer is \\boxed{{{final}}}."}


def from_math(row: dict[str, Any]) -> dict[str, Any]:
    """MATH/AIME ``{problem, answer?, solution?}`` -> ``{prompt, answer, solution}``."""
    p = row.get("problem")
    if not isinstance(p, str):
        raise ValueError("math row needs a string field 'problem'")
    ans, sol = row.get("answer"), row.get("solution")
    if ans is None and isinstance(sol, str):
        ans = last_boxed(sol)
    if isinstance(ans, int | float) and not isinstance(ans, bool):
        ans = str(ans)
    if not isinstance(ans, str):
        raise ValueError("math row has no 'answer' and no \\boxed{} in 'solution'")
    return {"prompt": p, "answer": ans, "solution": sol if isinstance(sol, str) else None}


def from_generic(row: dict[str, Any]) -> dict[str, Any]:
    """``{prompt, answer, solution?}`` as is."""
    p, a = row.get("prompt"), row.get("answer")
    if isinstance(a, int | float) and not isinstance(a, bool):
        a = str(a)
    if not isinstance(p, str) or not isinstance(a, str):
        raise ValueError("generic row needs string fields 'prompt' and 'answer'")
    s = row.get("solution")
    return {"prompt": p, "answer": a, "solution": s if isinstance(s, str) else None}


ADAPTERS = {"gsm8k": from_gsm8k, "math": from_math, "generic": from_generic}


def render(prompt: str, answer: str, solution: str | None, style: str) -> str:
    """The demonstration completion: ``cot`` (the solution) or ``direct`` (boxed answer only)."""
    if style == "cot" and solution:
        return solution
    return f"The answer is \\boxed{{{answer}}}."
