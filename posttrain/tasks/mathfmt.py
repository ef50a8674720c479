r"""Math word-problem formats (GSM8K, MATH/AIME) and a ``math-verify`` based verifier.

``verify(gold, completion)`` wraps ``math_verify.verify(gold, pred)`` so the argument order cannot be
swapped by a caller, parses the gold once (cached), and returns None (unscorable) when the gold has no
parseable answer: an unparseable gold is never counted as correct. Call it from the main thread or a
process pool: math-verify's timeouts use signals (see ARCHITECTURE.md).

Before math-verify sees a completion, cheap syntactic guards (``guard``) refuse what must never earn reward
and what could hang its parser: several final answers (two boxes, or an answer stated after the box),
a hedged final answer (``5 or 6``, ``\pm``), an empty or unbalanced box, and pathological expressions
(very long, deeply nested, exponent towers: math-verify's own timeout is 5 s per call). math-verify then
rejects sets and intervals for a single gold by itself (tests/test_rewards.py has the adversarial table).
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


GUARDS = ("several_answers", "hedged", "empty_box", "unbalanced_box", "pathological")
_ANCHOR_RE = re.compile(r"(?:final answer|the answer|answer)\s*(?:is|:)", re.IGNORECASE)
# after an anchor, an answer-like value: a number, math ($, \(, \frac..., a parenthesis) or "x = ...";
# "This answer is consistent with ..." states no second answer
_VALUE_RE = re.compile(r"\s*(?:[-+]?\d|\$|\\[(\[]|\\[a-zA-Z]+|\(|[A-Za-z]\s*=)")
_HEDGE_RE = re.compile(r"\bor\b|\beither\b|\\lor\b")  # (\pm is a legitimate answer form: 1 \pm \sqrt{19})
MAX_ANSWER_CHARS = 300  # the longest gold among MATH-500, Minerva, OlympiadBench, AIME, AMC passes
MAX_NESTING = 8  # braces/parentheses/brackets
MAX_TOWER = 1  # no exponent inside an exponent: 9^{9^{9}} alone hangs sympy 5 s; no benchmark gold has one


def _final_span(completion: str) -> str | None:
    """The text of the completion's final answer: the last box's content, else what follows the last answer
    anchor up to the end of its line (None when there is neither)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    anchors = list(_ANCHOR_RE.finditer(completion))
    if not anchors:
        return None
    return completion[anchors[-1].end() :].split("\n", 1)[0]


def _boxes(text: str) -> list[str | None]:
    """The content of every ``\\boxed{...}`` in order (None for one whose braces never close)."""
    return [_box_at(text, m.end()) for m in re.finditer(r"\\boxed\{", text)]


def _pathological(span: str) -> bool:
    return len(span) > MAX_ANSWER_CHARS or _nesting(span) > MAX_NESTING or _tower(span) > MAX_TOWER


def _same_answer(a: str, b: str) -> bool:
    """Two stated answers are one: equal up to spaces and a trailing period, or math-verify equivalent
    (``5`` and ``5.0``, ``\\frac{1}{2}`` and ``0.5``); checked only on spans the guards already passed."""
    na, nb = (re.sub(r"\s+|\.$|\$", "", x.strip()) for x in (a, b))
    if na == nb:
        return True
    pa, pb = parse(f"${a.strip()}$"), parse(f"${b.strip()}$")
    return bool(pa) and bool(pb) and bool(_mv_verify(pa, pb))


def guard(completion: str) -> str | None:
    """Why the completion cannot earn reward whatever the gold (one of ``GUARDS``), or None if it can.

    Several *equivalent* final answers are one answer (issue 49: R1-style completions box the answer inside
    ``<think>`` and again after it, ``\\boxed{5} ... \\boxed{5}``, or box it and restate it, "so the answer
    is 5"); several *different* ones fire ``several_answers``, whichever is right."""
    boxes = _boxes(completion)
    if boxes:
        last = boxes[-1]
        if last is None or any(b is None for b in boxes):
            return "unbalanced_box"
        if not last.strip() or not all(b.strip() for b in boxes):
            return "empty_box"
        if any(_pathological(b) for b in boxes):
            return "pathological"
        end = completion.rfind("\\boxed{") + len("\\boxed{") + len(last) + 1
        after = completion[end:]
        stated = [after[m.end() :].split("\n", 1)[0] for m in _ANCHOR_RE.finditer(after)
                  if _VALUE_RE.match(after, m.end())]  # an answer stated after the box
        stated = [re.sub(r"^\s*(?:[A-Za-z]\s*=)?|[.\s]+$", "", x) for x in stated]
        if any(_pathological(x) for x in stated):
            return "pathological"
        if not all(_same_answer(b, last) for b in boxes[:-1] + stated):
            return "several_answers"
    span = _final_span(completion)
    if span is None:
        return None  # no answer at all: math-verify finds nothing (a plain 0, not a guard)
    if _HEDGE_RE.search(span.replace("\\text{", " ").replace("}", " ")):
        return "hedged"
    if _pathological(span):
        return "pathological"
    return None


def _nesting(text: str) -> int:
    depth = worst = 0
    for ch in text:
        depth += (ch in "{([") - (ch in "})]")
        worst = max(worst, depth)
    return worst


def _tower(text: str) -> int:
    """Height of the tallest exponent tower: ``x^2 + x^3`` -> 1, ``9^{9^{9}}`` and ``9^9^9`` -> 2."""
    groups: list[bool] = []  # per open brace: does it open an exponent?
    height = worst = 0
    for i, ch in enumerate(text):
        if ch == "^":
            worst = max(worst, height + 1)
        elif ch == "{":
            groups.append(i > 0 and text[i - 1] == "^")
            height += groups[-1]
        elif ch == "}" and groups:
            height -= groups.pop()
    chain = max((m.group(0).count("^") for m in re.finditer(r"(?:\^[\w.]+)+", text)), default=0)
    return max(worst, chain)


def verify(gold: str, completion: str) -> bool | None:
    """math-verify equivalence of the completion's final answer with ``gold``; None if gold unparseable;
    False when a guard fires."""
    g = _parse_gold(gold.strip()) if gold.strip() else ()
    if not g:
        return None
    if guard(completion) is not None:
        return False
    pred = parse(_final_text(completion), extraction_config=PRED_CONFIG)
    if not pred:
        return False
    return bool(_mv_verify(list(g), pred))


def extract_answer(completion: str) -> str | None:
    """The completion's final answer as math-verify extracts it (its string form), or None (also when a
    guard fires)."""
    if guard(completion) is not None:
        return None
    parsed = parse(_final_text(completion), extraction_config=PRED_CONFIG)
    return str(parsed[-1]) if parsed else None


def _final_text(completion: str) -> str:
    """What math-verify reads once the guards passed: from the last box on when there are several (they are
    equivalent, but math-verify would read ``\\boxed{5} ... \\boxed{5.0}`` as the set {5, 5.0})."""
    return completion[completion.rfind("\\boxed{") :] if completion.count("\\boxed{") > 1 else completion


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    i = text.rfind("\\boxed{")
    return None if i < 0 else _box_at(text, i + len("\\boxed{"))


def _box_at(text: str, start: int) -> str | None:
    """The balanced-brace content that starts at ``start`` (just after ``\\boxed{``), or None."""
    j, depth = start, 1
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start : j - 1] if depth == 0 else None


def gsm8k_steps(row: dict[str, Any]) -> int:
    """Calculations a GSM8K reference solution makes: its ``<<a*b=c>>`` annotations (0 for a row without any)."""
    a = row.get("answer")
    return len(_CALC_RE.findall(a)) if isinstance(a, str) else 0


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
