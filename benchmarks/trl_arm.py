"""TRL's side of ``benchmarks/rl_vs_trl.py``: ``trl.GRPOTrainer`` (trl 1.16) configured as our ``rl`` section.

The settings are ours, translated: B prompts x G samples a step (``num_generations``), our micro-batches as its
gradient accumulation (its ``dapo`` loss divides by the whole batch's tokens, as our token-mean does), max new
tokens, temperature, top-p (top-k off), a constant lr, AdamW betas (0.9, 0.99), weight decay, gradient clip,
the clip range (``epsilon`` / ``epsilon_high``), group-std advantages (``scale_rewards="group"``), one optimizer
step per batch (``num_iterations=1``), no KL (``beta=0``), the task's correctness reward through the same
verifier, the same chat template (the checkpoint's). ``trl_vllm`` generates with TRL's colocated vLLM engine
(``vllm_mode="colocate"``) with its importance-sampling correction off, as ours is.

Timers wrap TRL's own methods (generation, rewards, the no-grad log-prob recomputation) so a step splits as
ours does; a callback keeps the loop's own clock (engine start and evaluation outside it) and snapshots the
weights when the loop passes ``--snapshot-s`` (our arm's loop time in the same repeat), for pass@1 at equal
wall time. Its own module so the driver stays readable; it is imported only by the driver's worker.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain import modeling
from posttrain.config import Params
from posttrain.rewards import Sample
from posttrain.rl import select
from posttrain.rl.prompts import PromptPool, read_rates
from stages import rl

ARMS = {"trl": {}, "trl_vllm": {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False,
                                "vllm_importance_sampling_correction": False}}  # ours has none either: same loss


def arm_trl(params: Params, args: argparse.Namespace, out: Path, seed: int,
            verified: Callable[[Sample], float], evaluate: Callable[[torch.nn.Module, Any], dict[str, Any]],
            peak_rss_mb: Callable[[], float]) -> dict[str, Any]:
    """One TRL run of ``params.rl.steps`` steps from ``paths.sft_model``, then held-out pass@1 (``evaluate``)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = params.rl
    g, b = cfg.samples_per_prompt, cfg.prompts_per_step
    inputs, _ = rl.paths(params)
    train = PromptPool.read(inputs["train"])
    prompts = select.PROMPT_SELECTIONS[cfg.select.strategy](train, read_rates(inputs["pass_rates"], train), cfg.select)
    # TRL needs B distinct rows per step: a selection smaller than steps x B (the GSM8K profile's pass band picked 3
    # prompts) is repeated, as our loop's cursor cycles it
    prompts = list(prompts) * max(1, -(-cfg.steps * b // len(prompts)))
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p["prompt"]}], "answer": p["answer"],
                             "task": p["task"]} for p in prompts])
    counts = {"tokens": 0, "samples": 0}

    def correctness(completions: list, answer: list, task: list, completion_ids: list, **_: Any) -> list[float]:
        counts["tokens"] += sum(len(c) for c in completion_ids)
        counts["samples"] += len(completions)
        return [verified(Sample(c[0]["content"], a, t, len(ids), cfg.sampling.max_new_tokens))
                for c, a, t, ids in zip(completions, answer, task, completion_ids, strict=True)]

    model = modeling.load_model(str(inputs["policy"]), params.model.dtype, torch.device("cpu"))
    tok = modeling.load_tokenizer(str(inputs["policy"]))
    targs = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=cfg.steps, num_generations=g,
        per_device_train_batch_size=min(cfg.micro_batch_size, b * g),
        gradient_accumulation_steps=max(1, b * g // cfg.micro_batch_size),
        max_completion_length=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p, top_k=0, learning_rate=cfg.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.weight_decay, adam_beta1=0.9,
        adam_beta2=0.99, max_grad_norm=cfg.max_grad_norm, beta=0.0, epsilon=cfg.clip_eps_low,
        epsilon_high=cfg.clip_eps_high, loss_type="dapo", scale_rewards="group", num_iterations=1,
        mask_truncated_completions=False, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        seed=seed, bf16=False, disable_tqdm=True, dataloader_num_workers=0, **ARMS[args.worker])
    trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=targs, train_dataset=ds, processing_class=tok)

    timers = {"gen": 0.0, "reward": 0.0, "logprob": 0.0}

    def timed(name: str, fn: Any, only_no_grad: bool = False) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    trainer._generate_single_turn = timed("gen", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("logprob", trainer._get_per_token_logps_and_entropies,
                                                       only_no_grad=True)
    snap: dict[str, Any] = {}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.loop_s, self.t = 0.0, 0.0

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *a: Any, **kw: Any) -> None:
            self.loop_s += time.perf_counter() - self.t
            if "state" not in snap and self.loop_s >= args.snapshot_s:
                snap["state"], snap["step"] = copy.deepcopy(trainer.model.state_dict()), state.global_step

    clock = Clock()
    trainer.add_callback(clock)
    trainer.train()
    rss = peak_rss_mb()
    n = trainer.state.global_step
    step = clock.loop_s / n
    gen, rew, lp = (timers[k] / n for k in ("gen", "reward", "logprob"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    final = trainer.model
    ev_steps = evaluate(final, tok)
    if "state" in snap:
        final.load_state_dict(snap["state"])
        ev_time = evaluate(final, tok)
    else:  # TRL finished within our arm's wall time
        ev_time, snap["step"] = ev_steps, n
    return {"arm": args.worker, "steps": n, "loop_s": clock.loop_s, "samples_per_s": counts["samples"] / clock.loop_s,
            "tokens_per_s": counts["tokens"] / clock.loop_s, "step_s": step, "gen_s": gen, "reward_s": rew,
            "logprob_s": lp, "update_s": step - gen - rew - lp, "other_s": 0.0, "peak_rss_mb": rss,
            "pass1_same_steps": ev_steps, "pass1_same_time": ev_time, "steps_at_same_time": snap["step"],
            "rewards": [round(float(r), 4) for r in rewards],
            "final_reward": round(float(np.mean(rewards[-5:])), 4) if rewards else None}
