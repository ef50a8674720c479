"""Per-step (PRM-style) reward-model scoring: a forward per prefix vs a text's prefixes packed into one forward.

A ``reward_model`` reward with ``steps`` on scores every prefix of a completion (step ``j``: the text up to its
``j``-th separator, with the chat's end-of-turn tokens). Scored a forward per prefix, S steps of an n-token text
read about S x n / 2 tokens; packed (``RewardScorer.score_prefixes``: the text once, then its end-of-turn tail
once per step, each copy seeing only its own prefix through a 4D mask), about n + 2 S. Each repeat scores the
same texts with both arms, alternated; every repeat is reported, with the tokens each arm forwarded and the
largest score difference between them.

    python benchmarks/prm_prefix.py --model FOLDER [--steps 4 16 64] [--texts 4] [--repeats 3]
    # FOLDER: a causal LM or reward model folder (e.g. the model stage's SmolLM2 import); prints a table,
    # writes benchmarks/results/prm_prefix.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from posttrain import modeling
from posttrain.reward_model.scorer import RewardScorer, encode, load_scorer, pad_id

ROOT = Path(__file__).resolve().parents[1]


def texts(tok: object, steps: int, n: int) -> list[list[list[int]]]:
    """``n`` completions of ``steps`` lines each (arithmetic working), every prefix's token ids."""
    out = []
    for t in range(n):
        lines = [f"Step {j + 1}: {7 * t + j} * {j + 3} = {(7 * t + j) * (j + 3)}, carried over." for j in range(steps)]
        comp = "\n".join(lines)
        ends = [len("\n".join(lines[: j + 1])) for j in range(steps)]
        out.append([encode(tok, f"Problem {t}: multiply step by step.", comp[:e]) for e in ends])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = modeling.load_tokenizer(a.model)
    scorer = RewardScorer([load_scorer(a.model, "float32", "cpu", pad_token_id=pad_id(tok))], tok, {}, batch_size=8)
    rows = []
    for steps in a.steps:
        batch = texts(tok, steps, a.texts)
        for r in range(a.repeats):
            got = {}
            for arm in (("packed", "per_prefix") if r % 2 == 0 else ("per_prefix", "packed")):
                f0, t0 = scorer.forwarded, time.perf_counter()
                got[arm] = scorer.score_prefixes(batch, packed=arm == "packed")
                got[arm + "_s"], got[arm + "_tokens"] = time.perf_counter() - t0, scorer.forwarded - f0
            diff = max(float(np.abs(p - q).max()) for p, q in zip(got["packed"], got["per_prefix"], strict=True))
            rows.append({"steps": steps, "repeat": r, "text_tokens": len(batch[0][-1]),
                         "per_prefix_s": round(got["per_prefix_s"], 3), "packed_s": round(got["packed_s"], 3),
                         "speedup": round(got["per_prefix_s"] / got["packed_s"], 2),
                         "per_prefix_tokens": got["per_prefix_tokens"], "packed_tokens": got["packed_tokens"],
                         "max_abs_diff": diff})
            print(" | ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    print("\n| steps | text tokens | per prefix s | packed s | speedup | tokens per prefix | tokens packed "
          "| max diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['steps']} | {x['text_tokens']} | {x['per_prefix_s']} | {x['packed_s']} | {x['speedup']} | "
              f"{x['per_prefix_tokens']} | {x['packed_tokens']} | {x['max_abs_diff']:.1e} |")
    out = ROOT / "benchmarks" / "results" / "prm_prefix.json"
    out.write_text(json.dumps({"model": a.model, "texts": a.texts, "threads": a.threads, "cpu": platform.processor()
                               or platform.machine(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
