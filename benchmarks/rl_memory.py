"""An rl step's per-token data path, before and after it became tensors: peak RSS and bytes all-gathered per rank.

One synthetic step (default 128 prompts x G 4 = 512 samples of 1,024 tokens; rewards fixed, no model) through
the path a step's data takes between sampling and the update's forwards, at world size 2 (torchrun, gloo), the
update configured off-policy with a KL (old and reference log-probs are filled):

- ``before`` (main's path, reproduced here): ``collect`` gathers every rank's scored rows to every rank
  (``all_gather_object``); ``update`` builds a ``Seq`` of Python lists for every sample of the step on every
  rank; ``logprobs.fill`` scores each rank's share and gathers the per-token lists (old, then reference
  log-probs) to every rank.
- ``after`` (this code): ``collect.StepBatch.add`` keeps the rank's rows (numpy token ids / log-probs) and
  all-gathers three float64 scalars per sample; ``Seq`` holds tensors of the rank's own samples; ``fill`` sets
  the rank's own old / reference log-probs (no collective); ``policy_update``'s one gather of lengths.

The sampler's output (rows of Python lists, as ``rollout.sample_rows`` returns them) exists in both arms before
the measured path; the stand-in for the model's log-probs is the sampler's own plus 0. Each arm runs in fresh
processes (peak RSS is per process), the arms alternate, every repeat is reported. Bytes: what each rank
receives from ``all_gather`` (``all_gather_object`` runs on it too), counted by wrapping it.

    python benchmarks/rl_memory.py [--prompts 128] [--g 4] [--tokens 1024] [--repeats 3]

prints a table and writes benchmarks/results/rl_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class OldSeq:  # main's logprobs.Seq: every per-token field a Python list
    prompt_ids: list
    completion_ids: list
    logprobs: list
    adv: float
    old_logp: list | None = None
    ref_logp: list | None = None


def synth_rows(d, n_prompts: int, g: int, tokens: int) -> list[dict]:
    """This rank's share of the step as ``sample_rows`` + ``score_rows`` return it (Python lists)."""
    rng = random.Random(d.rank)
    lo, hi = d.rank * n_prompts // d.world, (d.rank + 1) * n_prompts // d.world
    return [{"prompt_id": f"p{i}", "sample": j, "prompt": f"{i}*7=", "answer": str(7 * i), "task": "arith",
             "completion": "x" * tokens, "token_ids": [rng.randrange(3, 60) for _ in range(tokens)],
             "logprobs": [-rng.random() for _ in range(tokens)], "num_tokens": tokens, "finish_reason": "length",
             "policy": "p@1",
             "temperature": 1.0, "top_p": 1.0, "max_new_tokens": tokens, "seed": 0, "reward": float((i + j) % 2),
             "rewards": json.dumps({"correct": float((i + j) % 2)})} for i in range(lo, hi) for j in range(g)]


def worker(arm: str, out: str, n_prompts: int, g: int, tokens: int) -> None:
    import torch
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    from posttrain import distributed
    from posttrain.logprobs import Seq
    from posttrain.rl.collect import StepBatch  # imported by both arms, before the measured path

    d = distributed.init("gloo", "ddp", 600)
    received = [0]
    real = distributed_c10d.all_gather

    def counted(tensor_list, tensor, *a, **k):  # every all_gather, all_gather_object's included
        received[0] += sum(t.numel() * t.element_size() for t in tensor_list)
        return real(tensor_list, tensor, *a, **k)

    distributed_c10d.all_gather = tdist.all_gather = counted
    prompt_ids = {f"p{i}": [1, 2, 3, 4, 5, 6, 7, 8] for i in range(n_prompts)}
    local = synth_rows(d, n_prompts, g, tokens)
    d.barrier()
    rss0, t0 = rss_mb(), time.time()
    if arm == "before":
        rows = d.gather_shards(local)  # collect: every rank's rows on every rank
        del local
        seqs = [OldSeq(prompt_ids[r["prompt_id"]], list(r["token_ids"]), list(r["logprobs"]), 0.0)
                for r in rows if r["reward"] is not None]
        for attr in ("old_logp", "ref_logp"):  # fill: each rank scores its share, the lists gathered
            mine = d.shard(seqs)
            for s, v in zip(seqs, d.gather_shards([[x + 0.0 for x in s.logprobs] for s in mine]), strict=True):
                setattr(s, attr, v)
        held = (rows, seqs)
    else:
        sb = StepBatch(g)
        sb.add([f"p{i}" for i in range(n_prompts)], local)  # the rank's rows kept, scalars gathered
        del local
        seqs = [Seq(prompt_ids[r["prompt_id"]], r["token_ids"], r["logprobs"], 0.0)
                for grp in sb.rows.values() for r in grp if r["reward"] is not None]
        for s in seqs:  # fill: the rank's own sequences, no collective
            s.old_logp, s.ref_logp = s.logprobs + 0.0, s.logprobs + 0.0
        d.gather_tensor(torch.tensor([[d.rank, len(s.completion_ids), 1] for s in seqs]))  # policy_update's gather
        held = (sb, seqs)
    d.barrier()
    res = {"arm": arm, "rank": d.rank, "seconds": round(time.time() - t0, 3), "rss_before_mb": round(rss0, 1),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "held_rss_mb": round(rss_mb(), 1), "gathered_bytes": received[0], "samples_held": len(held[1])}
    res["peak_over_start_mb"] = round(res["peak_rss_mb"] - rss0, 1)
    Path(out).with_suffix(f".rank{d.rank}.json").write_text(json.dumps(res))
    distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", nargs=2, metavar=("ARM", "OUT"))
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker[0], a.worker[1], a.prompts, a.g, a.tokens)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for arm in ("before", "after"):  # alternated
                out = Path(tmp) / f"{arm}{rep}"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(Path(__file__).resolve()), "--prompts", str(a.prompts), "--g", str(a.g), "--tokens",
                       str(a.tokens), "--worker", arm, str(out)]
                r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
                if r.returncode:
                    sys.exit(r.stderr[-3000:])
                for rank in (0, 1):
                    runs.append({"repeat": rep, **json.loads(out.with_suffix(f".rank{rank}.json").read_text())})
    print(f"{a.prompts * a.g} samples x {a.tokens} tokens, world size 2 (gloo); per rank")
    print(f"{'arm':7} {'rep':>3} {'rank':>4} {'gathered MB':>11} {'peak RSS MB':>11} {'peak - start':>12} "
          f"{'held MB':>8} {'samples':>7} {'s':>6}")
    for x in runs:
        print(f"{x['arm']:7} {x['repeat']:>3} {x['rank']:>4} {x['gathered_bytes'] / 2**20:>11.3f} "
              f"{x['peak_rss_mb']:>11.1f} {x['peak_over_start_mb']:>12.1f} {x['held_rss_mb']:>8.1f} "
              f"{x['samples_held']:>7} {x['seconds']:>6.2f}")
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "rl_memory.json").write_text(json.dumps(
        {"samples": a.prompts * a.g, "tokens": a.tokens, "world": 2, "command": "python " + " ".join(sys.argv),
         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
