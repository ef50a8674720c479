"""Dedup: distinct problems kept, planted near-duplicates caught, time and memory at 10^4..10^6 rows.

Run: ``python benchmarks/dedup.py [--sizes 10000 100000 1000000]`` (needs ``$POSTTRAIN_BENCH``); a size run
apart (``--one 1000000 ngram > f.json``) is added with ``--append-rows f.json``.
Writes ``benchmarks/results/dedup.json`` and prints the tables.

1. Distinct MATH-500 problems dropped, for the old dedup (``before``: the decontamination index, no
   boilerplate cap, old defaults) and each method: the file as it is (with its "Please reason step by
   step..." suffix), the bare problems, and the bare problems in DAPO-Math-17k's instruction template.
2. Planted near-duplicates: light edits of real problems (re-spaced/re-cased, sentences reordered, LaTeX
   fractions as plain, one or two words changed, wrapped in the DAPO template that 30% of the rows carry,
   verbatim), never a changed number, appended to MATH-500 + GSM8K (test and train) rows. Recall per kind;
   precision = planted copies among the rows dropped (a dropped original row is a false positive).
3. Scaling: GSM8K/MATH problems with their numbers varied (1% re-spaced copies planted), each size and
   method in its own subprocess (peak RSS of that process), alternating the methods.
4. The quadratic case: distinct GSM8K rows sharing one suffix, old dedup vs each method.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCH = Path(os.environ.get("POSTTRAIN_BENCH", "."))  # the benchmark files (docs/real-models.md#benchmark-files)
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
DAPO = ("Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\nRemember to put "
        "your answer on its own line after \"Answer:\".")
SWAPS = [("Find", "Compute"), ("Compute", "Find"), ("What is", "Determine"), ("How many", "What number of"),
         ("Calculate", "Compute"), ("Determine", "Find"), ("total", "overall"), ("each", "every"),
         ("If", "Suppose"), ("find", "determine"), ("has", "owns"), ("buys", "purchases")]


def load(name: str, key: str) -> list[str]:
    with open(BENCH / name) as f:
        return [json.loads(line)[key] for line in f]


def math500() -> list[str]:
    return load("math500.jsonl", "problem")


def bare(t: str) -> str:
    return t.replace(SUFFIX, "").strip()


# ------------------------------------------------------------------------------------------- edits
def respace_recase(t: str, rng: random.Random) -> str:
    t = rng.choice([str.upper, str.lower, str.title])(t)
    return "  " + re.sub(r" ", lambda _: rng.choice([" ", "  ", "\t"]), t.replace(", ", " , ").replace("?", " ?"))


def reordered(t: str, rng: random.Random) -> str | None:
    s = [x for x in re.split(r"(?<=[.?!])\s+(?=[A-Z$\\(])", t) if x]
    return " ".join(s[1:] + s[:1]) if len(s) > 1 else None


def latex_plain(t: str, rng: random.Random) -> str | None:
    out = t
    for _ in range(3):
        out = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", lambda m: f"({m.group(1)})/({m.group(2)})", out)
    out = re.sub(r"\^\{([^{}]*)\}", r"^\1", out).replace("\\cdot", "*").replace("\\left", "").replace("\\right", "")
    out = out.replace("$", "")
    return out if out != t else None


def words_changed(t: str, rng: random.Random) -> str | None:
    hits = [(a, b) for a, b in SWAPS if re.search(rf"\b{a}\b", t)]
    if not hits:
        return None
    for a, b in rng.sample(hits, min(len(hits), rng.choice([1, 2]))):
        t = re.sub(rf"\b{a}\b", b, t, count=1)
    return t


def templated(t: str, rng: random.Random) -> str:
    return DAPO.format(q=t)


def verbatim(t: str, rng: random.Random) -> str:
    return t


KINDS = {"respace_recase": respace_recase, "reordered": reordered, "latex_plain": latex_plain,
         "words_changed": words_changed, "templated": templated, "verbatim": verbatim}


def cfg(method: str, **kw):
    from posttrain.config import Dedup

    return Dedup(method=method, **kw)


def old_dedup(texts: list[str], n: int = 5, threshold: float = 0.8) -> int:
    """The dedup before this change: decontamination's index, every n-gram indexed, walked in full, with
    the tokenizer it had (``\\w+``: ``2x`` one token)."""
    from posttrain import decontam

    new_re, decontam._WORD_RE = decontam._WORD_RE, re.compile(r"\w+|[^\w\s]")
    try:
        index, dropped = decontam.NgramIndex(n), 0
        for i, t in enumerate(texts):
            m = index.query(t)
            if m is not None and m.score >= threshold:
                dropped += 1
                continue
            index.add(str(i), t)
    finally:
        decontam._WORD_RE = new_re
    return dropped


def new_dedup(texts: list[str], method: str) -> list:
    from posttrain.dedup import find_duplicates

    return find_duplicates(texts, cfg(method))[1]


# ------------------------------------------------------------------------------------------ quality
def distinct_math500() -> dict:
    probs = math500()
    sets = {"as_is": probs, "bare": [bare(p) for p in probs], "dapo": [DAPO.format(q=bare(p)) for p in probs],
            "dapo_as_is": [DAPO.format(q=p) for p in probs]}
    out = {}
    for name, texts in sets.items():
        out[name] = {"before": old_dedup(texts)}
        for method in ("ngram", "minhash"):
            dups = new_dedup(texts, method)
            out[name][method] = len(dups)
            out[name][f"{method}_pairs"] = [(d.row, d.of, d.method, d.score) for d in dups]
    return out


def planted_corpus(per_kind: int, seed: int, train_rows: int) -> tuple[list[str], dict[int, str]]:
    rng = random.Random(seed)
    base = [bare(p) for p in math500()] + load("gsm8k_test.jsonl", "question")
    base += load("gsm8k_train.jsonl", "question")[:train_rows]
    rows = [DAPO.format(q=t) if rng.random() < 0.3 else t for t in base]  # a mixed set: 30% templated
    planted: dict[int, str] = {}
    for kind, fn in KINDS.items():
        made = 0
        while made < per_kind:
            j = rng.randrange(len(base))
            if rows[j] != base[j]:
                continue  # plant copies of the plain rows (the templated kind wraps them)
            edit = fn(base[j], rng)
            if edit is None or edit == base[j] and kind != "verbatim":
                continue
            planted[len(rows)] = kind
            rows.append(edit)
            made += 1
    return rows, planted


def recall_precision(per_kind: int, seed: int, train_rows: int) -> dict:
    rows, planted = planted_corpus(per_kind, seed, train_rows)
    out = {"rows": len(rows), "planted": len(planted), "per_kind": per_kind}
    for method in ("ngram", "minhash"):
        t = time.perf_counter()
        dups = new_dedup(rows, method)
        secs = time.perf_counter() - t
        gone = {d.row: d for d in dups}
        recall = {k: sum(1 for i, kk in planted.items() if kk == k and i in gone) / per_kind for k in KINDS}
        caught = sum(1 for i in planted if i in gone)
        fps = [(d.row, d.of, d.method, d.score, rows[d.row][:60], rows[d.of][:60]) for d in dups
               if d.row not in planted]
        out[method] = {"recall": recall, "recall_all": caught / len(planted),
                       "precision": caught / max(1, len(dups)), "false_positives": len(fps),
                       "fp_examples": fps[:10], "seconds": round(secs, 2)}
    return out


# ------------------------------------------------------------------------------------------ scaling
def synthetic(rows: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = [bare(p) for p in math500()] + load("gsm8k_test.jsonl", "question") + load("gsm8k_train.jsonl",
                                                                                      "question")
    out = []
    for _ in range(rows):
        if out and rng.random() < 0.01:
            out.append(respace_recase(out[rng.randrange(len(out))], rng))
            continue
        t = rng.choice(pool)
        out.append(re.sub(r"\d+", lambda m: str(rng.randint(2, 10 ** len(m.group()) + 50)), t))
    return out


def _status_mb(key: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process from /proc, in MB (``ru_maxrss`` would carry the parent's
    peak across fork+exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return round(int(line.split()[1]) / 1024)
    return -1


def one_scaling_run(rows: int, method: str) -> dict:
    """In a fresh process: build the rows, dedup them, report time and peak RSS."""
    texts = synthetic(rows, seed=rows)
    rss0 = _status_mb("VmRSS")
    t, c = time.perf_counter(), time.process_time()
    dups = new_dedup(texts, method) if method != "before" else old_dedup(texts)
    secs, cpu = time.perf_counter() - t, time.process_time() - c
    n = len(dups) if isinstance(dups, list) else dups
    return {"rows": rows, "method": method, "seconds": round(secs, 2), "cpu_seconds": round(cpu, 2),
            "cpu_us_per_row": round(1e6 * cpu / rows), "load_avg_1m": os.getloadavg()[0],
            "dropped": n, "rss_before_mb": rss0, "peak_rss_mb": _status_mb("VmHWM")}


def quadratic(sizes: list[int]) -> list[dict]:
    qs = load("gsm8k_train.jsonl", "question")
    out = []
    for n in sizes:
        texts = [q + SUFFIX for q in qs[:n]]
        for arm in ("before", "ngram", "minhash"):
            t, c = time.perf_counter(), time.process_time()
            d = old_dedup(texts) if arm == "before" else len(new_dedup(texts, arm))
            out.append({"rows": n, "arm": arm, "seconds": round(time.perf_counter() - t, 2),
                        "cpu_seconds": round(time.process_time() - c, 2), "dropped": d})
            print(f"  quadratic {n:>5} {arm:8} wall {out[-1]['seconds']:6.2f}s CPU {out[-1]['cpu_seconds']:6.2f}s "
                  f"dropped {d}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--methods", nargs="*", default=["ngram", "minhash"])
    ap.add_argument("--per-kind", type=int, default=200)
    ap.add_argument("--train-rows", type=int, default=7473)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: ROWS METHOD in this process
    ap.add_argument("--append-rows", nargs="*", default=[],
                    help="only add to the results file's scaling table the rows printed by `--one ROWS METHOD` runs "
                    "made apart (the 10^6-row runs, run alongside the rest)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dedup.json"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one_scaling_run(int(a.one[0]), a.one[1])))
        return
    if a.append_rows:
        res = json.loads(Path(a.out).read_text())
        for path in a.append_rows:
            row = {**json.loads(Path(path).read_text().strip().splitlines()[-1]), "run_apart": True}
            res["scaling"] = [r for r in res["scaling"] if (r["rows"], r["method"]) != (row["rows"], row["method"])]
            res["scaling"].append(row)
            res.setdefault("append_commands", []).append(" ".join(sys.argv))
        for row in sorted(res["scaling"], key=lambda r: (r["rows"], r["method"])):
            _print_row(row)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return
    res: dict = {"command": " ".join(sys.argv)}
    res["distinct_math500_dropped"] = d = distinct_math500()
    print("distinct MATH-500 problems dropped (of 500)\n| set | before | ngram | minhash |\n|---|---:|---:|---:|")
    for name, r in d.items():
        print(f"| {name} | {r['before']} | {r['ngram']} | {r['minhash']} |")
    res["planted"] = p = recall_precision(a.per_kind, 0, a.train_rows)
    print(f"\nplanted near-duplicates: {p['planted']} in {p['rows']} rows\n| method | "
          + " | ".join(KINDS) + " | all | precision | false pos | s |\n|---|" + "---:|" * (len(KINDS) + 4))
    for m in ("ngram", "minhash"):
        r = p[m]
        print(f"| {m} | " + " | ".join(f"{100 * r['recall'][k]:.1f}%" for k in KINDS)
              + f" | {100 * r['recall_all']:.2f}% | {100 * r['precision']:.2f}% | {r['false_positives']} |"
              f" {r['seconds']} |")
    res["quadratic"] = quadratic([1000, 2000, 3000])
    res["scaling"] = []
    print("\n| rows | method | wall s | CPU s | CPU µs/row | load | dropped | RSS before MB | peak RSS MB |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for rows in a.sizes:
        for method in a.methods:
            r = subprocess.run([sys.executable, __file__, "--one", str(rows), method], capture_output=True,
                               text=True, check=True)
            row = json.loads(r.stdout.strip().splitlines()[-1])
            res["scaling"].append(row)
            _print_row(row)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


def _print_row(row: dict) -> None:
    print(f"| {row['rows']} | {row['method']} | {row['seconds']} | {row['cpu_seconds']} | {row['cpu_us_per_row']} | "
          f"{row['load_avg_1m']:.1f} | {row['dropped']} | {row['rss_before_mb']} | {row['peak_rss_mb']} |", flush=True)


if __name__ == "__main__":
    main()
