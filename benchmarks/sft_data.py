"""SFT data path: tokenization once vs per rendering, and padded / grouped / packed micro-batches.

Two demo sets of ``--demos`` rows: ``default`` (the default task's demos: ``a*b=`` with a of 2-4 digits and b
of 2-9, full chain of thought or bare answer, 19-74 tokens) and ``skewed`` (the same, with 5% of the demos'
solutions repeated 3-10 times: a few traces of 130-750 tokens among short ones, as real reasoning SFT
sets are). On each, ``training.sft_train`` runs ``--steps`` steps of the default recipe's shape (the tiny
model of params.yaml, batch 64, lr 1e-6 so every arm sees nearly the same weights) per arm:

- ``padded/64``: today's default (one micro-batch of 64, padded to its longest),
- ``padded/16``, ``grouped/16``, ``packed/16``: micro-batches of 16 (the usual memory fix), in sampling order
  / sorted by length / packed into block-diagonal rows,
- ``packed/64``.

Arms alternate within each repeat (the machine is shared and noisy); every repeat is reported. Measured:
completion tokens per second (``tokens / seconds`` of ``sft_train``, the stage's ``tokens_per_s``) and the
padding fraction of the decoder input (1 - real tokens / input positions). Tokenization: the old per-demo
encoding (each style's prompt and full conversation rendered separately: 4 renders per demo) against
``sft_data.tokenize`` (a batched ``datasets.map``, 3 renders per demo), alternated, in seconds.

    python benchmarks/sft_data.py [--demos 2000] [--steps 5] [--repeats 3] [--json benchmarks/results/sft_data.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from posttrain import sft_data, training  # noqa: E402
from posttrain.config import Sft, load_params  # noqa: E402
from posttrain.modeling import build_char_tokenizer, build_tiny_model  # noqa: E402
from posttrain.tasks import get_task  # noqa: E402
from posttrain.tasks.arith import make_problem, sample_operands  # noqa: E402

ARMS = [("padded", 64), ("padded", 16), ("grouped", 16), ("packed", 16), ("packed", 64)]


def demo_sets(n: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(seed)
    base = []
    for _ in range(n):
        a, b = sample_operands(rng, 2, 4, 2, 9)  # the default task's operands (params.yaml task:)
        prompt, answer = make_problem(a, b)
        base.append({"prompt": prompt, "answer": answer, "solution": None, "task": "arith"})
    skewed = []
    for x in base:
        if rng.random() < 0.05:
            cot = get_task("arith").render(x["prompt"], x["answer"], None, "cot")
            x = {**x, "solution": "\n".join([cot] * rng.randint(3, 10))}
        skewed.append(x)
    return {"default": base, "skewed": skewed}


def old_encode(tok: Any, demos: list[dict[str, Any]]) -> int:
    """The encoding before sft_data: both styles, each demo's prompt and full conversation rendered apart."""
    n = 0
    for style in ("cot", "direct"):
        for x in demos:
            ids, _ = sft_data.encode_sft(tok, x["prompt"], get_task(x["task"]).render(
                x["prompt"], x["answer"], x["solution"], style))
            n += len(ids)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--demos", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/sft_data.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    tok = build_char_tokenizer()
    sets = demo_sets(args.demos)
    rows: list[dict[str, Any]] = []
    tok_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats if args.repeats < 2 else 2):  # tokenization, alternated
            for how in ("old: 4 renders/demo", "sft_data.tokenize"):
                t0 = time.perf_counter()
                if how.startswith("old"):
                    old_encode(tok, sets["default"])
                else:
                    sft_data.tokenize(tok, sets["default"], Path(tmp) / f"tok{rep}")
                tok_rows.append({"repeat": rep, "how": how, "demos": args.demos,
                                 "seconds": round(time.perf_counter() - t0, 3)})
                print(tok_rows[-1], flush=True)
        for rep in range(args.repeats):
            for name, demos in sets.items():
                for batching, micro in ARMS:
                    model = build_tiny_model(params.model.tiny, tok, params.seed)
                    cfg = Sft(phases=[{"steps": args.steps, "cot_frac": 1.0}], batch_size=64,
                              micro_batch_size=micro, lr=1e-6, warmup_steps=0, batching=batching,
                              checkpoint_every=10**6, log_every=args.steps)
                    # the tokenized file is reused across arms (its digest names it): only training is timed
                    res = training.sft_train(model, tok, demos, cfg, params.seed, Path(tmp) / name, "bench",
                                             progress=False)
                    rows.append({"repeat": rep, "demos": name, "batching": batching, "micro_batch_size": micro,
                                 "seconds": round(res["seconds"], 3), "tokens": res["tokens"],
                                 "tokens_per_s": round(res["tokens"] / res["seconds"], 1),
                                 "padding_frac": res["data"]["padding_frac"]})
                    print(rows[-1], flush=True)
    summary = []
    print(f"\n{'demos':8} {'arm':12} {'tokens/s (median; every repeat)':44} {'padding':>8}")
    for name in sets:
        for batching, micro in ARMS:
            mine = [r for r in rows if r["demos"] == name and r["batching"] == batching
                    and r["micro_batch_size"] == micro]
            tps = [r["tokens_per_s"] for r in mine]
            summary.append({"demos": name, "batching": batching, "micro_batch_size": micro,
                            "tokens_per_s_median": statistics.median(tps), "tokens_per_s": tps,
                            "padding_frac": mine[0]["padding_frac"]})
            print(f"{name:8} {batching + '/' + str(micro):12} {statistics.median(tps):8.0f}  {str(tps):34} "
                  f"{mine[0]['padding_frac']:8.3f}")
    for r in tok_rows:
        print(f"tokenize {r['demos']} demos, {r['how']:22}: {r['seconds']:.2f} s (repeat {r['repeat']})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "command": f"python benchmarks/sft_data.py --demos {args.demos} --steps {args.steps} "
                   f"--repeats {args.repeats} --threads {args.threads}",
        "summary": summary, "runs": rows, "tokenize": tok_rows}, indent=2))


if __name__ == "__main__":
    main()
