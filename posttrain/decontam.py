"""Text normalisation, a word n-gram index, and the decontamination report.

Why hand-written: open-r1's decontaminator (lower/strip + any shared 8-gram) cannot flag texts shorter
than n words and lets shared instructions cause matches; open-instruct's needs Elasticsearch. This index
fixes both in ~100 lines and also serves near-duplicate detection.

- ``normalize``: NFKC, casefold, LaTeX read as plain math (``math_plain``: ``$`` dropped, ``\\frac{a}{b}``,
  ``(a)/(b)`` and ``a/b`` all become ``a / b``, ``\\cdot``/``\\times`` become ``*``, ``\\left``/``\\right`` and
  brackets dropped, ``^{2}`` and ``^2`` the same), whitespace collapsed. ``words`` splits into word runs and
  single punctuation marks, so re-spacing (``apples , she`` vs ``apples, she``) and re-casing do not hide a copy.
- ``grams``: word n-grams *within each sentence*, so a copy with its sentences reordered has the same set;
  a sentence shorter than n words yields one n-gram, the whole sentence, so short prompts (``12*7=``) are
  still caught by exact n-gram equality.
- Scoring a row against one indexed item: ``score = max(shared/row_ngrams, shared/item_ngrams)``: the
  first catches a (lightly edited) copy of an item, the second an item embedded in a longer row.
- Boilerplate: n-grams present in more than ``boilerplate_frac`` of an index's items (shared
  instructions such as "Please reason step by step, and put your final answer within \\boxed{}.") are
  dropped from the index and from the row's denominator, so they cannot cause a match on their own.
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

_WORD_RE = re.compile(r"\d+|[^\W\d]+|[^\w\s]")  # digits apart from letters: `2x` is `2 x`
_LATEX = [  # (pattern, replacement), in order
    (re.compile(r"\$"), " "),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\(?:left|right|displaystyle|[,;:!]|q?quad)"), " "),
    (re.compile(r"\\(?:cdot|times|ast)"), "*"),
    (re.compile(r"\\text(?:bf|it|rm)?\b"), " "),
]
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_BRACKETS = re.compile(r"[{}()\[\]]")


def math_plain(text: str) -> str:
    """LaTeX and its plain-text rewrites mapped to one form (see module docstring)."""
    for pat, rep in _LATEX:
        text = pat.sub(rep, text)
    for _ in range(3):  # nested fractions, innermost first
        text = _FRAC.sub(r"\1 / \2", text)
    return _BRACKETS.sub(" ", text).replace("\\", " ")


def normalize(text: str) -> str:
    return " ".join(math_plain(unicodedata.normalize("NFKC", text).casefold()).split())


def words(text: str) -> list[str]:
    return _WORD_RE.findall(normalize(text))


def ngrams(tokens: list[str], n: int) -> set[str]:
    """Word n-grams as space-joined strings; fewer than n tokens -> the whole text as one n-gram."""
    if not tokens:
        return set()
    if len(tokens) < n:
        return {" ".join(tokens)}
    return {" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def sentences(tokens: list[str]) -> list[list[str]]:
    """Split tokens after ``.``/``?``/``!`` (a ``.`` between digits is a decimal point, not an end)."""
    out, cur = [], []
    for i, t in enumerate(tokens):
        cur.append(t)
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if t in {".", "?", "!"} and not (t == "." and nxt.isdigit() and i > 0 and tokens[i - 1].isdigit()):
            out.append(cur)
            cur = []
    return out + [cur] if cur else out


def grams(text: str, n: int) -> set[str]:
    """The n-grams of each sentence of ``text`` (order-insensitive across sentences)."""
    return set().union(*(ngrams(s, n) for s in sentences(words(text)))) if text.strip() else set()


@dataclass
class Match:
    item_id: str
    score: float
    shared: list[str]  # the shared n-grams (for the report)
    method: str  # "exact" | "ngram:row-in-item" (a copy, edited or cut) | "ngram:item-in-row" (wrapped/embedded)


@dataclass
class NgramIndex:
    """Index of items' n-grams. ``finalize()`` (optional) drops boilerplate n-grams."""

    n: int
    grams: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # gram -> item ids
    size: dict[str, int] = field(default_factory=dict)  # item id -> number of indexed n-grams
    exact: dict[str, str] = field(default_factory=dict)  # normalized text -> item id
    boilerplate: set[str] = field(default_factory=set)

    def add(self, item_id: str, text: str) -> None:
        g = grams(text, self.n)
        for gram in g:
            self.grams[gram].add(item_id)
        self.size[item_id] = len(g)
        self.exact.setdefault(normalize(text), item_id)

    def finalize(self, boilerplate_frac: float, min_items: int = 3) -> None:
        """Drop n-grams found in more than ``boilerplate_frac`` of the items (and in >= min_items)."""
        limit = max(min_items, boilerplate_frac * len(self.size))
        self.boilerplate = {g for g, ids in self.grams.items() if len(ids) > limit}
        for g in self.boilerplate:
            for item in self.grams.pop(g):
                self.size[item] -= 1

    def query(self, text: str) -> Match | None:
        """The best-scoring item for ``text`` (exact normalized match first), or None if nothing shared."""
        norm = normalize(text)
        if norm in self.exact:
            return Match(self.exact[norm], 1.0, [], "exact")
        row = grams(text, self.n) - self.boilerplate
        if not row:
            return None
        shared: dict[str, list[str]] = defaultdict(list)
        for gram in row:
            for item in self.grams.get(gram, ()):
                shared[item].append(gram)
        best: Match | None = None
        for item, gs in shared.items():
            if self.size[item] <= 0:
                continue
            of_row, of_item = len(gs) / len(row), len(gs) / self.size[item]
            score = max(of_row, of_item)
            if best is None or score > best.score:  # which share decided: a (rewritten) copy, or an embedding
                best = Match(item, score, sorted(gs), "ngram:row-in-item" if of_row >= of_item else "ngram:item-in-row")
        return best


def build_index(items: list[tuple[str, str]], n: int, boilerplate_frac: float) -> NgramIndex:
    """Index ``(id, text)`` items and drop their boilerplate n-grams."""
    idx = NgramIndex(n)
    for item_id, text in items:
        idx.add(item_id, text)
    idx.finalize(boilerplate_frac)
    return idx


def report_markdown(report: dict) -> str:
    """A readable table of a decontamination report (see ``stages.curate``)."""
    lines = [
        "# Decontamination report",
        "",
        f"n-gram size {report['ngram']}, threshold {report['threshold']}, "
        f"rows checked {report['rows_checked']}, contaminated rows {report['contaminated_rows']}.",
        "",
        "| benchmark | items | boilerplate n-grams | matched rows | example matches (row → item, score) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, b in report["benchmarks"].items():
        ex = "; ".join(f"`{m['row_id']}` → `{m['item_id']}` ({m['score']:.2f})" for m in b["matches"][:3])
        lines.append(f"| {name} | {b['items']} | {b['boilerplate_ngrams']} | {b['matched_rows']} | {ex} |")
    for name, b in report["benchmarks"].items():
        if not b["matches"]:
            continue
        lines += ["", f"## {name}: matched rows", "", "| row | item | method | score | shared n-grams |",
                  "|---|---|---|---:|---|"]
        for m in b["matches"][:50]:
            grams = ", ".join(f"`{g}`" for g in m["ngrams"][:3]).replace("|", "\\|")
            lines.append(f"| `{m['row_id']}` | `{m['item_id']}` | {m['method']} | {m['score']:.2f} | {grams} |")
        if len(b["matches"]) > 50:
            lines.append(f"| … {len(b['matches']) - 50} more in the JSON report | | | | |")
    return "\n".join(lines) + "\n"


class Checker:
    """Rows checked one at a time against every benchmark's index (:func:`build_index`); ``report()`` is
    decontamination.json (matches per benchmark, in row order)."""

    def __init__(self, benchmarks: dict[str, list[tuple[str, str]]], cfg: Any) -> None:
        self.cfg, self.checked, self.bad = cfg, 0, set[str]()
        self.index = {name: build_index(items, cfg.ngram, cfg.boilerplate_frac)
                      for name, items in benchmarks.items()}
        self.items = {name: len(items) for name, items in benchmarks.items()}
        self.matches: dict[str, list[dict[str, Any]]] = {name: [] for name in benchmarks}

    def clean(self, r: dict[str, Any]) -> bool:
        """False (and recorded) when ``r`` matches an item of some benchmark."""
        self.checked += 1
        for name, index in self.index.items():
            m = index.query(r["prompt"])
            if m is not None and m.score >= self.cfg.threshold:
                self.matches[name].append({"row_id": r["id"], "item_id": m.item_id, "method": m.method,
                                           "score": round(m.score, 3), "ngrams": m.shared[:5]})
                self.bad.add(r["id"])
        return r["id"] not in self.bad

    def report(self) -> dict[str, Any]:
        return {"ngram": self.cfg.ngram, "threshold": self.cfg.threshold, "rows_checked": self.checked,
                "benchmarks": {name: {"items": self.items[name],
                                      "boilerplate_ngrams": len(self.index[name].boilerplate),
                                      "matched_rows": len(ms), "matched_ids": sorted({m["item_id"] for m in ms}),
                                      "matches": ms} for name, ms in self.matches.items()},
                "contaminated_rows": len(self.bad)}
