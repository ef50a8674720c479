"""rl: online GRPO-family training: per step, rollout -> reward -> update, in one process, resumable.

Inputs: ``paths.curated_dir/train.parquet``; ``paths.reward_dir/pass_rates.parquet`` (the SFT policy's
pass rates, from the rollout and reward stages); the starting policy ``paths.sft_model``.
Outputs: ``paths.rl_model`` (HF checkpoint); ``paths.rl_dir``: ``selected_prompts.parquet`` (the prompts
``rl.select`` picked: by pass rate, or the whole split), ``shards/step_NNNNN.parquet`` (every step's rollouts,
sampler log-probs, rewards, advantages and whether each sample entered the update, so any update can be
replayed from disk: ``rl.shard_tokens: false`` keeps no token ids or log-probs, and no replay; with
``tools.enabled`` every turn of a multi-turn completion, its ``loss_mask`` and ``tool_calls``),
``checkpoints/step_N`` for ``rl.save_steps``; ``paths.rl_report_dir/train_log.csv`` (per-step metrics for
``dvc plots``); ``metrics/rl.json``.

The walk goes down the ``posttrain.rl`` package: ``select`` picks the prompts (``rl.select``) and orders them,
then each step ``collect`` samples ``prompts_per_step`` prompts x ``samples_per_prompt`` completions with the
same ``sample_rows`` as the rollout stage, scores them with the same ``score_rows`` as the reward stage and
applies DAPO dynamic sampling (``rl.dynamic_sampling``), and ``update`` computes advantages (``rl.advantage``)
and runs the policy update (``training.accumulate`` per minibatch).
Every ``checkpoint_every`` steps a resumable checkpoint (model, optimizer, RNG, step, prompt cursor, log)
goes to ``paths.rl_checkpoints`` together with the shards so far (not DVC outs, so a re-run after a crash
finds them and continues without repeating or skipping a step).

Asynchronous (``rl.overlap``, ``posttrain.rl.overlap``): generator processes sample and score whole steps with
weights published by version after every update, at most ``max_staleness`` versions old; the trainer takes
them in step order from a bounded queue, and the shards gain each sample's ``version``.

Several processes (``runtime.distributed``): the same command relaunches under torchrun; each rank generates
and scores its share of every step's prompts (whole groups) and keeps those rows: only per-sample scalars
(reward, correctness, length) are gathered, so every rank takes the same decisions; each trains on the samples
it drew, gradients all-reduced (``training.accumulate``); rank 0 writes shards (the rows sent to it alone) and
outputs.

Run: ``dvc repro rl`` or ``python -m stages.rl [--params params.yaml]``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from posttrain import checkpoint, distributed, modeling, plots, seeds, training
from posttrain.config import Params
from posttrain.errors import StageError
from posttrain.outputs import as_one_set, atomic_path, link_tree
from posttrain.rewards import RewardPool
from posttrain.rl import collect, overlap, select, shards, update
from posttrain.rl.prompts import PromptPool, PromptTokens, read_rates
from posttrain.rollout import BACKENDS, ModelFolder, generator, policy_source
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main
from posttrain.schema import (
    SHARD_SCHEMA,
    with_tool_fields,
    with_version_field,
)
from posttrain.tools import with_tools
from posttrain.trainlog import TrainLog
from stages.layout import NEEDS
from stages.layout import rl as paths

log = logging.getLogger("rl")
LOG_FIELDS = ["step", "updated", "reward_mean", "pass_rate", "zero_var_frac", "groups_used", "refill_rounds", "loss",
              "clipfrac", "kl", "entropy", "ratio_max", "grad_norm", "logprob_gap", "tis_capped", "is_masked",
              "pg_tokens", "response_len", "samples",
              "samples_per_s", "gen_s", "reward_s", "update_s", "elapsed_s"]


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Train. ``inputs``: train, pass_rates, policy. ``out``: model, rl_dir, checkpoints, report_dir, metrics."""
    with (as_one_set(out, "rl"), RewardPool.of(params.reward) as pool,
          contextlib.ExitStack() as stack):  # stack: rl.overlap's generator processes, stopped on any exit
        return _run(params, inputs, out, pool, stack)  # (a kill leaves the old outputs or the new ones, never a mix)


def _run(params: Params, inputs: dict[str, Path], out: dict[str, Path], pool: RewardPool,
         stack: contextlib.ExitStack) -> dict[str, Any]:
    cfg, g, ov = params.rl, params.rl.samples_per_prompt, params.rl.overlap
    rt, d = params.runtime, distributed.current()
    device = modeling.resolve_device(rt.device)
    train = PromptPool.read(inputs["train"])  # an Arrow table: rows become dicts only when a step draws them
    prompts = select.PROMPT_SELECTIONS[cfg.select.strategy](train, read_rates(inputs["pass_rates"], train), cfg.select)
    del train
    if not len(prompts):
        raise StageError(f"rl.select.strategy {cfg.select.strategy} selected no prompt (pass-rate band "
                         f"[{cfg.select.min_pass_rate}, {cfg.select.max_pass_rate}]); see the reward audit")
    log.info("%d prompts selected (rl.select.strategy %s)", len(prompts), cfg.select.strategy)

    model = modeling.load_policy(str(inputs["policy"]), params.model, device, meta=d.loads_on_meta)  # FSDP2: rank 0
    tok = modeling.load_tokenizer(str(inputs["policy"]))
    ref = None
    if cfg.kl_coef > 0 or cfg.kl_reward_coef > 0:  # under LoRA the policy with its adapter off: no second copy
        ref = model if modeling.is_lora(model) else d.load_frozen(  # ranks > 0 read no weights; FSDP2: sharded
            lambda: modeling.load_model(str(inputs["policy"]), params.model.dtype, device),
            lambda: modeling.empty_model(str(inputs["policy"]), dtype=params.model.dtype), device, params.model.dtype)
    model = d.wrap(model, params.model.dtype)  # the training handle (the model itself in one process)
    opt = training.adamw(model, cfg.lr, cfg.weight_decay, training.ONLINE_BETAS)

    def make_backend() -> Any:
        src = policy_source(params.rollout.backend, lambda: d.plain(model),
                            ModelFolder(str(inputs["policy"]), params.model.dtype, device))
        return with_tools(BACKENDS[params.rollout.backend](src, tok, cfg.generate_batch_size, params.vllm_options()),
                          tok, params.tools, params.sandbox)

    backend = make_backend() if ov is None else None  # under rl.overlap the generators sample (and build their own)
    tools = params.tools.enabled  # multi-turn tool rollouts: loss masks in the shards, tool calls in the log
    policy0 = modeling.checkpoint_digest(inputs["policy"])
    prompt_ids = PromptTokens(prompts, tok)  # tokenized when an update first asks, not all up front

    ckpt_dir, shard_tmp = out["checkpoints"], out["checkpoints"] / "shards"
    m = params.model  # what changes the result: not rl.steps, save_steps, max_idle_steps (config.NOT_RESULT)
    fp = checkpoint.fingerprint(cfg, params.reward, params.sampler_id(), m.lora, m.dtype, m.attn_implementation,
                                params.seed, policy0, prompts.digest(),
                                checkpoint.file_digest(inputs["pass_rates"]), *([params.tools] if tools else []))
    rl_seed = params.seed + cfg.seed  # rl.seed: seeds of an RL arm on the same upstream (curate, sft)
    cursor = select.PromptCursor(len(prompts), rl_seed)
    moving_ref = ref if cfg.ref_reset is not None else None  # a reference that resets is checkpointed too
    # per selected prompt its prior (rl.advantage prior_fused): the reward stage's, read from its columns; the
    # updated ones are checkpointed (the file's bytes are in the fingerprint)
    prior = select.PriorState.from_rates(read_rates(inputs["pass_rates"], prompts))
    saved: dict[str, Any] = {}
    start, restored, cursor.pos = checkpoint.restore_loop_state(ckpt_dir, fp, model, opt, moving_ref, saved)
    train_log = TrainLog(out["report_dir"] / "train_log.csv" if d.main else None,
                         LOG_FIELDS + ["tool_calls"] * tools + (overlap.log_fields(ov.max_staleness) if ov else []))
    train_log.resume(restored)
    log_rows = train_log.rows
    if "prior" in saved:
        prior = select.PriorState(**saved["prior"], base=prior.base)  # the updates over the reward stage's
    for stale in shard_tmp.glob("step_*.parquet") if d.main else []:  # shards after the checkpoint are redone
        if int(stale.stem.split("_")[1]) > start:
            stale.unlink()

    t_run = time.time()
    before = float(log_rows[-1].get("elapsed_s") or 0.0) if log_rows else 0.0  # a resumed run's clock goes on
    idle = 0  # steps in a row with nothing to update
    amp = functools.partial(modeling.autocast, params.model.dtype, device)  # mixed precision (no-op in fp32)
    feed = None
    if ov is not None:  # asynchronous: generator processes sample ahead from published weight versions
        spec = overlap.Spec(params, prompts, str(inputs["policy"]), policy0, str(ckpt_dir / "weights"), rl_seed, start)
        shutil.rmtree(spec.weights, ignore_errors=True)  # a killed run's versions are not this run's
        store = overlap.WeightStore(spec.weights)
        stack.callback(store.flush)  # the last version's write finishes before the folder can go (after the feed)
        store.publish(d.plain(model), start)  # version = updates applied
        torch.set_num_threads(ov.trainer_threads)

        def regenerate(s: int) -> collect.StepBatch:  # a dropped step, sampled again with the trainer's weights
            nonlocal backend
            backend = backend or make_backend()  # built only if a step is ever dropped
            model.eval()
            backend.load_weights(d.for_generation(model, backend), collect.policy_name(policy0, s))
            sb = overlap.sample_step(backend, tok, spec, s, s, pool)
            backend.release()  # vLLM: its memory back to the trainer
            model.train()
            return sb

        feed = stack.enter_context(overlap.Generators(spec, regenerate))
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="rl", disable=not rt.progress)
    for step in bar:
        t0 = time.time()
        seed = seeds.rl_step(rl_seed, step)
        if feed is None:
            torch.set_num_threads(rt.generate_threads)
            model.eval()
            # the generation engine samples from this step's weights: under FSDP2 the hf backend's full copy is
            # refreshed from the shards, vLLM's engine gets them streamed in, one gathered parameter at a time
            backend.load_weights(d.for_generation(model, backend), collect.policy_name(policy0, step))
            with amp():
                sb = collect.collect_step(backend, tok, prompts, cursor, cfg, params.reward.rewards, seed,
                                          policy=collect.policy_name(policy0, step), prior=prior, pool=pool)
            torch.set_num_threads(rt.train_threads)
            backend.release()  # vLLM: its memory goes back to the trainer for the update
        else:
            item = feed.take(step)  # sampled by a generator with weights of item.version >= step - k
            sb, cursor.pos = item.payload, (step + 1) * cfg.prompts_per_step
        model.train()
        t2 = time.time()
        with amp():
            metrics, adv = update.update_from_groups(model, opt, sb, cfg, prompt_ids, tok.pad_token_id, ref,
                                                   seed=seed, prior=prior)
        update_s = time.time() - t2
        if feed is not None:
            store.publish(d.plain(model), step + 1)  # generators may start on it at once
        if cfg.ref_reset is not None and (step + 1) % cfg.ref_reset.every == 0:
            update.reset_reference(ref, d.scoring(model), opt if cfg.ref_reset.optimizer else None)
            log.info("step %d: reference reset to the current policy (rl.ref_reset)", step + 1)
        idle = 0 if metrics else idle + 1
        if idle:
            log.warning("step %d: nothing to update (%d groups sampled, %d kept by dynamic sampling %r, none "
                        "scorable or all skipped); %d such step(s) in a row, the stage stops at %d",
                        step + 1, len(sb.prompt_ids), len(sb.used), cfg.dynamic_sampling, idle, cfg.max_idle_steps)
            if idle >= cfg.max_idle_steps:
                raise StageError(f"{idle} steps in a row had nothing to update (every group had zero reward "
                                 f"variance or no scorable sample; zero-variance share {sb.zero_var_frac:.2f}). "
                                 "Check the reward audit and rl.select, or set rl.dynamic_sampling: refill "
                                 "(rl.max_idle_steps)")

        shards.write_shard(shard_tmp / f"step_{step + 1:05d}.parquet", sb, adv, step + 1,
                           with_version_field(with_tool_fields(SHARD_SCHEMA, tools), ov is not None),
                           cfg.shard_tokens)  # rank 0 writes
        first = sb.first_round().numpy()  # [B * G, 3]: the step's on-policy sample of the prompt set
        reward, scorable = first[:, collect.REWARD], ~np.isnan(first[:, collect.REWARD])
        n_samples = sb.stats.shape[0] * g  # every completion sampled this step: refills and prior extras too
        step_s = time.time() - t0
        train_log.append({
            "step": step + 1, "updated": int(bool(metrics)),
            "reward_mean": round(float(np.mean(reward[scorable])), 4) if scorable.any() else None,
            "pass_rate": round(float(np.mean(first[scorable, collect.CORRECT] == 1)), 4) if scorable.any() else None,
            "zero_var_frac": round(sb.zero_var_frac, 4), "groups_used": len(sb.used), "refill_rounds": sb.rounds,
            **{k: float(f"{metrics.get(k, 0.0):.4g}") if metrics else None  # no update: blank, not a measured 0
               for k in ("loss", "clipfrac", "kl", "entropy", "ratio_max", "grad_norm", "logprob_gap", "tis_capped",
                         "is_masked", "pg_tokens")},
            "response_len": round(float(np.mean(first[:, collect.LENGTH])), 2),
            "samples": n_samples, "samples_per_s": round(n_samples / step_s, 1), "gen_s": round(sb.gen_s, 3),
            "reward_s": round(sb.reward_s, 3), "update_s": round(update_s, 3),
            "elapsed_s": round(before + time.time() - t_run, 2),  # the loop's wall clock at this step's end
            **({"tool_calls": round(float(np.mean(first[:, collect.TOOL_CALLS])), 4)} if tools else {}),
            **(overlap.step_metrics(item, feed, n_samples) if feed is not None else {})})
        bar.set_postfix(reward=log_rows[-1]["reward_mean"], zero_var=sb.zero_var_frac)
        done = step + 1
        if done in cfg.save_steps:
            snapshot = d.plain(model)
            if d.main:
                with atomic_path(ckpt_dir / "saved" / f"step_{done}") as tmp:
                    modeling.save_checkpoint(snapshot, tok, tmp, params.model.dtype)
        if done % cfg.checkpoint_every == 0 and done < cfg.steps:
            checkpoint.save_loop_state(ckpt_dir, done, fp, cursor.pos, model, opt, log_rows, moving_ref,
                                     {"prior": {"p": prior.p, "n": prior.n}})
    elapsed = time.time() - t_run

    model.eval()
    final = d.plain(model)
    if not d.main:
        return {"steps": cfg.steps, "rank": d.rank}
    with atomic_path(out["model"]) as tmp:
        modeling.save_checkpoint(final, tok, tmp, params.model.dtype)
    with atomic_path(out["rl_dir"]) as tmp:
        tmp.mkdir()
        prompts.write_selected(tmp / "selected_prompts.parquet")
        link_tree(shard_tmp, tmp / "shards")  # hard links: the checkpoints' copy goes when the stage ends
        if (ckpt_dir / "saved").is_dir():
            link_tree(ckpt_dir / "saved", tmp / "checkpoints")
    train_log.close()
    plots.training_curves(log_rows, "step", [("reward_mean", "pass_rate"), "kl", "entropy", "clipfrac",
                                             "response_len", "zero_var_frac", "grad_norm",
                                             ("gen_s", "reward_s", "update_s")],
                          f"rl ({cfg.advantage}, lr {cfg.lr})", out["report_dir"] / "curves.png")
    last = [r for r in log_rows[-5:] if r["reward_mean"] is not None]
    result = {
        "steps": cfg.steps, "resumed_from_step": start, "shards": len(list(shard_tmp.glob("step_*.parquet"))),
        "selected_prompts": len(prompts), "seconds": round(elapsed, 1),
        # every completion sampled (refills, prior-budget extras), counted from the shards so a resume counts all
        "samples": sum(pq.read_metadata(f).num_rows for f in shard_tmp.glob("step_*.parquet")),
        "first_reward": log_rows[0]["reward_mean"], "final_reward": round(float(np.mean(
            [r["reward_mean"] for r in last])), 4) if last else None,
        "samples_per_s": round(float(np.median([r["samples_per_s"] for r in log_rows])), 1),
        "zero_var_frac_mean": round(float(np.mean([r["zero_var_frac"] for r in log_rows])), 4),
        "gen_s": round(sum(r["gen_s"] for r in log_rows), 1),
        "update_s": round(sum(r["update_s"] for r in log_rows), 1), "world_size": d.world,
        "generator": generator(params.rollout.backend),
    }
    if feed is not None:  # samples per staleness over the run; steps dropped as too stale (0 unless a bug)
        result |= {"staleness": overlap.histogram(log_rows, ov.max_staleness), "dropped": feed.dropped}
    if tools:  # mean tool calls per completion over the steps
        result["tool_calls"] = round(float(np.mean([r["tool_calls"] for r in log_rows])), 4)
    write_metrics(out["metrics"], result)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    log.info("reward %.3f -> %.3f in %d steps (%.1fs)", result["first_reward"] or 0, result["final_reward"] or 0,
             cfg.steps, elapsed)
    return result


def main() -> None:
    stage_main("rl", lambda p: run(p, *paths(p)), distributed=True, needs=lambda p: NEEDS["rl"](p, None))


if __name__ == "__main__":
    main()
