"""Where one RL step's time goes on a real model, op by op: the rest of the step above the compute floor
(issue 45, item 2; the floor itself is ``benchmarks/compute_floor.py``).

``torch.profiler`` (CPU, self time per op) over the two phases of one step of the rl stage, replayed from its
shards: **generation** (the ``hf`` backend, as the stage builds it, sampling the step's prompts x samples at the
stage's temperature, at most ``--new`` tokens each) and **update** (``update.policy_update`` on the step's samples
with their recorded advantages, the profile's ``rl`` settings: micro-batches, loss, one AdamW step). Each op's self
time goes to one group: matmul (``mm``/``addmm``/``bmm``), attention (SDPA and its backward), softmax and sampling,
copies and indexing (the KV cache's, the batch's), elementwise, norms and activations, the optimizer's ``_foreach``
ops (AdamW on CPU tensors runs per-tensor elementwise ops instead: its ``step`` is timed apart), and the rest;
``python`` is the wall time no op accounts for (the interpreter between ops, and the profiler's own cost, so the
phase under the profiler is slower than without it: both times are printed).

    python benchmarks/step_profile.py --model <run>/models/sft --rl-dir <run>/data/rl --step 3 \
        [--params profiles/smollm2-gsm8k.yaml] [--new 64] [--dtype bfloat16] \
        [--json benchmarks/results/step_profile.json]

prints a table per phase and writes the JSON (every op's self time, top 40 per phase).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain import logprobs, modeling  # noqa: E402
from posttrain.config import parse_params  # noqa: E402
from posttrain.config.params import read_yaml  # noqa: E402
from posttrain.rl import update  # noqa: E402
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids  # noqa: E402

GROUPS = [  # (group, aten op names: a name of over 3 letters also matches as a prefix); the first match wins
    ("optimizer", ("foreach",)),
    ("attention", ("scaled_dot_product",)),
    ("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
    ("softmax+sampling", ("softmax", "log_softmax", "logsumexp", "multinomial", "exponential", "argmax", "max",
                          "topk", "sort", "cumsum", "gather", "nll")),
    ("copy+index", ("copy", "to_copy", "cat", "index", "clone", "contiguous", "slice", "select", "repeat", "expand",
                    "view", "unsafe", "narrow", "stack", "fill", "zero", "empty", "as_strided", "transpose",
                    "permute", "reshape", "unsqueeze", "squeeze", "t", "to", "where", "masked", "detach")),
    ("norm+act+elementwise", ("mul", "add", "sub", "div", "pow", "rsqrt", "mean", "silu", "neg", "exp", "sum",
                              "embedding", "sqrt", "cos", "sin", "clamp", "lt", "gt", "eq", "ne", "abs", "sigmoid",
                              "log", "isin", "any", "all", "bitwise", "rms_norm", "fused")),
]


def group_of(name: str) -> str:
    """The group of an aten op (``GROUPS``), ``other`` when none matches."""
    base = name.split("::")[-1].strip("_")
    for group, keys in GROUPS:
        if any(base == k or (len(k) > 3 and base.startswith(k)) for k in keys):
            return group
    return "other"


def profile(fn: Any) -> tuple[float, dict[str, float], list[tuple[str, float, int]]]:
    """Runs ``fn`` under the CPU profiler: its wall seconds, seconds per group (+ ``python``), and each op's
    (name, self seconds, calls), most expensive first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    ops = sorted(((e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()
                  if e.self_cpu_time_total > 0), key=lambda x: -x[1])
    groups: dict[str, float] = {}
    for name, s, _ in ops:
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + s
    groups["python"] = max(0.0, wall - sum(groups.values()))
    return wall, groups, ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the step's policy folder (the rl stage's input: models/sft)")
    ap.add_argument("--rl-dir", required=True, type=Path, help="the rl stage's output folder (its shards)")
    ap.add_argument("--step", type=int, default=3, help="a step whose update used samples")
    ap.add_argument("--params", default=str(ROOT / "profiles" / "smollm2-gsm8k.yaml"))
    ap.add_argument("--new", type=int, default=64, help="max new tokens in the profiled generation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--phases", nargs="+", default=["generation", "update"], choices=["generation", "update"])
    ap.add_argument("--pack", action="store_true", help="rl.pack on (sequences packed, no padding)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="autocast dtype over the fp32 masters, as "
                    "the rl stage runs them (default: the params' model.dtype)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "step_profile.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    params = parse_params(read_yaml(Path(a.params).read_text()))
    cfg, dtype = params.rl, a.dtype or params.model.dtype
    cfg = cfg.model_copy(update={"pack": cfg.pack or a.pack})
    rows = pq.read_table(a.rl_dir / "shards" / f"step_{a.step:05d}.parquet").to_pylist()
    tok = modeling.load_tokenizer(a.model)
    model = modeling.load_model(a.model, "float32", trainable=True)
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    ids = chat_prompt_ids(tok, prompts)
    g = len(rows) // len(prompts)
    sp = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, a.new, 0)
    backend = BACKENDS["hf"](model, tok, cfg.generate_batch_size)
    out: dict[str, Any] = {"model": a.model, "params": a.params, "pack": cfg.pack, "step": a.step,
                           "dtype": dtype, "prompts": len(prompts), "samples_per_prompt": g,
                           "new": a.new, "threads": a.threads, "phases": {}}
    tokens = []

    def generate() -> None:
        model.eval()
        with modeling.autocast(dtype, torch.device("cpu")):  # one region a phase, as the stage's step
            groups = backend.generate(ids, g, sp)
        tokens.append(sum(len(c.token_ids) for grp in groups for c in grp))

    by_prompt = dict(zip(prompts, ids, strict=True))
    seqs = [logprobs.Seq(by_prompt[r["prompt"]], list(r["token_ids"]), list(r["logprobs"]), float(r["advantage"]))
            for r in rows if r["used"]] or [
        logprobs.Seq(by_prompt[r["prompt"]], list(r["token_ids"]), list(r["logprobs"]), 0.0) for r in rows]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.99))

    step, opt_s = opt.step, []

    def timed_step(*args: Any, **kw: Any) -> Any:  # AdamW on CPU tensors runs per-tensor ops, not _foreach
        t0 = time.perf_counter()
        try:
            return step(*args, **kw)
        finally:
            opt_s.append(time.perf_counter() - t0)

    opt.step = timed_step

    def train() -> None:
        model.train()
        with modeling.autocast(dtype, torch.device("cpu")):
            update.policy_update(model, opt, seqs, cfg, pad_id=tok.pad_token_id)

    for phase, fn in ((ph, {"generation": generate, "update": train}[ph]) for ph in a.phases):
        t0 = time.perf_counter()
        fn()  # unprofiled: the phase's own time (and the allocator's warm-up)
        plain = time.perf_counter() - t0
        wall, groups, ops = profile(fn)
        out["phases"][phase] = {"seconds": round(plain, 2), "seconds_profiled": round(wall, 2),
                                "groups_s": {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda x: -x[1])},
                                "top_ops": [(n, round(s, 4), c) for n, s, c in ops[:40]]}
        extra = (f", {tokens[-1]} completion tokens" if phase == "generation" else f", {len(seqs)} sequences; "
                 f"optimizer.step {opt_s[-1]:.2f} s of it (profiled; its ops are in the groups)")
        if phase == "update":
            out["phases"][phase]["optimizer_step_s_profiled"] = round(opt_s[-1], 3)
        print(f"\n{phase}: {plain:.2f} s ({wall:.2f} s under the profiler){extra}")
        print("| group | s | share |\n|---|---:|---:|")
        for k, v in sorted(groups.items(), key=lambda x: -x[1]):
            print(f"| {k} | {v:.2f} | {v / wall:.0%} |")
        print("top ops: " + "; ".join(f"{n} {s:.2f} s ({c})" for n, s, c in ops[:8]))
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
