"""The matmul floor of decoding one token on this CPU (issue 45, item 3): tokens/s at the model's own linear
shapes, fp32 and bf16, at the decode rows ``--rows`` (the sequences decoded together).

A token costs 2 (N_body + d V) FLOPs of matmuls (``compute_floor.token_flops``: every linear layer, the LM head apart);
the floor is that at the rates ``compute_floor.rates`` measures at M = rows. It leaves out attention over the KV
cache, sampling and the prefill, so it is a lower bound on a decode's time.

    python benchmarks/generation_floor.py --model models/base [--rows 64 256] [--threads 2]

prints the JSON and writes it to ``--out`` (benchmarks/results/generation_floor.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compute_floor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=compute_floor.ROOT / "benchmarks" / "results" / "generation_floor.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    body, head = compute_floor.token_flops(cfg)
    rates = compute_floor.rates(cfg, {f"decode_{m}": m for m in a.rows}, ["float32", "bfloat16"])
    out = {"model": a.model, "threads": a.threads, "cmd": " ".join(sys.argv),
           "per_token_mflop": {"body": round(body / 1e6, 1), "lm_head": round(head / 1e6, 1)}}
    for dt, r in rates.items():
        for m in a.rows:
            x = r[f"decode_{m}"]
            per_token_s = body / (x["body_gflops"] * 1e9) + head / (x["lm_head_gflops"] * 1e9)
            out[f"{dt}_rows_{m}"] = {"body_gflops": x["body_gflops"], "lm_head_gflops": x["lm_head_gflops"],
                                     "floor_tokens_per_s": round(1 / per_token_s, 1)}
        out[f"{dt}_peak_gflops"] = r["peak_gflops"]
    print(json.dumps(out, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
