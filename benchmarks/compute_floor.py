"""The compute floor of one RL step on this CPU, and the rl stage's measured step as a multiple of it, per phase
(issue 45, item 2).

1. **Matmul throughput** on the model's own shapes: every distinct linear layer of the model's config (q, k, v,
   o, gate, up, down, the LM head), ``x[M, in] @ W[in, out]`` in fp32 and bf16, at the M each phase runs at:
   generation's decode rows (one new token for each sequence still running: the step's sequences, at most
   ``generate_batch_size``) and the update's tokens (``micro_batch_size`` sequences of prompt + completion). A
   phase's *rate* is its FLOPs-weighted rate over those shapes (the sum of FLOPs over the sum of times); the
   *peak* is the best rate any shape reached at any M. Each timing repeats the product until 0.2 s have passed.
2. **FLOPs of one RL step**, counted from the model's config and the step's real lengths (the rl stage's shards:
   each sample's prompt tokens through the chat template, its completion's ``num_tokens``):
   - generation: each prompt's prefill once for its samples (2 N_body per token, causal attention), then per new
     token 2 (N_body + d V) and attention 4 L d_attn ctx (QK^T and AV over a context of ctx tokens);
   - update: forward 2 N_body T + 2 d V c (the memory-lean path runs the LM head at completion positions only)
     + causal attention 2 L d_attn T^2, backward twice the forward; plus one no-grad forward for old log-probs
     when the update is not on-policy (``--old-logprobs``) and one for a KL reference (``--reference``).
   N_body is the non-embedding parameters (no embedding lookup FLOPs), d the hidden size, V the vocabulary.
3. **The floor** of a phase is its FLOPs at its rate (and at the peak); the multiple is the stage's measured time
   for that phase (``gen_s``, ``update_s`` of the rl train log) over it.

    python benchmarks/compute_floor.py --model <policy folder> --rl-dir data/rl --train-log reports/rl/train_log.csv \
        [--generate-batch 256] [--micro-batch 8] [--dtypes float32 bfloat16] [--threads 2]

prints the tables and writes benchmarks/results/compute_floor.json. A floor is a lower bound: generation at M of
a few dozen rows is bound by reading the weights, not by FLOPs, which the rate at the decode M already shows.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain import modeling  # noqa: E402
from posttrain.rollout.base import chat_prompt_ids  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (in, out, count per model) of every linear layer of a Llama/Qwen2-style config."""
    d, ff, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head
    q = cfg["num_attention_heads"] * head
    return {"q": (d, q, n_layers), "k": (d, kv, n_layers), "v": (d, kv, n_layers), "o": (q, d, n_layers),
            "gate": (d, ff, n_layers), "up": (d, ff, n_layers), "down": (ff, d, n_layers),
            "lm_head": (d, cfg["vocab_size"], 1)}


def time_matmul(m: int, n_in: int, n_out: int, dtype: torch.dtype, min_s: float = 0.2) -> float:
    """Seconds of one ``x[m, n_in] @ W^T`` (``F.linear``, as the model runs it), the mean over >= ``min_s``."""
    x, w = torch.randn(m, n_in, dtype=dtype), torch.randn(n_out, n_in, dtype=dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_s:
        torch.nn.functional.linear(x, w)
        n += 1
    return elapsed / n


def rates(cfg: dict, ms: dict[str, int], dtypes: list[str]) -> dict[str, dict]:
    """Per dtype and phase: the FLOPs-weighted GFLOP/s over the model's shapes at that phase's M (body and LM
    head apart), and each shape's GFLOP/s."""
    out: dict[str, dict] = {}
    for name in dtypes:
        out[name] = {}
        for phase, m in ms.items():
            per, body_f, body_t = {}, 0.0, 0.0
            for s, (n_in, n_out, count) in shapes(cfg).items():
                t = time_matmul(m, n_in, n_out, DTYPES[name])
                flops = 2.0 * m * n_in * n_out
                per[s] = round(flops / t / 1e9, 3)
                if s != "lm_head":
                    body_f, body_t = body_f + flops * count, body_t + t * count
            out[name][phase] = {"m": m, "body_gflops": round(body_f / body_t / 1e9, 3),
                                "lm_head_gflops": per["lm_head"], "per_shape": per}
        out[name]["peak_gflops"] = max(v for p in ms for v in out[name][p]["per_shape"].values())
    return out


def token_flops(cfg: dict) -> tuple[float, float]:
    """Matmul FLOPs of one token through the body (2 N_body: every linear layer but the LM head) and through the
    LM head (2 d V)."""
    body = sum(2.0 * i * o * c for k, (i, o, c) in shapes(cfg).items() if k != "lm_head")
    return body, 2.0 * cfg["hidden_size"] * cfg["vocab_size"]


Sample = tuple[str, int, int, bool]  # (prompt id, prompt tokens, completion tokens, used in the update)


def step_lengths(rl_dir: Path, tok: object) -> dict[int, list[Sample]]:
    """step -> the step's samples (used: it entered the update; skipped groups and unscorable samples were only
    generated), from the rl stage's shards."""
    steps: dict[int, list[Sample]] = {}
    cache: dict[str, int] = {}
    for f in sorted((rl_dir / "shards").glob("step_*.parquet")):
        for r in pq.read_table(f, columns=["step", "prompt_id", "prompt", "num_tokens", "used"]).to_pylist():
            if r["prompt"] not in cache:
                cache[r["prompt"]] = len(chat_prompt_ids(tok, [r["prompt"]])[0])
            steps.setdefault(int(r["step"]), []).append((r["prompt_id"], cache[r["prompt"]],
                                                         int(r["num_tokens"] or 0), bool(r["used"])))
    return steps


def step_flops(cfg: dict, lens: list[Sample], forwards: int) -> dict[str, dict[str, float]]:
    """FLOPs of generation (every sample) and of the update (the samples it used), split body / LM head /
    attention, for one step (module docstring); ``forwards``: the update's extra no-grad forwards (old
    log-probs, a reference)."""
    sh = shapes(cfg)
    body, head = token_flops(cfg)
    d_attn, n_layers = sh["q"][1], cfg["num_hidden_layers"]
    g = {"body": 0.0, "lm_head": 0.0, "attention": 0.0}
    u = dict(g)
    prefilled: set[str] = set()
    for pid, p, c, used in lens:
        if pid not in prefilled:  # a prompt's samples share one prefill (the hf backend and vLLM both do)
            prefilled.add(pid)
            g["body"] += body * p
            g["attention"] += 4.0 * n_layers * d_attn * p * p / 2
        g["body"] += body * c
        g["lm_head"] += head * c  # one distribution per new token: the prefill's last position, then each but the last
        g["attention"] += 4.0 * n_layers * d_attn * (p * c + c * c / 2)
        if not used:
            continue
        t = p + c
        passes = 3 + forwards  # forward + backward (2x) + the no-grad forwards
        u["body"] += passes * body * t
        u["lm_head"] += passes * head * c
        u["attention"] += passes * 2.0 * n_layers * d_attn * t * t
    return {"generation": g, "update": u}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rl-dir", required=True, type=Path)
    ap.add_argument("--train-log", required=True, type=Path)
    ap.add_argument("--generate-batch", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--old-logprobs", action="store_true", help="the update scores old log-probs (not on-policy)")
    ap.add_argument("--reference", action="store_true", help="a KL reference is scored each step")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compute_floor.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    tok = modeling.load_tokenizer(a.model)
    steps = step_lengths(a.rl_dir, tok)
    log = {int(r["step"]): r for r in csv.DictReader(a.train_log.open())}
    missing = sorted(set(steps) - set(log))
    if missing:
        raise SystemExit(f"{a.train_log}: no row for steps {missing[:5]} that have shards in {a.rl_dir}")
    n_seq = statistics.median(len(v) for v in steps.values())
    mean_t = statistics.mean(p + c for v in steps.values() for _, p, c, _ in v)
    ms = {"decode": int(min(a.generate_batch, n_seq)), "update": int(a.micro_batch * mean_t)}
    r = rates(cfg, ms, a.dtypes)
    rows = []
    for s, lens in sorted(steps.items()):
        f = step_flops(cfg, lens, int(a.old_logprobs) + int(a.reference))
        row = {"step": s, "samples": len(lens), "used": sum(u for *_, u in lens),
               "prompt_tokens": sum(p for _, p, _, _ in lens), "completion_tokens": sum(c for _, _, c, _ in lens),
               "gen_s": float(log[s]["gen_s"]), "update_s": float(log[s]["update_s"]),
               "gflop": {k: round(sum(v.values()) / 1e9, 1) for k, v in f.items()}}
        for name in a.dtypes:
            # body matmuls at the phase's body rate, the LM head at its own, attention at the body rate
            for phase, key, secs in (("generation", "decode", row["gen_s"]), ("update", "update", row["update_s"])):
                rr = r[name][key]
                floor = (f[phase]["body"] + f[phase]["attention"]) / (rr["body_gflops"] * 1e9) \
                    + f[phase]["lm_head"] / (rr["lm_head_gflops"] * 1e9)
                peak = sum(f[phase].values()) / (r[name]["peak_gflops"] * 1e9)
                row[f"{phase}_{name}"] = {  # an update that used no sample has no floor
                    "floor_s": round(floor, 2), "x_floor": round(secs / floor, 2) if floor else None,
                    "peak_floor_s": round(peak, 2), "x_peak": round(secs / peak, 2) if peak else None}
        rows.append(row)
    res = {"model": a.model, "threads": a.threads, "ms": ms, "rates": r, "steps": rows,
           "cmd": " ".join(sys.argv)}
    print(f"matmul GFLOP/s on {Path(a.model).name}'s shapes ({a.threads} threads):")
    print("| dtype | phase | M | body | LM head | peak (any shape, any M) |\n|---|---|---:|---:|---:|---:|")
    for name in a.dtypes:
        for phase in ms:
            x = r[name][phase]
            print(f"| {name} | {phase} | {x['m']} | {x['body_gflops']} | {x['lm_head_gflops']} | "
                  f"{r[name]['peak_gflops']} |")
    print(f"\nper step: measured seconds over the floor at {a.dtypes[0]} rates (the run's dtype):")
    print("| step | samples (used) | tokens (prompt + completion) | GFLOP gen / update | gen s (x floor, x peak) | "
          "update s (x floor, x peak) |\n|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        g, u = row[f"generation_{a.dtypes[0]}"], row[f"update_{a.dtypes[0]}"]
        print(f"| {row['step']} | {row['samples']} ({row['used']}) | {row['prompt_tokens']} + "
              f"{row['completion_tokens']} | "
              f"{row['gflop']['generation']} / {row['gflop']['update']} | {row['gen_s']:.0f} ({g['x_floor']}x, "
              f"{g['x_peak']}x) | {row['update_s']:.0f} ({u['x_floor']}x, {u['x_peak']}x) |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
