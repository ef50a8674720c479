"""Generation on a real model: tokens/s of one rollout backend on GSM8K-test prompts, one arm per process.

Run the arms alternately, one process each (this machine is noisy: compare arms in one run, every repeat kept):

    python benchmarks/real_generation.py --model models/sft --backend hf --prompts 64 --n 8 --new 256
    .venv-vllm/bin/python benchmarks/real_generation.py --model models/sft --backend vllm ...   # vLLM's CPU build
    python benchmarks/real_generation.py ... --loop reference   # the hf loop before the growing KV cache, the
                                                 # grouped row drops and inverse-transform sampling (kept to compare)

Prints one JSON line: completion tokens, seconds (generation only; the engine start is reported apart as
``start_s``), tokens/s, the share of completions that stopped, torch's thread count when generation starts and
the process's CPU seconds per wall second while it runs (``cpu_per_wall``: about 2 when both cores work), and
appends it to ``--json`` when given. The process applies the stages' ``runtime.keep_freed_memory`` (glibc keeps freed
blocks) unless ``--default-malloc``; each line says which (``keep_freed_memory``; lines without it predate the flag
and ran with glibc's default).
Prompts: the first ``--prompts`` GSM8K-test questions through the model folder's chat template (``--bench`` or
``$POSTTRAIN_BENCH``). Sampling at temperature 1 (``--greedy``: 0), seed 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from posttrain import allocator, modeling  # noqa: E402
from posttrain.config import VLLMOptions  # noqa: E402
from posttrain.rollout import BACKENDS, ModelFolder, SamplingParams, chat_prompt_ids  # noqa: E402


def reference_sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """The sampler before this round: log-softmax, then torch.multinomial (top_p 1)."""
    if temperature == 0:
        return logits.argmax(-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)


def reference_generate(model, tok, prompt_ids: list[list[int]], n: int, sp: SamplingParams, batch: int) -> list:
    """The hf loop as it was before this round: transformers' DynamicCache (a concatenation per step), every
    finished row dropped at once (a KV-cache copy each time), torch.multinomial."""
    from transformers import DynamicCache

    out = []
    per = max(1, batch // n)
    stops = torch.tensor(modeling.stop_ids(model.generation_config, tok))
    for c, start in enumerate(range(0, len(prompt_ids), per)):
        prompts = prompt_ids[start : start + per]
        k, width = len(prompts), max(map(len, prompts))
        ids = torch.full((k, width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        gen = torch.Generator().manual_seed(sp.seed + c)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                           use_cache=True, logits_to_keep=1).logits[:, -1]
            cache.batch_repeat_interleave(n)
            logits, mask, pos = (x.repeat_interleave(n, 0) for x in (logits, mask, pos))
            next_pos, lengths = pos[:, -1] + 1, []
            for t in range(sp.max_new_tokens):
                tok_ = reference_sample(logits, sp.temperature, gen)
                done = torch.isin(tok_, stops)
                if done.any():
                    lengths += [t + 1] * int(done.sum())
                    keep = (~done).nonzero().squeeze(1)
                    if keep.numel() == 0:
                        break
                    cache.batch_select_indices(keep)
                    tok_, mask, next_pos = tok_[keep], mask[keep], next_pos[keep]
                if t + 1 == sp.max_new_tokens:
                    lengths += [t + 1] * tok_.numel()
                    break
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
                logits = model(input_ids=tok_[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                               past_key_values=cache, use_cache=True).logits[:, -1]
                next_pos = next_pos + 1
        out.append((sum(lengths), sum(x < sp.max_new_tokens for x in lengths), len(lengths)))
    return out


def gsm8k_prompts(tok: object, bench: str, k: int) -> list[list[int]]:
    """The first ``k`` GSM8K-test questions of ``bench`` through the tokenizer's chat template, as token ids."""
    with open(Path(bench) / "gsm8k_test.jsonl") as f:
        questions = [json.loads(next(f))["question"] for _ in range(k)]
    return chat_prompt_ids(tok, questions)


def add_malloc_arg(ap: argparse.ArgumentParser) -> None:
    """``--default-malloc``: leave glibc's malloc as it is. By default a benchmark applies what the stages apply
    (``runtime.keep_freed_memory``, default on): without it every vocabulary-sized sampling tensor is page-faulted
    in afresh each step."""
    ap.add_argument("--default-malloc", action="store_true",
                    help="do not apply runtime.keep_freed_memory (the stages' default) to this process")


def apply_malloc(a: argparse.Namespace) -> bool:
    """Apply ``runtime.keep_freed_memory`` unless ``--default-malloc``; whether it took effect."""
    return False if a.default_malloc else allocator.keep_freed_memory()


def make_backend(name: str, model: str, tok: object, dtype: str, batch: int) -> object:
    """The rollout backend ``name`` (hf or vllm) over the model folder, its weights in ``dtype``."""
    if name == "vllm":
        return BACKENDS["vllm"](ModelFolder(model, dtype), tok, batch, VLLMOptions(dtype=dtype))
    return BACKENDS["hf"](modeling.load_model(model, dtype), tok, batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model folder (e.g. models/sft of the SmolLM2 profile)")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--loop", choices=["current", "reference"], default="current", help="hf only")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new", type=int, default=256, help="max new tokens")
    ap.add_argument("--batch", type=int, default=512, help="hf: rows per decode batch (prompts x n)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench", default=os.environ.get("POSTTRAIN_BENCH", "."))
    ap.add_argument("--json", help="append the result line to this JSON-lines file")
    add_malloc_arg(ap)
    a = ap.parse_args()
    kept = apply_malloc(a)
    torch.set_num_threads(a.threads)
    tok = modeling.load_tokenizer(a.model)
    ids = gsm8k_prompts(tok, a.bench, a.prompts)
    sp = SamplingParams(0.0 if a.greedy else 1.0, 1.0, a.new, 0)
    t0 = time.time()
    backend = make_backend(a.backend, a.model, tok, a.dtype, a.batch)
    model = getattr(backend, "model", None)
    start_s = time.time() - t0
    threads_at_start = torch.get_num_threads()  # after vLLM's engine init, which sets 1 for serving
    t0, cpu0 = time.time(), time.process_time()
    if a.loop == "reference":
        parts = reference_generate(model, tok, ids, a.n, sp, a.batch)
        tokens, stopped, total = (sum(x) for x in zip(*parts, strict=True))
    else:
        groups = backend.generate(ids, a.n, sp)
        comps = [c for g in groups for c in g]
        tokens, stopped, total = sum(len(c.token_ids) for c in comps), sum(c.finish_reason == "stop"
                                                                           for c in comps), len(comps)
    secs, cpu_s = time.time() - t0, time.process_time() - cpu0
    row = {"model": a.model, "backend": a.backend, "loop": a.loop, "dtype": a.dtype, "prompts": a.prompts, "n": a.n,
           "new": a.new, "batch": a.batch, "greedy": a.greedy, "threads": a.threads, "keep_freed_memory": kept,
           "tokens": tokens,
           "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1), "stopped": round(stopped / total, 3),
           "start_s": round(start_s, 1),
           "torch_threads": threads_at_start, "cpu_per_wall": round(cpu_s / secs, 2)}
    print(json.dumps(row))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
