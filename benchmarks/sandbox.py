"""Throughput of the sandbox pool (posttrain/sandbox/): programs per second on trivial programs (``print(1)``)
and on HumanEval's canonical solutions run against their own tests (all 164 must pass), at 1 and 2 workers;
the baseline ("bare"): the same interpreter running ``print(1)`` as a plain subprocess, no sandbox; and
"trivial-nocg": the trivial programs with no memory cgroup around the tree (the sandbox before the cgroup;
where no cgroup can be made, "trivial" is that too). "hung": two programs that hang (one asleep, one
deadlocked) ahead of ``--trivial`` trivial ones at 2 workers, under the default limits with the idle watch
(``idle_s``, posttrain/sandbox/idle.py) and without it ("hung-noidle": ``wall_s`` alone, the pool before it).

Arms alternate within the run (w1, w2, w1, w2, ...) so machine noise hits both; every repeat is reported.
Each program gets a fresh sandbox (bwrap: new namespaces, a fresh scratch tmpfs, a Python start-up).

    python benchmarks/sandbox.py                 # prints a table, writes benchmarks/results/sandbox.json
    python benchmarks/sandbox.py --trivial 200 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from posttrain.config import SandboxCfg
from posttrain.sandbox import Program, SandboxPool, cgroup
from posttrain.sandbox.bwrap import resolve_python

ROOT = Path(__file__).resolve().parents[1]
HUMANEVAL = Path(os.environ.get("POSTTRAIN_BENCH", ".")) / "humaneval.jsonl"


def humaneval_programs(path: Path) -> tuple[list[str], list[Program]]:
    """Each problem as the HumanEval harness runs it: prompt + canonical solution + tests + ``check(entry)``."""
    ids, progs = [], []
    for line in path.read_text().splitlines():
        p = json.loads(line)
        ids.append(p["task_id"])
        progs.append(Program(f"{p['prompt']}{p['canonical_solution']}\n{p['test']}\ncheck({p['entry_point']})\n"))
    return ids, progs


@contextlib.contextmanager
def _memory_cgroup(on: bool) -> Iterator[None]:
    """Off: the executor's ``cgroup.make`` makes none (the sandbox as it was before the cgroup)."""
    make = cgroup.make
    if not on:
        cgroup.make = lambda mb: None
    try:
        yield
    finally:
        cgroup.make = make


HUNG = [Program("import time\ntime.sleep(1000)"),
        Program("import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()")]


def arm(workers: int, programs: list[Program], memory_cgroup: bool = True, **limits: object) -> tuple[dict, list]:
    cfg = SandboxCfg(workers=workers, **limits)
    with _memory_cgroup(memory_cgroup), SandboxPool(cfg) as pool:
        t = time.perf_counter()
        results = pool.map(programs)
        dt = time.perf_counter() - t
    walls = sorted(r.wall_s for r in results)
    return {"workers": workers, "programs": len(programs), "seconds": round(dt, 3),
            "programs_per_s": round(len(programs) / dt, 2), "ok": sum(r.ok for r in results),
            "p50_wall_ms": round(1000 * statistics.median(walls), 1),
            "p95_wall_ms": round(1000 * walls[int(0.95 * (len(walls) - 1))], 1)}, results


def bare(workers: int, n: int, python: str) -> dict:
    """The baseline: ``python -c 'print(1)'`` as a plain subprocess (no sandbox), ``workers`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> float:
        t = time.perf_counter()
        subprocess.run([python, "-c", "print(1)"], capture_output=True, check=True)
        return time.perf_counter() - t

    with ThreadPoolExecutor(workers) as ex:
        t = time.perf_counter()
        walls = sorted(ex.map(one, range(n)))
        dt = time.perf_counter() - t
    return {"workers": workers, "programs": n, "seconds": round(dt, 3), "programs_per_s": round(n / dt, 2),
            "ok": n, "p50_wall_ms": round(1000 * statistics.median(walls), 1),
            "p95_wall_ms": round(1000 * walls[int(0.95 * (n - 1))], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trivial", type=int, default=100, help="trivial programs per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats of the trivial arms")
    ap.add_argument("--humaneval-repeats", type=int, default=1, help="alternating repeats of the HumanEval arms")
    ap.add_argument("--hung-repeats", type=int, default=2, help="alternating repeats of the hung arms")
    args = ap.parse_args()

    rows, failures = [], {}
    trivial = [Program("print(1)")] * args.trivial
    python = resolve_python(SandboxCfg().python)
    for rep in range(args.repeats):
        for w in (1, 2):
            row, _ = arm(w, trivial)
            rows.append({"suite": "trivial", "repeat": rep, **row})
            row, _ = arm(w, trivial, memory_cgroup=False)
            rows.append({"suite": "trivial-nocg", "repeat": rep, **row})
            rows.append({"suite": "bare", "repeat": rep, **bare(w, args.trivial, python)})
    for rep in range(args.hung_repeats):
        for suite, limits in (("hung", {}), ("hung-noidle", {"idle_s": None})):
            row, _ = arm(2, HUNG + trivial, **limits)
            rows.append({"suite": suite, "repeat": rep, **row})
    ids, progs = humaneval_programs(HUMANEVAL)
    for rep in range(args.humaneval_repeats):
        for w in (1, 2):
            row, results = arm(w, progs)
            rows.append({"suite": "humaneval", "repeat": rep, **row})
            for i, r in zip(ids, results, strict=True):
                if not r.ok:
                    failures[i] = f"{r.status}: {r.detail}"

    print(f"memory cgroup: {cgroup.available() or 'none can be made here'}")
    print(f"{'suite':12} {'rep':>3} {'workers':>7} {'programs':>8} {'seconds':>8} {'prog/s':>8} {'ok':>5} "
          f"{'p50 ms':>7} {'p95 ms':>7}")
    for r in rows:
        print(f"{r['suite']:12} {r['repeat']:>3} {r['workers']:>7} {r['programs']:>8} {r['seconds']:>8} "
              f"{r['programs_per_s']:>8} {r['ok']:>5} {r['p50_wall_ms']:>7} {r['p95_wall_ms']:>7}")
    he = [r for r in rows if r["suite"] == "humaneval"]
    print(f"HumanEval canonical solutions passing their tests: {min(r['ok'] for r in he)}/{len(progs)} "
          f"(worst arm); failures: {failures or 'none'}")
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    out = ROOT / "benchmarks" / "results" / "sandbox.json"
    out.write_text(json.dumps({"rows": rows, "humaneval_failures": failures, "bwrap": bwrap,
                               "memory_cgroup": str(cgroup.available()),
                               "limits": SandboxCfg().model_dump(), "cpus": len(os.sched_getaffinity(0)),
                               "machine": platform.platform()}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
