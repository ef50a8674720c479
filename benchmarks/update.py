"""Seconds per RL policy update: padded vs packed micro-batches, on batches of two length profiles.

One step's batch (``rl.prompts_per_step`` prompts x ``rl.samples_per_prompt`` samples, T=1, up to
``rl.sampling.max_new_tokens``) is sampled from the pipeline's SFT policy (``paths.sft_model``: short bare
answers and long chains of thought mixed, lengths vary widely) and from the RL policy (``paths.rl_model``:
almost always the full chain of thought, lengths close together). On each batch ``update.policy_update``
runs with ``rl.pack`` off (right-padded, length-sorted micro-batches) and on (rows of twice the longest
sequence), for micro-batches of 64 and 128 sequences, at lr 0 so every repeat sees the same weights.
Reported: the median and min of ``--repeats`` timed updates after a warm-up, the share of real tokens in
the model input (fill), and the rows x width of the input. The variants run interleaved.

Needs ``dvc repro rl`` (both checkpoints and the curated data).

    python benchmarks/update.py [--repeats 8] [--json benchmarks/results/update.json]
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

from posttrain import logprobs, modeling  # noqa: E402
from posttrain.config import load_params  # noqa: E402
from posttrain.rl import update  # noqa: E402
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids  # noqa: E402
from posttrain.runner import setup  # noqa: E402
from posttrain.schema import read_problems  # noqa: E402


def sample_batch(model: Any, tok: Any, problems: list[dict[str, Any]], g: int, new: int) -> list[logprobs.Seq]:
    ids = chat_prompt_ids(tok, [p["prompt"] for p in problems])
    out = BACKENDS["hf"](model.eval(), tok, 256).generate(ids, g, SamplingParams(1.0, 1.0, new, 0))
    # alternating advantages +-1: the update's cost does not depend on their values (it skips only 0s)
    return [logprobs.Seq(p, c.token_ids, c.logprobs, 1.0 if j % 2 else -1.0)
            for p, grp in zip(ids, out, strict=True) for j, c in enumerate(grp)]


def seq_len(s: logprobs.Seq) -> int:
    return len(s.prompt_ids) + len(s.completion_ids)


def layout(seqs: list[logprobs.Seq], pad_id: int, pack: bool, micro: int) -> tuple[float, list[str]]:
    """The model input ``policy_update`` builds: share of real tokens in it, rows x width per micro-batch."""
    order = seqs if pack else sorted(seqs, key=seq_len)
    numel, shapes = 0, []
    for i in range(0, len(order), micro):
        part = order[i : i + micro]
        ids = logprobs.batch_tensors(part, pad_id, torch.device("cpu"), pack)["ids"]
        numel += ids.numel()
        shapes.append("x".join(map(str, ids.shape)))
    return sum(map(seq_len, seqs)) / numel, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/update.json")
    args = ap.parse_args()
    params = load_params(args.params)
    setup(params)
    cfg = params.rl
    problems = read_problems(Path(params.paths.curated_dir) / "train.parquet")[: cfg.prompts_per_step]
    tok = modeling.load_tokenizer(params.paths.sft_model)
    torch.set_num_threads(params.runtime.train_threads)
    results: list[dict[str, Any]] = []
    for policy in ("sft_model", "rl_model"):
        model = modeling.load_model(getattr(params.paths, policy), params.model.dtype, torch.device("cpu"))
        torch.set_num_threads(params.runtime.generate_threads)
        seqs = sample_batch(model, tok, problems, cfg.samples_per_prompt, cfg.sampling.max_new_tokens)
        torch.set_num_threads(params.runtime.train_threads)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        variants = [(pack, micro) for pack in (False, True) for micro in (64, 128)]
        times: dict[tuple[bool, int], list[float]] = {v: [] for v in variants}
        for rep in range(args.repeats + 1):
            for pack, micro in variants:
                c = cfg.model_copy(update={"pack": pack, "micro_batch_size": micro, "epochs": 1, "minibatches": 1})
                t = time.perf_counter()
                update.policy_update(model, opt, seqs, c, tok.pad_token_id)
                if rep:  # the first round is the warm-up
                    times[(pack, micro)].append(time.perf_counter() - t)
        lens = [seq_len(s) for s in seqs]
        for pack, micro in variants:
            fill, shapes = layout(seqs, tok.pad_token_id, pack, micro)
            results.append({"policy": policy.removesuffix("_model"), "pack": pack, "micro_batch_size": micro,
                            "median_s": statistics.median(times[(pack, micro)]), "min_s": min(times[(pack, micro)]),
                            "fill": fill, "input_shapes": shapes,
                            "mean_len": statistics.mean(lens), "min_len": min(lens), "max_len": max(lens)})
    print(f"\nRL policy update, {cfg.prompts_per_step}x{cfg.samples_per_prompt} sequences, torch threads "
          f"{params.runtime.train_threads}, median (min) of {args.repeats}")
    print("| batch from | lengths mean (min-max) | pack | micro-batch | input rows x width | fill | update s |")
    print("|---|---|---|---:|---|---:|---|")
    for r in results:
        print(f"| {r['policy']} policy | {r['mean_len']:.1f} ({r['min_len']}-{r['max_len']}) | "
              f"{'packed' if r['pack'] else 'padded'} | {r['micro_batch_size']} | {', '.join(r['input_shapes'])} | "
              f"{r['fill']:.2f} | {r['median_s']:.3f} ({r['min_s']:.3f}) |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"repeats": args.repeats, "results": results}, indent=2))


if __name__ == "__main__":
    main()
