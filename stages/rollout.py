"""rollout: sample G completions per training prompt from the SFT policy.

Inputs: ``paths.curated_dir/train.parquet``; the policy ``paths.sft_model``.
Outputs: ``paths.rollout_dir/rollouts.parquet`` (``schema.ROLLOUT_SCHEMA``: prompt id, sample index,
completion, ``num_tokens``, finish reason, the policy's weight digest, sampling params and seed; token ids,
per-token sampler log-probs and, with ``tools.enabled``, the ``loss_mask`` only under ``rollout.keep_tokens``
(no stage reads them); with ``tools.enabled`` each completion's ``tool_calls``: docs/tools.md),
``metrics/rollout.json`` (lengths over every sample; samples/s and tokens/s of the samples
this run drew, ``resumed_at_prompt``).
The prompts are the first ``rollout.num_prompts`` of a seeded shuffle of the training split (null: all of it).
These pass rates are what ``rl.select`` picks RL's prompts by, so RL's pool is the scored prompts (but under
``rl.select.strategy: all``: the whole split). The same
``sample_chunks`` function produces every rollout of the ``rl`` loop (through ``sample_rows``).

Streaming and resume: prompts go in chunks of ``generate_batch_size // samples_per_prompt``; each finished chunk
goes into a Parquet part under ``paths.rollout_checkpoints`` (``streaming.PartialParquet``; not a DVC out),
written every ``rollout.checkpoint_every_s`` seconds or 8,192 rows, so memory holds one chunk of Python rows and
at most 8,192 rows in Arrow whatever the number of prompts, and a killed run, re-run, continues at the first
missing chunk ("resuming at prompt N of M"). Chunk ``c`` is seeded by its index, so the rows are the
same as an uninterrupted run's. The parts belong to one configuration (rollout params, seed, model dtype,
sampler, the train split's and the policy folder's digests): another one starts over, with a log line naming
what changed. When every chunk is on disk the parts are streamed into ``rollouts.parquet`` (replaced whole, with
the metrics) and removed.

Run: ``dvc repro rollout`` or ``python -m stages.rollout [--params params.yaml]``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch
from tqdm import tqdm

from posttrain import checkpoint, modeling
from posttrain.config import Params
from posttrain.outputs import as_one_set
from posttrain.rollout import BACKENDS, ModelFolder, SamplingParams, generator, sample_chunks
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main
from posttrain.schema import PER_TOKEN, ROLLOUT_SCHEMA, read_columns, with_tool_fields
from posttrain.streaming import PartialParquet
from posttrain.tools import with_tools
from stages.layout import NEEDS
from stages.layout import rollout as paths

log = logging.getLogger("rollout")

PROMPT_COLUMNS = ("id", "prompt", "answer", "task")  # what sampling reads of the training split


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Sample. ``inputs``: train (train.parquet), policy (checkpoint). ``out``: rollouts, metrics, checkpoints
    (the partial run's folder: written at once, removed once the outputs are in place)."""
    with as_one_set(out, "rollout"):  # a kill leaves the old outputs or the new ones, never a mix
        metrics = _run(params, inputs, out)
    shutil.rmtree(out["checkpoints"], ignore_errors=True)
    return metrics


def run_key(params: Params, inputs: dict[str, Path], policy: str) -> dict[str, str]:
    """What a partial run's chunks depend on, by name (a resume needs every entry equal). ``policy``: the
    policy's weight digest (``modeling.checkpoint_digest``)."""
    pol = Path(inputs["policy"])
    side = hashlib.sha256()  # tokenizer, chat template, generation config: the policy folder's non-weight files
    for f in sorted(pol.iterdir()) if pol.is_dir() else []:
        if f.is_file() and f.suffix not in (".safetensors", ".bin"):
            side.update(f.name.encode() + b"\0" + f.read_bytes())
    tools = [params.tools] if params.tools.enabled else []  # (a run without tools keeps its key)
    return {"params": checkpoint.fingerprint(params.rollout, params.seed, params.model.dtype, params.sampler_id(),
                                             *tools),
            "train": checkpoint.file_digest(inputs["train"]), "policy": policy,
            "policy_files": side.hexdigest()[:16]}


def _run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    cfg, g = params.rollout, params.rollout.samples_per_prompt
    torch.set_num_threads(params.runtime.generate_threads)
    train = read_columns(inputs["train"], PROMPT_COLUMNS)  # Arrow columns; rows become Python a chunk at a time
    order = list(range(train.num_rows))
    random.Random(params.seed).shuffle(order)  # the same permutation as shuffling the rows themselves
    n_train, order = len(order), order[: cfg.num_prompts]
    log.info("scoring %d of %d training prompts (rollout.num_prompts): RL's pass-rate selections pick from these",
             len(order), n_train)
    per = max(1, cfg.generate_batch_size // g)  # prompts per chunk
    total = math.ceil(len(order) / per)
    policy = modeling.checkpoint_digest(inputs["policy"])
    partial = PartialParquet(out["checkpoints"], run_key(params, inputs, policy), total,
                             with_tool_fields(ROLLOUT_SCHEMA, params.tools.enabled),
                             flush_seconds=cfg.checkpoint_every_s)
    start = partial.done()
    where = f"resuming at prompt {start * per} of {len(order)}"
    if start:
        log.info("%s (%d of %d chunks on disk in %s)", where, start, total, out["checkpoints"])
    made, made_tokens, t0 = 0, 0, time.time()
    if start < total:
        device = modeling.resolve_device(params.runtime.device)
        tok = modeling.load_tokenizer(str(inputs["policy"]))
        folder = ModelFolder(str(inputs["policy"]), params.model.dtype, device)  # each backend loads its own way
        backend = with_tools(BACKENDS[cfg.backend](folder, tok, cfg.generate_batch_size, params.vllm_options()), tok,
                            params.tools, params.sandbox)  # multi-turn when tools.enabled
        sp = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_new_tokens, params.seed)
        chunks = ((c, train.take(order[c * per : (c + 1) * per]).to_pylist()) for c in range(start, total))
        bar = tqdm(total=len(order) * g, initial=start * per * g, desc=f"rollout ({where})" if start else "rollout",
                   unit="sample", disable=not params.runtime.progress)
        t0 = time.time()
        try:
            for c, rows in sample_chunks(backend, tok, chunks, g, sp, policy, bar):
                partial.write(c, rows if cfg.keep_tokens else [{**r, **dict.fromkeys(PER_TOKEN)} for r in rows])
                made, made_tokens = made + len(rows), made_tokens + sum(r["num_tokens"] for r in rows)
        finally:  # an error (not a kill) keeps what was sampled
            partial.flush()
        bar.close()
    seconds = max(time.time() - t0, 1e-9)
    samples = partial.assemble(out["rollouts"])
    tokens = truncated = 0
    for b in partial.batches(columns=["num_tokens", "finish_reason"]):
        tokens += pc.sum(b.column("num_tokens")).as_py() or 0
        truncated += pc.sum(pc.equal(b.column("finish_reason"), "length")).as_py() or 0
    metrics = {"prompts": len(order), "train_prompts": n_train, "samples": samples, "seconds": round(seconds, 2),
               "samples_per_s": round(made / seconds, 1), "tokens_per_s": round(made_tokens / seconds, 1),
               "mean_len": round(tokens / max(samples, 1), 2), "truncated_frac": round(truncated / max(samples, 1), 4),
               "generator": generator(cfg.backend), "resumed_at_prompt": start * per}
    if params.tools.enabled:  # mean tool calls per completion
        calls = sum(pc.sum(b.column("tool_calls")).as_py() or 0 for b in partial.batches(columns=["tool_calls"]))
        metrics["tool_calls"] = round(calls / max(samples, 1), 4)
    write_metrics(out["metrics"], metrics)
    log.info("%d samples (%d sampled in this run) in %.1fs (%.0f samples/s)", samples, made, seconds,
             metrics["samples_per_s"])
    return metrics


def main() -> None:
    stage_main("rollout", lambda p: run(p, *paths(p)), needs=lambda p: NEEDS["rollout"](p, None))


if __name__ == "__main__":
    main()
