"""Generation throughput of the ``vllm`` rollout backend against the ``hf`` backend, both as the stages build
them (``BACKENDS[...]``), in one process, arms alternated within every repeat (the order flips each repeat).

Runs in ``.venv-vllm`` (vLLM's CPU build) or ``.venv-gpu``. Models, saved as HF folders (the engine loads
folders): the tiny default Llama (``paths.sft_model`` if present, else the built default shape; head_dim 32)
and a random-init Qwen2 of about 21M parameters (hidden 256, 4 layers, 8 heads -> head_dim 32, 2 KV heads,
a 32,768-row head) with the BPE tokenizer of ``tests/realmodel.py``. Prompts from the synthetic task,
``n`` samples per prompt, ``--new`` tokens at most (a random-init model seldom stops early). Arms: ``hf``
(float32) and ``vllm`` in float32 (equal precision) or bfloat16. One vLLM engine per process (a second engine
in a process breaks the first: vLLM's parallel state is global), so each (model, engine dtype) runs in its own
child process, hf and vllm alternating inside it. Every repeat is reported; the table shows the median
completion tokens/s, every repeat, and the per-repeat ratio to hf.

    .venv-vllm/bin/python benchmarks/rollout_vllm.py [--repeats 3] [--batches 64 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from posttrain import modeling  # noqa: E402
from posttrain.config import TinyModel, VLLMOptions  # noqa: E402
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids, generator  # noqa: E402


def folders(root: Path, sft: Path) -> dict[str, Path]:
    from realmodel import save_folder

    tiny = sft
    if not (sft / "config.json").exists():
        tok = modeling.build_char_tokenizer()
        tiny = root / "tiny"
        modeling.save_checkpoint(modeling.build_tiny_model(TinyModel(), tok, 0), tok, tiny)
    qwen = save_folder(root / "qwen2-21M", hidden=256, layers=4, heads=8, kv_heads=2, vocab_size=4096,
                       model_vocab=32_768, intermediate=1024)
    return {"tiny": tiny, "qwen2-21M": qwen}


def prompts(tok: Any, n: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return chat_prompt_ids(tok, [f"{rng.randint(10, 9999)}*{rng.randint(2, 9)}=" for _ in range(n)])


def tokens_per_s(backend: Any, ids: list[list[int]], n: int, new: int, seed: int) -> float:
    t = time.perf_counter()
    out = backend.generate(ids, n, SamplingParams(1.0, 1.0, new, seed))
    return sum(len(c.token_ids) for g in out for c in g) / (time.perf_counter() - t)


def one(name: str, folder: Path, dtype: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """hf against vllm (engine in ``dtype``) on one model, alternating; one row per arm per repeat."""
    tok = modeling.load_tokenizer(str(folder))
    model = modeling.load_model(str(folder), "float32")
    big = max(args.batches)
    t = time.perf_counter()
    arms = {"hf": BACKENDS["hf"](model, tok, big),
            f"vllm-{dtype}": BACKENDS["vllm"](model, tok, big, VLLMOptions(dtype=dtype, max_model_len=256))}
    print(f"{name}: vllm engine ({dtype}) built in {time.perf_counter() - t:.1f}s", flush=True)
    rows = []
    for bs in args.batches:
        ids = prompts(tok, bs // args.n)
        for backend in arms.values():  # warm-up
            tokens_per_s(backend, ids, args.n, args.new, 999)
        for r in range(args.repeats):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            rates = {arm: tokens_per_s(arms[arm], ids, args.n, args.new, r) for arm in order}
            for arm in arms:
                rows.append({"model": name, "params_M": round(modeling.num_params(model) / 1e6, 1), "batch": bs,
                             "repeat": r, "arm": arm, "tok_s": round(rates[arm]),
                             "vs_hf": round(rates[arm] / rates["hf"], 2)})
            print({a: round(v) for a, v in rates.items()}, f"{name} batch {bs} repeat {r}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", type=Path, default=Path("models/sft"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="sequences per call")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (batch / n prompts)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="engine dtypes")
    ap.add_argument("--json", default="benchmarks/results/rollout_vllm_cpu.json")
    ap.add_argument("--child", nargs=3, metavar=("NAME", "FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        name, folder, dtype = args.child
        Path(args.json).write_text(json.dumps(one(name, Path(folder), dtype, args)))
        return
    import subprocess

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in folders(Path(tmp), args.sft).items():
            for dtype in args.dtypes:
                out = Path(tmp) / f"{name}-{dtype}.json"
                subprocess.run([sys.executable, __file__, "--child", name, str(folder), dtype, "--json", str(out),
                                "--repeats", str(args.repeats), "--n", str(args.n), "--new", str(args.new),
                                "--threads", str(args.threads), "--batches", *map(str, args.batches)], check=True)
                rows += json.loads(out.read_text())
    print(f"\n{generator('vllm')}, torch {torch.__version__}, {args.threads} threads, n={args.n}, new={args.new}\n")
    print("| model | params (M) | batch | arm | tok/s median | tok/s per repeat | vs hf per repeat |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted({(r["model"], r["params_M"], r["batch"], r["arm"]) for r in rows}, key=lambda k: (k[0], k[2]))
    for m, p, b, a in keys:
        sel = [r for r in rows if (r["model"], r["batch"], r["arm"]) == (m, b, a)]
        print(f"| {m} | {p} | {b} | {a} | {statistics.median(r['tok_s'] for r in sel):.0f} | "
              f"{', '.join(str(r['tok_s']) for r in sel)} | {', '.join(str(r['vs_hf']) for r in sel)} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"generator": generator("vllm"), "torch": torch.__version__,
                                           "threads": args.threads, "n": args.n, "new": args.new, "rows": rows},
                                          indent=2))


if __name__ == "__main__":
    main()
