"""The adversarial reward table (tests/test_rewards.py): how many attacks earn reward, and the slowest case.

Every completion in the table must earn nothing (hedged answers, several answers, intervals, sets, a correct
answer followed by a different final one, answers only in an echoed prompt, empty or unbalanced boxes,
claims of correctness, pathological expressions). Run it on any commit to compare verifiers:

    python benchmarks/adversarial_rewards.py      # prints a table, writes benchmarks/results/adversarial_rewards.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_rewards import ARITH_ATTACKS, MATH_ATTACKS  # noqa: E402

from posttrain.rewards import REWARDS, Sample  # noqa: E402


def main() -> None:
    rows = []
    for task, gold, table in (("arith", "33166", ARITH_ATTACKS), ("math", "5", MATH_ATTACKS)):
        for completion, _ in table:
            names = ("correct", "math_verify") if task == "math" else ("correct",)
            t = time.perf_counter()
            try:
                got: dict[str, object] = {n: REWARDS[n](Sample(completion, gold, task, 20, 80)) for n in names}
            except Exception as e:  # a verifier that crashes on input is a bug of its own
                got = {"error": f"{type(e).__name__}: {str(e)[:60]}"}
            ms = 1000 * (time.perf_counter() - t)
            rows.append({"task": task, "completion": completion[:60], "rewards": got, "ms": round(ms, 2),
                         "free": any(v not in (0.0, None) for k, v in got.items() if k != "error"),
                         "crash": "error" in got})
    for r in rows:
        verdict = "FREE " if r["free"] else "CRASH" if r["crash"] else "ok   "
        print(f"{r['task']:5} {verdict} {r['ms']:8.2f} ms  {r['completion']!r}")
    slow = max(rows, key=lambda r: r["ms"])
    summary = {"cases": len(rows), "free_rewards": sum(r["free"] for r in rows),
               "crashes": sum(r["crash"] for r in rows), "slowest_ms": slow["ms"],
               "slowest_case": slow["completion"]}
    print(json.dumps(summary))
    out = ROOT / "benchmarks" / "results" / "adversarial_rewards.json"
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
