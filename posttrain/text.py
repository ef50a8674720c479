"""Text a program or a model wrote, made safe to show in one line of an audit or to hand to a judge model: its
control, format and separator characters dropped (Unicode categories Cc, Cf, Zl, Zp: terminal escapes and bells,
C1 controls, zero-width and bidi controls, the invisible tag block a model still reads, line separators).
By category rather than a hand-kept range list: the ranges missed the format characters (review)."""

from __future__ import annotations

import unicodedata

_DROPPED = frozenset({"Cc", "Cf", "Zl", "Zp"})


def printable(text: str, keep: str = "") -> str:
    """``text`` without control, format and line/paragraph-separator characters, except those in ``keep``."""
    return "".join(ch for ch in text if ch in keep or unicodedata.category(ch) not in _DROPPED)
