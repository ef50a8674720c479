"""Seeded rewritten copies of benchmark items, one function per way a leak gets rewritten in the wild.

Used by tests/test_decontam.py (recall per kind, false positives on clean GSM8K-train) and runnable on its
own: ``python tests/perturb.py`` prints recall per kind and the false-positive rate of the current matcher
(``benchmarks/results/decontam_recall.json``).
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import BENCH  # noqa: E402 ($POSTTRAIN_BENCH; test_decontam skips without it)

SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
WRAPPERS = [
    "Solve the following problem. Show your work, then give the final answer.\n\n{q}\n\nAnswer:",
    "You are a helpful math tutor. A student asks:\n{q}\nExplain step by step.",
    "Question: {q}\nLet's think step by step and write the answer at the end.",
    "Here is a problem from my homework that I could not solve, please help me. {q} Thanks a lot!",
]


def _clean(text: str) -> str:
    return text.replace(SUFFIX, "").strip()


def verbatim(text: str, rng: random.Random) -> str:
    return _clean(text)


def recase_respace(text: str, rng: random.Random) -> str:
    t = rng.choice([str.upper, str.lower, str.title, str.swapcase])(_clean(text))
    t = t.replace(", ", " , ").replace(". ", " .   ").replace("?", " ?").replace("\n", "  ")
    return "  " + re.sub(r" ", lambda _: rng.choice([" ", " ", "  ", "\t"]), t) + " "


def wrapped(text: str, rng: random.Random) -> str:
    return rng.choice(WRAPPERS).format(q=_clean(text))


def sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.?!])\s+(?=[A-Z$\\(])", _clean(text)) if s]


def reordered(text: str, rng: random.Random) -> str:
    s = sentences(text)
    order = list(range(len(s)))
    while len(s) > 1 and order == sorted(order):
        rng.shuffle(order)
    return " ".join(s[i] for i in order)


def _frac(m: re.Match, rng: random.Random) -> str:
    a, b = m.group(1), m.group(2)
    return f"({a})/({b})" if rng.random() < 0.5 else f"{a}/{b}"


def latex_rewritten(text: str, rng: random.Random) -> str:
    """LaTeX as plain text: $ dropped, \\frac{a}{b} as (a)/(b) or a/b, \\cdot as *, \\left( \\right) dropped,
    ^{2} as ^2."""
    t = _clean(text)
    for _ in range(3):  # nested fractions, innermost first
        t = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", lambda m: _frac(m, rng), t)
    t = re.sub(r"\^\{([^{}]*)\}", r"^\1", t)
    t = t.replace("\\cdot", "*").replace("\\times", "*").replace("\\left", "").replace("\\right", "")
    return t.replace("$", "")


def truncated_60(text: str, rng: random.Random) -> str:
    words = _clean(text).split()
    return " ".join(words[: max(1, round(0.6 * len(words)))])


KINDS: dict[str, Callable[[str, random.Random], str]] = {
    "verbatim": verbatim, "recase_respace": recase_respace, "wrapped": wrapped, "reordered": reordered,
    "latex_rewritten": latex_rewritten, "truncated_60": truncated_60,
}


def load(name: str, key: str) -> list[str]:
    with open(BENCH / name) as f:
        return [json.loads(line)[key] for line in f]


def benchmarks() -> dict[str, list[tuple[str, str]]]:
    """GSM8K-test + MATH-500 + AIME 24/25 + AMC 23: the sets the issue decontaminates GSM8K-train against."""
    out = {"gsm8k_test": load("gsm8k_test.jsonl", "question"), "math500": load("math500.jsonl", "problem")}
    for name in ("aime24", "aime25", "amc2023"):
        out[name] = load(f"{name}.jsonl", "problem")
    return {b: [(f"{b}:{i}", q) for i, q in enumerate(items)] for b, items in out.items()}


def planted(per_kind: int = 100, seed: int = 0) -> list[tuple[str, str, str]]:
    """(kind, source item id, rewritten text). LaTeX rewrites come from items that have LaTeX, reorderings
    from items with at least two sentences; every kind draws from every benchmark."""
    rng = random.Random(seed)
    items = [x for b in benchmarks().values() for x in b]
    out = []
    for kind, fn in KINDS.items():
        pool = items
        if kind == "latex_rewritten":
            pool = [x for x in items if latex_rewritten(x[1], random.Random(0)) != _clean(x[1])]
        elif kind == "reordered":
            pool = [x for x in items if len(sentences(x[1])) > 1]
        for item_id, text in rng.sample(pool, per_kind):
            out.append((kind, item_id, fn(text, rng)))
    return out


def measure(per_kind: int = 100, seed: int = 0) -> dict:
    """Recall per kind of planted copies and false positives on clean GSM8K-train, through curate's own
    ``decontaminate`` with the default ``curate.decontam`` settings; and the seconds it took."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from posttrain.config import Decontam
    from posttrain.schema import Problem
    from stages.curate import decontaminate

    train = load("gsm8k_train.jsonl", "question")
    plants = planted(per_kind, seed)
    rows = [Problem(id=f"train:{i}", source="t", task="math", prompt=q, answer="1", solution=None)
            for i, q in enumerate(train)]
    rows += [Problem(id=f"planted:{k}:{j}", source="p", task="math", prompt=text, answer="1", solution=None)
             for j, (k, _, text) in enumerate(plants)]
    t = time.time()
    _, bad, report = decontaminate(rows, benchmarks(), Decontam())
    seconds = time.time() - t
    recall = {k: sum(f"planted:{k}:{j}" in bad for j, (kk, _, _) in enumerate(plants) if kk == k) / per_kind
              for k in KINDS}
    fp = sorted(r for r in bad if r.startswith("train:"))
    methods: dict[str, int] = {}
    for b in report["benchmarks"].values():
        for m in b["matches"]:
            methods[m["method"]] = methods.get(m["method"], 0) + 1
    return {"per_kind": per_kind, "recall": recall, "false_positives": len(fp), "clean_rows": len(train),
            "false_positive_rate": len(fp) / len(train), "fp_ids": fp, "methods": methods,
            "seconds": round(seconds, 1)}


if __name__ == "__main__":
    res = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
    for k, v in res["recall"].items():
        print(f"{k:16} recall {100 * v:5.1f}%")
    print(f"false positives on clean GSM8K-train: {res['false_positives']}/{res['clean_rows']} "
          f"({100 * res['false_positive_rate']:.2f}%); methods {res['methods']}; {res['seconds']} s")
    out = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "decontam_recall.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
