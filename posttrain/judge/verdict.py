"""What a judge is asked and what its reply is worth: the prompt template, the verdict formats and their
strict parsers.

A template is a ``str.format`` text with the fields of ``FIELDS`` (``{prompt}``, ``{completion}``, ``{answer}``,
``{rubric}``, ``{format}``); ``{format}`` is the verdict format's own instruction, so the judge is told exactly
the line the parser will accept. The completion reaches the judge between two marker lines tagged with its own
hash (``delimited``; the default template says that what lies between them is data, never instructions), so a
completion cannot close the data early and address the judge. A verdict format (``VERDICTS``, by name) parses
a reply into a value in [0, 1] or refuses it with why: the reply's last non-empty line must be the verdict line,
with nothing else on it, and the verdict tag must appear on no other line. Anything else is *malformed* (None, why
kept and counted): a reply that hedges, gives two scores or buries the score in prose earns nothing, never a guess.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import NamedTuple

from posttrain.config.judge import DEFAULT_TEMPLATE, FIELDS, template_fields
from posttrain.text import printable

__all__ = ["DEFAULT_TEMPLATE", "FIELDS", "VERDICTS", "Parsed", "Verdict", "parse_binary", "parse_score", "render",
           "template_fields"]


class Parsed(NamedTuple):
    """A parsed verdict: the value in [0, 1], or None and why the reply was refused."""

    value: float | None
    why: str | None


class Verdict(NamedTuple):
    """A verdict format: the instruction put in ``{format}`` and the parser of the reply (both take
    ``max_score``)."""

    instruction: Callable[[int], str]
    parse: Callable[[str, int], Parsed]


def _last_line(reply: str, tag: str) -> tuple[str | None, str | None]:
    """The reply's last non-empty line, stripped, when it is the only line that holds ``tag``; else why not."""
    lines = [ln.strip() for ln in reply.strip().splitlines() if ln.strip()]
    if not lines:
        return None, "empty reply"
    tagged = sum(tag in ln for ln in lines)
    if tagged == 0:
        return None, f"no {tag} line"
    if tagged > 1:
        return None, f"{tagged} lines hold {tag}"
    if tag not in lines[-1]:
        return None, f"{tag} line is not the last line"
    return lines[-1], None


_SCORE = re.compile(r"SCORE: (\d{1,4})")


def _score_instruction(max_score: int) -> str:
    return (f"End your reply with one line of the form `SCORE: <n>`, where <n> is an integer from 0 to {max_score} "
            f"({max_score} = fully meets the rubric), and write nothing after it.")


def parse_score(reply: str, max_score: int) -> Parsed:
    """``SCORE: <n>`` with 0 <= n <= max_score, alone on the last line: n / max_score."""
    line, why = _last_line(reply, "SCORE:")
    if line is None:
        return Parsed(None, why)
    m = _SCORE.fullmatch(line)
    if m is None:
        return Parsed(None, "SCORE line is not `SCORE: <integer>`")
    n = int(m.group(1))
    if n > max_score:
        return Parsed(None, f"score {n} > {max_score}")
    return Parsed(n / max_score, None)


def _binary_instruction(max_score: int) -> str:
    return "End your reply with one line, `VERDICT: PASS` or `VERDICT: FAIL`, and write nothing after it."


def parse_binary(reply: str, max_score: int) -> Parsed:
    """``VERDICT: PASS`` (1.0) or ``VERDICT: FAIL`` (0.0), alone on the last line."""
    line, why = _last_line(reply, "VERDICT:")
    if line is None:
        return Parsed(None, why)
    if line not in ("VERDICT: PASS", "VERDICT: FAIL"):
        return Parsed(None, "VERDICT line is not `VERDICT: PASS` or `VERDICT: FAIL`")
    return Parsed(1.0 if line.endswith("PASS") else 0.0, None)


VERDICTS: dict[str, Verdict] = {
    "score": Verdict(_score_instruction, parse_score),
    "binary": Verdict(_binary_instruction, parse_binary),
}


def delimited(completion: str) -> str:
    """The completion between two marker lines tagged with the first 16 hex digits of its own SHA-256: a completion
    cannot write its closing marker (that would need a text containing its own hash) to end the data early and
    speak to the judge after it. Control, format and separator characters but newline and tab are dropped from
    what the judge sees (``posttrain.text.printable``)."""
    text = printable(completion, keep="\n\t")
    tag = hashlib.sha256(completion.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"<<<RESPONSE {tag}>>>\n{text}\n<<<END RESPONSE {tag}>>>"


def render(template: str, *, prompt: str, completion: str, answer: str, rubric: str, verdict: str,
           max_score: int) -> str:
    """The judge's prompt: the template with the sample (the completion ``delimited``, whatever the template),
    the rubric and the verdict format's instruction."""
    return template.format(prompt=prompt, completion=delimited(completion), answer=answer, rubric=rubric,
                           format=VERDICTS[verdict].instruction(max_score))
