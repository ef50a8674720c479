"""Reward throughput: completions/s scored serially (in-process) vs in a ``RewardPool``, at G=64 on math.

Completions are built from MATH-500 golds (``$POSTTRAIN_BENCH/math500.jsonl``): a few sentences of
working, then a final answer that is the gold, an equivalent rewriting of it (spaces, ``\\dfrac``, ``$...$``,
"The answer is"), a wrong answer (a digit changed), a hedge, two boxes or no answer at all, so math-verify
does the work it does in an RL step. Each repeat scores one step (``--prompts`` prompts x G samples, distinct
prompts per repeat so no gold-parse cache carries over) with every arm, in alternating order; every repeat is
reported. The pool is started once per arm and kept (as the rl stage keeps it for the run); its start-up and
warm-up (on golds no repeat uses) is reported apart. Results must be identical across arms (checked).

    python benchmarks/reward_pool.py [--prompts 8] [--group 64] [--repeats 3] [--workers 2 4]
    # prints a table, writes benchmarks/results/reward_pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import time
from pathlib import Path

from posttrain.rewards import RewardPool, Sample, Spec

ROOT = Path(__file__).resolve().parents[1]
MATH500 = Path(os.environ.get("POSTTRAIN_BENCH", ".")) / "math500.jsonl"
SPECS = [Spec("correct", 1.0, {}), Spec("format", 0.1, {})]
WORK = ["First, let us restate the problem in terms of the given quantities.",
        "We substitute the values and simplify step by step: $2x + 3 = 11$, so $x = 4$.",
        "Checking the boundary cases, none of them change the count.",
        "By symmetry, it suffices to consider the first quadrant and multiply by four.",
        "Expanding, $(a+b)^2 = a^2 + 2ab + b^2$, and the cross term vanishes here.",
        "Let me double-check the arithmetic: $12 \\cdot 7 = 84$ and $84 - 9 = 75$."]


def _wrong(gold: str, rng: random.Random) -> str:
    digits = [m.start() for m in re.finditer(r"\d", gold)]
    if not digits:
        return gold + "+1"
    i = rng.choice(digits)
    return gold[:i] + str((int(gold[i]) + rng.randint(1, 8)) % 10) + gold[i + 1 :]


def completion(gold: str, rng: random.Random) -> tuple[str, str]:
    """A completion of one of eight kinds (the kind, the text), reasoning first, then the final answer."""
    dfrac = gold.replace("\\frac", "\\dfrac")
    body = " ".join(rng.sample(WORK, rng.randint(2, 5)))
    kind = rng.choices(["gold", "spaced", "dfrac", "dollar", "anchor", "wrong", "hedge", "two_boxes", "none"],
                       weights=[30, 8, 5, 8, 6, 30, 4, 4, 5])[0]
    final = {"gold": f"\\boxed{{{gold}}}", "spaced": f"\\boxed{{ {gold.replace(',', ', ')} }}",
             "dfrac": f"\\boxed{{{dfrac}}}", "dollar": f"$\\boxed{{{gold}}}$",
             "anchor": f"The answer is ${gold}$.", "wrong": f"\\boxed{{{_wrong(gold, rng)}}}",
             "hedge": f"The answer is ${gold}$ or ${_wrong(gold, rng)}$.",
             "two_boxes": f"\\boxed{{{_wrong(gold, rng)}}} then \\boxed{{{gold}}}", "none": "I am not sure."}[kind]
    return kind, f"{body}\n\nTherefore the final answer is {final}" if kind != "none" else f"{body} {final}"


def step_samples(golds: list[str], g: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(completion(gold, rng)[1], gold, "math", rng.randint(200, 900), 1024) for gold in golds
            for _ in range(g)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (x G samples)")
    ap.add_argument("--group", type=int, default=64, help="G, samples per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="pool arms (serial is always run)")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--math500", type=Path, default=MATH500)
    args = ap.parse_args()
    golds = [json.loads(x)["answer"] for x in args.math500.read_text().splitlines()]
    arms = [0, *args.workers]
    load0 = os.getloadavg()
    pools, startup = {}, {}
    for w in arms:
        t = time.perf_counter()
        pools[w] = RewardPool(w, args.timeout).__enter__()
        # workers start lazily, and math-verify's first calls are slow (sympy's lazy set-up): warm every arm
        # up on golds the repeats never use, and report that apart
        pools[w].score(step_samples(golds[-4:], 16 * max(w, 1), seed=99), SPECS)
        startup[w] = time.perf_counter() - t
    rows = []
    try:
        for r in range(args.repeats):
            chunk = golds[r * args.prompts : (r + 1) * args.prompts]
            samples = step_samples(chunk, args.group, seed=r)
            order = arms if r % 2 == 0 else arms[::-1]  # alternate which arm goes first
            results = {}
            for w in order:
                t = time.perf_counter()
                results[w] = pools[w].score(samples, SPECS)
                s = time.perf_counter() - t
                rows.append({"repeat": r, "workers": w, "completions": len(samples), "seconds": round(s, 3),
                             "completions_per_s": round(len(samples) / s, 1)})
                print(f"repeat {r}  workers {w:2d}  {len(samples)} completions  {s:7.2f} s  "
                      f"{len(samples) / s:7.1f} completions/s", flush=True)
            assert all(results[w] == results[0] for w in arms), "pool and serial scores differ"
            mean = [t for t, _ in results[0] if t is not None]
            print(f"           mean reward {sum(mean) / len(mean):.3f}, identical across arms", flush=True)
    finally:
        for p in pools.values():
            p.close()
    summary = {}
    for w in arms:
        rates = [x["completions_per_s"] for x in rows if x["workers"] == w]
        summary[str(w)] = {"median_completions_per_s": sorted(rates)[len(rates) // 2], "all": rates,
                           "startup_s": round(startup[w], 3)}
    base = summary["0"]["median_completions_per_s"]
    print("\n| workers | completions/s (median) | every repeat | vs serial | start-up + warm-up s |")
    print("|---:|---:|---|---:|---:|")
    for w in arms:
        s = summary[str(w)]
        print(f"| {w} | {s['median_completions_per_s']} | {s['all']} | "
              f"{s['median_completions_per_s'] / base:.2f}x | {s['startup_s']} |")
    out = ROOT / "benchmarks" / "results" / "reward_pool.json"
    out.write_text(json.dumps({"args": {**vars(args), "math500": str(args.math500)},
                               "specs": [s._asdict() for s in SPECS],
                               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "load_avg_at_start": load0, "load_avg_at_end": os.getloadavg()},
                               "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
