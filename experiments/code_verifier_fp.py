"""How often the code task's tests pass a wrong program: rewarded completions that differ from the spec.

A completion of the ``cot`` format (one ``a=[...]`` line per step, then ``return ...``; each expression must match
a whitelist of ``x``, digits and arithmetic/comparison operators, so nothing else is evaluated) is parsed into a
pipeline and run beside the prompt's reference pipeline (``posttrain.tasks.code``) on ``--lists`` random lists
of the tests' distribution (1-5 values in [-20, 20], the default ``task.max_const``); a rewarded completion that
disagrees on any list is a false positive of the verifier. Reads a run folder's rollouts and rewards
(``data/rollout``, ``data/reward``) or, with ``--steps LO HI``, its RL shards (``data/rl/shards``).

    python experiments/code_verifier_fp.py /tmp/code_rl/base
    python experiments/code_verifier_fp.py /tmp/code_rl/lr1e-4_s60/s2 --steps 1 10 --lists 500
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.tasks.code import _function, parse_prompt  # noqa: E402

SAFE = re.compile(r"^[x0-9+\-*%<>= ]+$")
RED = {"sum(a)": "sum", "max(a,default=0)": "max", "min(a,default=0)": "min", "len(a)": "count", "a": "list"}


def parse_completion(c: str) -> tuple[list[tuple[str, str, str]], str] | None:
    """``' a=[x for x in a if x%2]\\n a=[x+3 for x in a]\\n return sum(a)'`` -> (steps, reduction); None if the
    completion is not of that format or an expression is not whitelisted."""
    lines = [ln.strip() for ln in c.strip().split("\n")]
    steps = []
    for ln in lines[:-1]:
        m = re.fullmatch(r"a=\[x for x in a if (.+)\]", ln)
        kind = "filter"
        if m is None:
            m, kind = re.fullmatch(r"a=\[(.+) for x in a\]", ln), "map"
        if m is None or not SAFE.match(m.group(1)):
            return None
        steps.append(("", kind, m.group(1)))
    m = re.fullmatch(r"return (.+)", lines[-1]) if lines else None
    if m is None or m.group(1) not in RED:
        return None
    return steps, RED[m.group(1)]


def false_positives(rows: pd.DataFrame, lists: list[list[int]]) -> dict[str, Any]:
    ok = rows[rows.reward == 1]
    n = wrong = 0
    for p, c in zip(ok.prompt, ok.completion, strict=True):
        got = parse_completion(c)
        if got is None:
            continue
        spec = parse_prompt(p)
        assert spec is not None, p
        f, g = _function(*spec), _function(*got)
        n += 1
        try:
            wrong += any(f(xs) != g(xs) for xs in lists)
        except Exception:  # e.g. a comparison of a list with an int: wrong
            wrong += 1
    return {"samples": len(rows), "rewarded": len(ok), "parsed": n, "wrong": wrong,
            "wrong_share": round(wrong / max(n, 1), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--steps", type=int, nargs=2, default=None, help="RL steps LO HI of data/rl/shards")
    ap.add_argument("--lists", type=int, default=2000)
    a = ap.parse_args()
    rng = random.Random(0)
    lists = [[rng.randint(-20, 20) for _ in range(rng.randint(1, 5))] for _ in range(a.lists)]
    if a.steps:
        rows = pd.concat([pd.read_parquet(f, columns=["prompt", "completion", "reward", "step"])
                          for f in sorted((a.folder / "data" / "rl" / "shards").glob("*.parquet"))])
        rows = rows[rows.step.between(*a.steps)]
    else:
        rows = pd.read_parquet(a.folder / "data" / "reward" / "rewards.parquet").merge(
            pd.read_parquet(a.folder / "data" / "rollout" / "rollouts.parquet",
                            columns=["prompt_id", "sample", "prompt", "completion"]), on=["prompt_id", "sample"])
    print(a.folder, a.steps or "rollouts", false_positives(rows, lists))


if __name__ == "__main__":
    main()
