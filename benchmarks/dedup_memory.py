"""The dedup's own live memory as the rows grow: ``tracemalloc``'s peak (Python objects and numpy arrays; not
Arrow's or the C allocator's retained pages) inside each phase of ``find_duplicates`` with ``minhash``.

Rows: N synthetic prompts ``"<a>*<b>="`` (a of 4-8 digits) with 20% exact copies, in a Parquet file read
through ``schema.Column`` as the curate stage reads its pool. Each size runs in its own process.

    python benchmarks/dedup_memory.py --sizes 100000 300000

Prints a table (MiB over the process's traced memory at the start, per phase) and writes
``benchmarks/results/dedup_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PHASES = ("boilerplate", "pass 1", "_exact_copies", "_candidates", "pass 2 and after")


def one(n: int) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import posttrain.dedup as D
    import posttrain.dedup.minhash as MH
    from posttrain.config import Dedup
    from posttrain.schema import Column

    rng = np.random.default_rng(0)
    a, b = rng.integers(1000, 10**8, n), rng.integers(1, 10, n)
    dup, src = rng.random(n) < 0.2, rng.integers(0, n, n)
    a[dup], b[dup] = a[src[dup]], b[src[dup]]
    tmp = Path(tempfile.mkdtemp())
    path = tmp / "pool.parquet"
    pq.write_table(pa.table({"prompt": [f"{x}*{y}=" for x, y in zip(a.tolist(), b.tolist(), strict=True)]}), path,
                   row_group_size=8192)
    del a, b, dup, src
    import datasketch  # noqa: F401  (its import is not the index)

    phase, peak = ["start"], {}

    def wrap(mod, name: str, label: str, after: str) -> None:
        f = getattr(mod, name)

        def g(*args, **kw):
            phase[0] = label
            out = f(*args, **kw)
            phase[0] = after
            return out
        setattr(mod, name, g)

    wrap(D, "boilerplate", "boilerplate", "pass 1")
    wrap(MH, "_exact_copies", "_exact_copies", "_candidates")
    wrap(MH, "_candidates", "_candidates", "pass 2 and after")
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[phase[0]] = max(peak.get(phase[0], 0), tracemalloc.get_traced_memory()[1] - base)
            tracemalloc.reset_peak()
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    t0 = time.time()
    _, found = D.find_duplicates(Column(path, "prompt"), Dedup(method="minhash"), tmp)
    done.set()
    t.join()
    return {"rows": n, "duplicates": len(found), "seconds": round(time.time() - t0, 1),
            "peak_mib": {k: round(peak.get(k, 0) / 2**20, 1) for k in PHASES}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dedup_memory.json")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one)))
        return
    rows = []
    print("| rows | duplicates | s | " + " | ".join(PHASES) + " |\n|---:|---:|---:|" + "---:|" * len(PHASES))
    for n in a.sizes:
        r = subprocess.run([sys.executable, __file__, "--one", str(n)], capture_output=True, text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        x = rows[-1]
        print(f"| {n} | {x['duplicates']} | {x['seconds']} | " + " | ".join(str(x["peak_mib"][k]) for k in PHASES)
              + " |", flush=True)
    a.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
