"""Training steps: the optimizer, the one accumulation loop every update uses, and the SFT loop.

- ``accumulate``: one optimizer step over a batch of items, micro-batched. It owns what every training update
  shares: each rank's share of the items (``distributed.Dist.shard``), zero-weight repeats so every rank runs
  the same number of forward/backward passes (collectives line up under DDP and FSDP2), gradient sync on the
  last micro-batch only, the world-size loss scale, gradient clipping and the optimizer step. Used by SFT
  (``sft_train``), the RL policy update (``posttrain.rl.update``) and both distillation updates
  (``posttrain.distillation``); each passes a ``loss_of_batch`` returning its micro-batch's share of the
  full-batch loss (normalised by full-batch totals, so the accumulated gradient is exactly the full batch's).
- ``sft_train``: supervised fine-tuning with the mixed-format phases, resumable (``posttrain.checkpoint``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from posttrain import checkpoint, distributed, logprobs, modeling, seeds
from posttrain.tasks import get_task
from posttrain.trainlog import TrainLog

IGNORE = -100
log = logging.getLogger("posttrain.training")
T = TypeVar("T")

# AdamW's betas, named once: SFT (a long, scheduled run) averages its second moment over fewer steps than the
# online loops, whose few, noisy steps per batch want the slower (0.99) second-moment average.
SFT_BETAS = (0.9, 0.95)
ONLINE_BETAS = (0.9, 0.99)  # rl, distill
DISTILL_WEIGHT_DECAY = 0.01  # torch's AdamW default, which distill has always used; rl and sft take theirs from params


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW over the parameters of ``model`` that train (LoRA: the adapters only)."""
    return torch.optim.AdamW(modeling.trainable_params(model), lr=lr, weight_decay=weight_decay, betas=betas)


def accumulate(model: torch.nn.Module, opt: torch.optim.Optimizer, items: Sequence[T], micro_batch_size: int,
               loss_of_batch: Callable[[list[T], bool], torch.Tensor], max_grad_norm: float) -> float:
    """One optimizer step over ``items`` (the *global* batch: every rank passes the same list); returns the
    gradient norm before clipping.

    This rank takes its contiguous share, in micro-batches of ``micro_batch_size``; ``loss_of_batch(chunk,
    real)`` returns the chunk's share of the full-batch loss (divided by full-batch totals, so the summed
    micro-batch gradients are the full batch's gradient), recording its own statistics only when ``real``.
    A rank with fewer micro-batches than the busiest one repeats its first (or the batch's first item) with
    weight 0 (``real`` False), so every rank runs the same forwards and backwards. ``model`` is the training
    handle (``Dist.wrap``; the model itself in one process); each loss is scaled by the world size because
    DDP and FSDP2 average gradients over ranks.
    """
    d = distributed.current()
    opt.zero_grad(set_to_none=True)
    mine = d.shard(items)
    chunks = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    n_micro = d.micro_count(len(chunks))
    for k in range(n_micro):
        real = k < len(chunks)
        chunk = chunks[k] if real else (chunks or [list(items[:1])])[0]
        with d.grad_sync(model, k == n_micro - 1):
            loss = loss_of_batch(chunk, real)
            (loss * (d.loss_scale if real else 0.0)).backward()
    grad_norm = d.clip_grad_norm(model, max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)  # no gradient memory held through the next generation (a colocated engine's)
    return grad_norm


# ------------------------------------------------------------------------------------------------ SFT
def encode_sft(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Chat-template ``prompt`` + ``completion``; labels are IGNORE on the prompt (loss on completion only).

    Works for any chat template whose rendering of [user] + generation prompt is a prefix of the
    rendering of [user, assistant].
    """
    msgs = [{"role": "user", "content": prompt}]
    p = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": completion}], tokenize=True)
    p, full = _ids(p), _ids(full)
    if full[: len(p)] != p:
        raise ValueError("chat template: the generation prompt is not a prefix of the full conversation")
    return full, [IGNORE] * len(p) + full[len(p) :]


def _ids(enc: Any) -> list[int]:
    return list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (ids, labels) pairs into input_ids / attention_mask / labels, all [B, T]."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sum_token_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over completion tokens, and their count (divide by the *whole* batch's count
    so gradient accumulation gives exactly the full-batch token-mean loss). Memory-lean: the LM head runs
    only at completion positions, in chunks (``posttrain.logprobs``)."""
    target = batch["labels"][:, 1:]
    t = {"ids": batch["input_ids"], "attn": batch["attention_mask"], "mask": target != IGNORE}
    logp, _ = logprobs.token_logp_entropy(model, t, entropy="off")  # targets are the ids: labels copy them
    return -logp.sum(), int(t["mask"].sum())


def step_batch(seed: int, step: int, n_examples: int, batch_size: int, cot_frac: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """Example indices and CoT/direct choices of optimizer step ``step`` (a pure function of its args).

    Examples are visited in per-epoch permutations of ``seed``; ``use_cot[i]`` is drawn with probability
    ``cot_frac`` from a generator keyed on (seed, step).
    """
    start = step * batch_size
    idx = []
    while len(idx) < batch_size:
        epoch, pos = divmod(start + len(idx), n_examples)
        perm = np.random.default_rng([seed, epoch]).permutation(n_examples)
        idx.extend(perm[pos : pos + batch_size - len(idx)].tolist())
    use_cot = np.random.default_rng(seeds.sft_format(seed, step)).random(batch_size) < cot_frac
    return np.asarray(idx), use_cot


SFT_LOG_FIELDS = ["step", "phase", "loss", "lr", "grad_norm", "cot_frac"]


def sft_train(model: PreTrainedModel, tok: PreTrainedTokenizerBase, demos: Sequence[dict[str, Any]], cfg: Any,
              seed: int, ckpt_dir: Path, fp: str, progress: bool = True, desc: str = "sft",
              log_to: TrainLog | None = None) -> dict[str, Any]:
    """Supervised fine-tuning on demonstrations with the phases of ``cfg`` (``config.Sft``), resumable.

    Loss on completion tokens only, token-mean over the whole batch (exact under gradient accumulation);
    AdamW with warmup + cosine over all phases. Each phase shows a ``cot_frac`` share of demos with their
    full solution and the rest with the bare answer (the mixed-format cold start). Batches are a pure
    function of (seed, step); every ``checkpoint_every`` steps a resumable checkpoint with fingerprint
    ``fp`` goes to ``ckpt_dir``, and a call that finds one resumes from it. Every ``log_every`` steps a row
    (SFT_LOG_FIELDS) goes to ``log_to`` (its CSV and MLflow, live) as it is made; a resumed run's log starts
    from the checkpoint's rows.
    Under torchrun ``model`` is the ``distributed.Dist.wrap`` handle (see ``accumulate``): the weights equal a
    one-process run's up to reduction order.
    Returns ``{"log": rows, "start": resumed step, "seconds": ..., "tokens": ...}``.
    """
    d = distributed.current()
    device = next(model.parameters()).device
    log_to = log_to if log_to is not None else TrainLog(None, SFT_LOG_FIELDS)
    model.train()
    # both renderings of each demo: full solution (cot) and bare answer (direct)
    enc = {style: [encode_sft(tok, x["prompt"], get_task(x["task"]).render(x["prompt"], x["answer"],
                                                                           x["solution"], style))
                   for x in demos]
           for style in ("cot", "direct")}
    total = cfg.total_steps
    opt = adamw(model, cfg.lr, cfg.weight_decay, SFT_BETAS)
    sched = get_cosine_schedule_with_warmup(opt, cfg.warmup_steps, total)
    start = 0
    state = checkpoint.restore(ckpt_dir, fp, model, opt)
    if state is not None:
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
        log_to.resume(state["log"])
        log.info("resuming %s from %s step %d", desc, ckpt_dir, start)

    phase_of = [(i, p) for i, p in enumerate(cfg.phases) for _ in range(p.steps)]  # step -> (phase, spec)
    t0, tokens = time.time(), 0
    bar = tqdm(range(start, total), initial=start, total=total, desc=desc, disable=not progress)
    for step in bar:
        phase, spec = phase_of[step]
        idx, use_cot = step_batch(seed, step, len(demos), cfg.batch_size, spec.cot_frac)
        examples = [enc["cot" if c else "direct"][i] for i, c in zip(idx, use_cot, strict=True)]
        n_tok = sum(sum(1 for y in ex[1][1:] if y != IGNORE) for ex in examples)  # next-token targets (global)
        loss_sum = 0.0

        def loss_of(chunk: list[tuple[list[int], list[int]]], real: bool, n_tok: int = n_tok) -> torch.Tensor:
            nonlocal loss_sum
            mb = collate(chunk, tok.pad_token_id)
            s, _ = distributed.forward(model, sum_token_nll, {k: v.to(device) for k, v in mb.items()})
            if real:
                loss_sum += s.item()
            return s / max(n_tok, 1)

        grad_norm = accumulate(model, opt, examples, cfg.micro_batch_size, loss_of, cfg.max_grad_norm)
        (loss_sum,) = d.sum(loss_sum)
        sched.step()
        loss = loss_sum / max(n_tok, 1)
        tokens += n_tok
        done = step + 1
        if done % cfg.log_every == 0 or done == total:
            log_to.append({"step": done, "phase": phase, "loss": round(loss, 6), "lr": sched.get_last_lr()[0],
                           "grad_norm": round(grad_norm, 4), "cot_frac": spec.cot_frac})
            bar.set_postfix(loss=f"{loss:.4f}", phase=phase)
        if done % cfg.checkpoint_every == 0 and done < total:
            checkpoint.save(ckpt_dir, done, fp, model, opt, {"scheduler": sched.state_dict(), "log": log_to.rows})
    model.eval()
    return {"log": log_to.rows, "start": start, "seconds": time.time() - t0, "tokens": tokens}
