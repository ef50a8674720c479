"""Where one decode step goes on a real model (issue 45, item 3): torch's profiler over ``--steps`` model forwards
after the first ``--skip`` of a generation, on the hf loop or vLLM's CPU build, against the step's matmul floor.

A *step* runs from one forward of the model to the next: the forward itself, the LM head, sampling, the
backend's per-token bookkeeping and (vLLM) its scheduler. A pre-hook on the model's top module marks the
boundaries and records the rows the forward decodes (hf: the batch's rows; vLLM: the step's flattened tokens).
A pre-hook and a post-hook wrap the forward in a ``decode/forward`` profiler range, so each operator's self
time falls into one category by where it ran and by its name:

- inside the forward: ``matmul`` (the linear layers, aten mm/addmm, oneDNN and vLLM's CPU GEMMs),
  ``attention`` (attention over the KV cache: SDPA, vLLM's CPU attention ops), ``kv_write`` (writing the new
  keys and values: index copies, cat, vLLM's reshape-and-cache), ``elementwise`` (norms, activations, rotary
  embeddings, adds and muls), ``compiled`` (time in a torch.compile region not in an operator it calls:
  inductor's fused kernels; vLLM's CPU build compiles the model unless ``enforce_eager``), ``other_forward``;
  ``python_forward``: the forward's time in no operator (module calls, mask building: Python);
- outside it: ``matmul`` again (vLLM runs the LM head after the forward, in ``compute_logits``),
  ``after_forward_ops`` (every other operator: sampling, the loop's bookkeeping, vLLM's input preparation) and
  ``python_after``: the step's time in no operator (the decode loop's Python, vLLM's scheduler and output
  processing).

The matmul floor of a step is its rows x 2 (N_body + d V) FLOPs at the rates ``compute_floor.rates`` measures at
that M (``--floor``: measured in this process after the generation). The profiler adds a few microseconds per
operator; the unprofiled steps just before the window are timed too (``unprofiled_step_ms``), so its overhead
shows.

    python benchmarks/decode_profile.py --model models/base --backend hf --prompts 64 --n 8 --new 256 --batch 256
    .venv-vllm/bin/python benchmarks/decode_profile.py --model models/base --backend vllm --batch 512 ...

prints a table and appends one JSON line to ``--json`` when given. Like ``real_generation.py`` it applies the stages'
``runtime.keep_freed_memory`` unless ``--default-malloc`` (lines without ``keep_freed_memory`` ran without it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compute_floor  # noqa: E402
import real_generation  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, schedule  # noqa: E402

from posttrain import modeling  # noqa: E402
from posttrain.rollout import SamplingParams  # noqa: E402

FORWARD = "decode/forward"
CATEGORIES = [  # (category, pattern over an operator's name), first match wins
    ("kv_write", r"reshape_and_cache|kv_cache_update|index_put|index_copy|aten::copy_|aten::cat"),
    ("attention", r"attention|attn|sdpa|flash|paged"),
    ("matmul", r"aten::(mm|addmm|bmm|matmul|linear)$|onednn|mkldnn|gemm|_C::.*mm"),
    ("elementwise", r"rms_norm|layer_norm|silu|gelu|act_and_mul|rotary|aten::(mul|add|sub|div|pow|rsqrt|mean|"
                    r"neg|exp|cos|sin|where|masked_fill|fill|clamp)_?$"),
    ("compiled", r"Torch-Compiled Region|CompiledFunction|CompiledFxGraph|Pregraph|inductor|cpp_fused"),
]


def category(name: str, in_forward: bool) -> str:
    """The category of an operator (or profiler range) by its name and whether it ran inside the forward."""
    if name == FORWARD:
        return "python_forward"
    if name.startswith("ProfilerStep"):
        return "python_after"
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE) and (in_forward or cat == "matmul"):
            return cat
    return "other_forward" if in_forward else "after_forward_ops"


def inside(e: object) -> bool:
    """Whether a profiler event ran inside the ``decode/forward`` range."""
    p = e.cpu_parent
    while p is not None:
        if p.name == FORWARD:
            return True
        p = p.cpu_parent
    return False


class Done(Exception):
    """Raised by the pre-hook once the window has been recorded: the rest of the generation is not needed."""


class Steps:
    """Forward hooks on the model's top module: count the forwards, stamp each one's start and rows, advance the
    profiler's schedule (each forward begins a step) and wrap the forward in the ``decode/forward`` range."""

    def __init__(self, prof: profile, last: int):
        self.prof, self.last, self.starts, self.rows, self.ctx, self.range = prof, last, [], [], [], None

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.starts.append(time.perf_counter())
        self.rows.append(int(ids.shape[0]) if ids is not None else 0)
        self.ctx.append(context(kwargs, args))
        if len(self.starts) > 1:
            self.prof.step()
        if len(self.starts) == self.last:
            raise Done
        self.range = torch.autograd.profiler.record_function(FORWARD)
        self.range.__enter__()

    def post(self, module: torch.nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        self.range.__exit__(None, None, None)


def context(kwargs: dict, args: tuple) -> tuple[int, int]:
    """(cached positions a forward's attention must read, positions it does read): the hf loop attends over
    its padded mask (left padding, finished rows kept until they leave); vLLM over each token's own context
    (its ``positions`` + 1)."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return int(mask.sum()), mask.numel()
    pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
    n = int((pos + 1).sum()) if pos is not None else 0
    return n, n


def read_gbps(threads: int, mb: int = 1024) -> float:
    """This CPU's memory read bandwidth, GB/s: the best of 5 sums over an ``mb`` MB fp32 tensor (after one warm-up),
    on the decode's threads."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def top_module(backend: object) -> list[torch.nn.Module]:
    """The module whose forward is one decode step: the hf model, or vLLM's model inside its in-process engine."""
    if hasattr(backend, "model"):
        return [backend.model]
    return backend.engine.apply_model(lambda m: m)  # vLLM: one per worker; in-process, the live module


def summarize(prof: profile, steps: Steps, skip: int, n: int) -> dict:
    """Per-step milliseconds by category over the profiled window, the window's rows, and the top operators."""
    walls = [b - a for a, b in zip(steps.starts, steps.starts[1:], strict=False)]
    window = walls[skip + 1 : skip + 1 + n]  # profiler: wait skip steps, warm 1, record n
    by_cat: dict[str, float] = {}
    per_op: dict[str, list[float]] = {}
    for e in prof.events():
        ms = e.self_cpu_time_total / 1e3 / len(window)
        cat = category(e.name, inside(e))
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
        per_op.setdefault(e.name, [0.0, 0])[0] += ms
        per_op[e.name][1] += 1
    wall_ms = 1e3 * statistics.mean(window)
    by_cat["unprofiled_gap"] = wall_ms - sum(by_cat.values())  # between the hooks and the profiler's own steps
    ops = [(ms, k, c // len(window)) for k, (ms, c) in per_op.items()]
    ops.sort(reverse=True)
    before = walls[max(0, skip - n) : skip]
    return {"step_ms": round(wall_ms, 2), "unprofiled_step_ms": round(1e3 * statistics.mean(before), 2),
            "rows": steps.rows[skip + 1 : skip + 1 + n],
            "kv_positions": [list(c) for c in steps.ctx[skip + 1 : skip + 1 + n]],
            "ms": {k: round(v, 2) for k, v in sorted(by_cat.items())},
            "top_ops": [{"op": k, "ms": round(ms, 2), "calls": c} for ms, k, c in ops[:15]]}


def profile_decode(backend: object, ids: list[list[int]], n: int, new: int, skip: int, steps: int) -> dict:
    """Generate ``n`` samples of each prompt (T = 1, at most ``new`` tokens) and profile forwards ``skip`` + 2 ..
    ``skip`` + ``steps`` + 1 (after one warm-up step); the generation stops once they are recorded."""
    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=skip, warmup=1, active=steps, repeat=1))
    hooks_on = Steps(prof, skip + steps + 2)
    hooks = [h for m in top_module(backend) for h in (m.register_forward_pre_hook(hooks_on.pre, with_kwargs=True),
                                                      m.register_forward_hook(hooks_on.post, with_kwargs=True))]
    try:
        with prof:
            backend.generate(ids, n, SamplingParams(1.0, 1.0, new, 0))
        raise SystemExit(f"decode_profile: only {len(hooks_on.starts)} forwards ran; lower --skip/--steps")
    except Done:  # the window is recorded; the generation stops there
        pass
    finally:
        for h in hooks:
            h.remove()
    return summarize(prof, hooks_on, skip, steps)


def floors(cfg: dict, rows: int, positions: float, dtype: str, threads: int) -> dict:
    """A step's two floors, ms: its matmuls (rows x 2 (N_body + d V) FLOPs at ``compute_floor.rates``' rates at
    M = rows) and reading its KV cache once (``positions`` cached positions x 2 L H_kv d_head values of the
    dtype, at ``read_gbps``), with the bandwidth measured."""
    body, head = compute_floor.token_flops(cfg)
    r = compute_floor.rates(cfg, {"decode": rows}, [dtype])[dtype]["decode"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_pos = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    gbps = read_gbps(threads)
    matmul_s = rows * (body / (r["body_gflops"] * 1e9) + head / (r["lm_head_gflops"] * 1e9))
    return {"read_gbps": round(gbps, 1), "kv_read_floor_ms": round(1e3 * positions * per_pos / (gbps * 1e9), 2),
            "matmul_floor_ms": round(1e3 * matmul_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--skip", type=int, default=100, help="forwards before the window (the prefill included)")
    ap.add_argument("--steps", type=int, default=10, help="forwards profiled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--floor", action="store_true", help="measure the matmul floor at the window's rows after")
    ap.add_argument("--bench", default=os.environ.get("POSTTRAIN_BENCH", "."))
    ap.add_argument("--json")
    real_generation.add_malloc_arg(ap)
    a = ap.parse_args()
    kept = real_generation.apply_malloc(a)
    torch.set_num_threads(a.threads)
    tok = modeling.load_tokenizer(a.model)
    ids = real_generation.gsm8k_prompts(tok, a.bench, a.prompts)
    backend = real_generation.make_backend(a.backend, a.model, tok, a.dtype, a.batch)
    row = {"backend": a.backend, "dtype": a.dtype, "prompts": a.prompts, "n": a.n, "new": a.new, "batch": a.batch,
           "threads": torch.get_num_threads(), "keep_freed_memory": kept, "skip": a.skip,
           **profile_decode(backend, ids, a.n, a.new, a.skip, a.steps)}
    rows = round(statistics.mean(row["rows"]))
    if a.floor:
        cfg = json.loads((Path(a.model) / "config.json").read_text())
        row.update(floors(cfg, rows, statistics.mean(c[0] for c in row["kv_positions"]), a.dtype, a.threads))
    print(f"{a.backend} {a.dtype}: {row['step_ms']} ms a step at {rows} rows "
          f"(unprofiled {row['unprofiled_step_ms']}; matmul floor {row.get('matmul_floor_ms', '-')}, "
          f"KV read floor {row.get('kv_read_floor_ms', '-')})")
    for k, v in sorted(row["ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<12} {v:9.2f} ms  {100 * v / row['step_ms']:5.1f}%")
    for op in row["top_ops"]:
        print(f"    {op['op'][:60]:<60} {op['ms']:8.2f} ms  x{op['calls']}")
    print(json.dumps(row))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
