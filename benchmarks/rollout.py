"""Generation throughput of the ``hf`` rollout backend against a plain ``model.generate`` baseline.

Models: the pipeline's SFT checkpoint (``paths.sft_model``, 1.06M params; falls back to a random-init model
of the same shape) and a random-init Llama of about 56M parameters (hidden 768, 8 layers, intermediate
2048) with the character tokenizer. Sampling at temperature 1, prompts from the synthetic task, ``--new``
new tokens at most (a random-init model seldom emits EOS, so it decodes to the limit). Per model x batch
size x torch threads x device: completion tokens/s of our backend (sampler log-probs included) and of
``model.generate(do_sample=True)`` without scores, each the median of ``--repeats`` runs after a warm-up.
On a machine with CUDA the same grid runs on the GPU too.

    python benchmarks/rollout.py [--repeats 3] [--device all|cpu|cuda] [--json benchmarks/results/rollout_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from posttrain import modeling  # noqa: E402
from posttrain.config import TinyModel  # noqa: E402
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids  # noqa: E402


def prompts(tok: Any, n: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return chat_prompt_ids(tok, [f"{rng.randint(10, 9999)}*{rng.randint(2, 9)}=" for _ in range(n)])


def ours(model: Any, tok: Any, ids: list[list[int]], new: int, seed: int) -> int:
    out = BACKENDS["hf"](model, tok, len(ids)).generate(ids, 1, SamplingParams(1.0, 1.0, new, seed))
    return sum(len(c.token_ids) for g in out for c in g)


@torch.inference_mode()
def baseline(model: Any, tok: Any, ids: list[list[int]], new: int, seed: int) -> int:
    width = max(len(p) for p in ids)
    x = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ids], device=model.device)
    m = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=model.device)
    torch.manual_seed(seed)
    out = model.generate(input_ids=x, attention_mask=m, do_sample=True, temperature=1.0, top_p=1.0, top_k=None,
                         max_new_tokens=new, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    new_ids = out[:, width:].cpu()
    n = 0
    for row in new_ids.tolist():  # up to and including EOS, as the backend counts
        n += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    return n


def measure(fn: Any, model: Any, tok: Any, ids: list[list[int]], new: int, repeats: int) -> float:
    fn(model, tok, ids, new, 999)  # warm-up
    rates = []
    for r in range(repeats):
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        n = fn(model, tok, ids, new, r)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", default="models/sft")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=80)
    ap.add_argument("--json", default="benchmarks/results/rollout_cpu.json")
    ap.add_argument("--device", choices=["all", "cpu", "cuda"], default="all", help="all: cpu, and cuda if present")
    args = ap.parse_args()
    tok = modeling.build_char_tokenizer()
    if Path(args.sft).is_dir():
        tiny = modeling.load_model(args.sft, "float32", "cpu")
        tok = modeling.load_tokenizer(args.sft)
    else:
        tiny = modeling.build_tiny_model(TinyModel(), tok, 0)
    big = modeling.build_tiny_model(TinyModel(hidden_size=768, num_layers=8, num_heads=12, intermediate_size=2048,
                                              max_position_embeddings=256), tok, 0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) if args.device == "all" else [args.device]
    grid = {"tiny": (tiny, [16, 64, 128, 256], args.new), "llama-56M": (big, [16, 64], min(args.new, 48))}
    rows = []
    for dev in devices:
        threads = [1, 2] if dev == "cpu" else [torch.get_num_threads()]
        for name, (model, batches, new) in grid.items():
            model = model.to(dev).eval()
            for th in threads:
                torch.set_num_threads(th)
                for bs in (batches if dev == "cpu" else [*batches, 512]):
                    ids = prompts(tok, bs)
                    a = measure(ours, model, tok, ids, new, args.repeats)
                    b = measure(baseline, model, tok, ids, new, args.repeats)
                    rows.append({"device": dev, "model": name, "params_M": round(modeling.num_params(model) / 1e6, 2),
                                 "batch": bs, "threads": th, "max_new": new, "ours_tok_s": round(a),
                                 "generate_tok_s": round(b), "speedup": round(a / b, 2)})
                    print(rows[-1], flush=True)
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
