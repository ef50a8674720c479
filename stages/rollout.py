"""rollout: sample G completions per training prompt from the SFT policy.

Inputs: ``paths.curated_dir/train.parquet``; the policy ``paths.sft_model``.
Outputs: ``paths.rollout_dir/rollouts.parquet`` (``schema.ROLLOUT_SCHEMA``: prompt id, sample index,
completion, token ids, per-token sampler log-probs, finish reason, the policy's weight digest, sampling
params and seed), ``metrics/rollout.json`` (samples/s, lengths).
The prompts are the first ``rollout.num_prompts`` of a seeded shuffle of the training split (null: all of it).
These pass rates are what ``rl.select`` picks RL's prompts by, so RL's pool is the scored prompts. The same
``sample_rows`` function produces every rollout of the ``rl`` loop.

Run: ``dvc repro rollout`` or ``python -m stages.rollout [--params params.yaml]``.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain import modeling
from posttrain.config import Params
from posttrain.outputs import as_one_set
from posttrain.rollout import BACKENDS, ModelFolder, SamplingParams, generator, sample_rows
from posttrain.runner import stage_main
from posttrain.schema import ROLLOUT_SCHEMA, read_problems, write_json, write_parquet

log = logging.getLogger("rollout")


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Sample. ``inputs``: train (train.parquet), policy (checkpoint). ``out``: rollouts, metrics."""
    with as_one_set(out, "rollout"):  # a kill leaves the old outputs or the new ones, never a mix
        return _run(params, inputs, out)


def _run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    cfg = params.rollout
    torch.set_num_threads(params.runtime.generate_threads)
    problems = read_problems(inputs["train"])
    random.Random(params.seed).shuffle(problems)
    n_train, problems = len(problems), problems[: cfg.num_prompts]
    log.info("scoring %d of %d training prompts (rollout.num_prompts): RL selects from these", len(problems),
             n_train)
    device = modeling.resolve_device(params.runtime.device)
    tok = modeling.load_tokenizer(str(inputs["policy"]))
    policy = ModelFolder(str(inputs["policy"]), params.model.dtype, device)  # each backend loads it its own way
    backend = BACKENDS[cfg.backend](policy, tok, cfg.generate_batch_size, params.vllm_options())
    sp = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_new_tokens, params.seed)
    rows, seconds = sample_rows(backend, tok, problems, cfg.samples_per_prompt, sp,
                                policy=modeling.checkpoint_digest(inputs["policy"]),
                                chunk_prompts=max(1, cfg.generate_batch_size // cfg.samples_per_prompt),
                                progress=params.runtime.progress)
    write_parquet(out["rollouts"], rows, ROLLOUT_SCHEMA)
    lengths = [len(r["token_ids"]) for r in rows]
    metrics = {"prompts": len(problems), "train_prompts": n_train, "samples": len(rows), "seconds": round(seconds, 2),
               "samples_per_s": round(len(rows) / seconds, 1),
               "tokens_per_s": round(sum(lengths) / seconds, 1), "mean_len": round(float(np.mean(lengths)), 2),
               "truncated_frac": round(float(np.mean([r["finish_reason"] == "length" for r in rows])), 4),
               "generator": generator(cfg.backend)}
    write_json(out["metrics"], metrics)
    log.info("%d samples in %.1fs (%.0f samples/s)", len(rows), seconds, metrics["samples_per_s"])
    return metrics


def paths(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    """This stage's inputs and outputs, from ``params.paths`` (used by ``main`` and by tests)."""
    P = p.paths
    return ({"train": Path(P.curated_dir) / "train.parquet", "policy": Path(P.sft_model)},
            {"rollouts": Path(P.rollout_dir) / "rollouts.parquet", "metrics": Path(P.metrics_dir) / "rollout.json"})


def main() -> None:
    stage_main("rollout", lambda p: run(p, *paths(p)))


if __name__ == "__main__":
    main()
