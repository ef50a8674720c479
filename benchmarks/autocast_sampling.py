"""Sampling with the trainer's own fp32 policy, as the rl stage's hf backend does, with or without bf16 autocast.

The rl stage samples each step with the trainer's model (fp32 master weights that require grad) inside one
``torch.autocast`` region when ``model.dtype`` is bfloat16. This times ``HFBackend.generate`` on that setup: 8
arithmetic prompts x 8 samples, at most 64 new tokens, T 1, seed 0, 2 threads. ``--root`` picks the checkout
whose ``posttrain`` is imported, so two commits can be timed against each other, alternated (one warm-up
pair, then A B A B ...; the JSON lines are the per-run figures):

    for i in 0 1 2 3; do
      python benchmarks/autocast_sampling.py --root <old worktree> --model models/sft --dtype bfloat16 --json J
      python benchmarks/autocast_sampling.py --model models/sft --dtype bfloat16 --json J
    done

Appends one JSON line (root, dtype, completion tokens, generation seconds, tokens/s) to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model folder (e.g. models/sft of profiles/smollm2-arith.yaml)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="the autocast dtype")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="checkout whose posttrain runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    sys.path.insert(0, a.root)

    import torch

    from posttrain import modeling
    from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids

    torch.set_num_threads(a.threads)
    model, tok = modeling.load_model(a.model, "float32"), modeling.load_tokenizer(a.model)
    for p in model.parameters():
        p.requires_grad_(True)  # the trainer's policy
    model.eval()
    pairs = [(123, 7), (4567, 3), (89, 6), (2345, 8), (77, 9), (901, 4), (3141, 5), (62, 2)]
    ids = chat_prompt_ids(tok, [f"{x}*{y}=" for x, y in pairs])
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=64, seed=0)
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bfloat16"):
        out = BACKENDS["hf"](model, tok, 256).generate(ids, 8, sp)
    dt = time.perf_counter() - t
    n = sum(len(c.token_ids) for g in out for c in g)
    line = {"root": a.root, "dtype": a.dtype, "tokens": n, "s": round(dt, 2), "tokens_per_s": round(n / dt, 1)}
    print(json.dumps(line))
    with open(a.json, "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
