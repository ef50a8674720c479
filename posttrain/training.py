"""Training steps: the optimizer, the one accumulation loop every update uses, and the SFT loop.

- ``accumulate``: one optimizer step over a batch of items, micro-batched. It owns what every training update
  shares: each rank's share of the items (``distributed.Dist.shard``), zero-weight repeats so every rank runs
  the same number of forward/backward passes (collectives line up under DDP and FSDP2), gradient sync on the
  last micro-batch only, the world-size loss scale, gradient clipping and the optimizer step. Used by SFT
  (``sft_train``), the RL policy update (``posttrain.rl.update``) and both distillation updates
  (``posttrain.distillation``); each passes a ``loss_of_batch`` returning its micro-batch's share of the
  full-batch loss (normalised by full-batch totals, so the accumulated gradient is exactly the full batch's).
- ``sft_train``: supervised fine-tuning with the mixed-format phases, resumable (``posttrain.checkpoint``),
  on demos tokenized once (``posttrain.sft_data``: cache, ``max_seq_len`` policy, padded or packed batches).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from posttrain import checkpoint, distributed, logprobs, modeling, seeds, sft_data
from posttrain.config import ConfigError, ToolsCfg
from posttrain.demos import Demos, as_table
from posttrain.sft_data import IGNORE
from posttrain.trainlog import TrainLog

log = logging.getLogger("posttrain.training")
T = TypeVar("T")

# AdamW's betas, named once: SFT (a long, scheduled run) averages its second moment over fewer steps than the
# online loops, whose few, noisy steps per batch want the slower (0.99) second-moment average.
SFT_BETAS = (0.9, 0.95)
ONLINE_BETAS = (0.9, 0.99)  # rl, distill
DISTILL_WEIGHT_DECAY = 0.01  # torch's AdamW default, which distill has always used; rl and sft take theirs from params


def start_or_resume(model: torch.nn.Module, lr: float, weight_decay: float, warmup_steps: int, total_steps: int,
                    ckpt_dir: Path, fp: str, log_to: TrainLog, extra: dict[str, Any] | None = None
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR, int]:
    """AdamW (SFT's betas) with warmup + cosine over ``total_steps``, restored from ``ckpt_dir``'s last checkpoint
    when it carries fingerprint ``fp`` (the model, optimizer, scheduler and ``log_to``'s rows; ``extra`` updated
    with the checkpoint's saved ``extra``): ``(opt, sched, first step to run)``. The supervised loops (sft,
    reward_model) start here."""
    opt = adamw(model, lr, weight_decay, SFT_BETAS)
    sched = get_cosine_schedule_with_warmup(opt, warmup_steps, total_steps)
    state = checkpoint.restore(ckpt_dir, fp, model, opt)
    if state is None:
        return opt, sched, 0
    sched.load_state_dict(state["scheduler"])
    log_to.resume(state["log"])
    if extra is not None:
        extra.update(state.get("extra") or {})
    return opt, sched, state["step"]


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW over the parameters of ``model`` that train (LoRA: the adapters only)."""
    return torch.optim.AdamW(modeling.trainable_params(model), lr=lr, weight_decay=weight_decay, betas=betas)


@dataclass(frozen=True)
class MicroBatch:
    """How ``accumulate`` cuts its share of a batch: at most ``size`` sequences per micro-batch and, with
    ``max_tokens``, at most that many *padded* tokens (sequences x the longest one: what the activations scale
    with), consecutive items in order; ``length`` gives an item's tokens. One item longer than the budget is a
    micro-batch alone. Real trainers budget tokens: 4 sequences of 8k tokens are 100x the activations of 4 of 80."""

    size: int
    max_tokens: int | None = None
    length: Callable[[Any], int] = len

    def chunks(self, items: Sequence[T]) -> list[list[T]]:
        """``items`` cut into micro-batches, in order."""
        if self.max_tokens is None:
            return [list(items[i : i + self.size]) for i in range(0, len(items), self.size)]
        out: list[list[T]] = []
        cur: list[T] = []
        widest = 0
        for it in items:
            n = self.length(it)
            if cur and (len(cur) >= self.size or (len(cur) + 1) * max(widest, n) > self.max_tokens):
                out.append(cur)
                cur, widest = [], 0
            cur.append(it)
            widest = max(widest, n)
        return out + [cur] * bool(cur)


def seq_tokens(s: Any) -> int:
    """Tokens of a ``logprobs.Seq`` (prompt + completion): the RL and distillation updates' ``MicroBatch.length``."""
    return int(s.prompt_ids.numel() + s.completion_ids.numel())


def accumulate(model: torch.nn.Module, opt: torch.optim.Optimizer, items: Sequence[T], micro: int | MicroBatch,
               loss_of_batch: Callable[[list[T], bool], torch.Tensor], max_grad_norm: float,
               local: bool = False) -> float:
    """One optimizer step over ``items`` (the *global* batch: every rank passes the same list); returns the
    gradient norm before clipping.

    This rank takes its contiguous share (``local``: ``items`` already are this rank's share, possibly
    empty; then ``loss_of_batch`` may get an empty chunk for a zero-weight pass), in micro-batches of
    ``micro`` sequences (an int) or as a :class:`MicroBatch` cuts them (a token budget); ``loss_of_batch(chunk,
    real)`` returns the chunk's share of the full-batch loss (divided by full-batch totals, so the summed
    micro-batch gradients are the full batch's gradient), recording its own statistics only when ``real``.
    A rank with fewer micro-batches than the busiest one repeats its first (or the batch's first item) with
    weight 0 (``real`` False), so every rank runs the same forwards and backwards. ``model`` is the training
    handle (``Dist.wrap``; the model itself in one process); each loss is scaled by the world size because
    DDP and FSDP2 average gradients over ranks.
    """
    d = distributed.current()
    opt.zero_grad(set_to_none=True)
    mine = list(items) if local else d.shard(items)
    chunks = (micro if isinstance(micro, MicroBatch) else MicroBatch(micro)).chunks(mine)
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
    # autocast caches its bf16 cast of each fp32 master until its region ends, blind to the in-place step just
    # taken: a region held over several steps (the sft stage's, rl's epochs x minibatches) would run on stale casts
    torch.clear_autocast_cache()
    return grad_norm


# ------------------------------------------------------------------------------------------------ SFT
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
    so gradient accumulation gives exactly the full-batch token-mean loss). ``batch`` is a ``collate`` batch
    (input_ids / attention_mask / labels) or a ``sft_data.collate_packed`` one. Memory-lean: the LM head runs
    only at completion positions, in chunks (``posttrain.logprobs``)."""
    if "labels" in batch:
        batch = {"ids": batch["input_ids"], "attn": batch["attention_mask"], "mask": batch["labels"][:, 1:] != IGNORE}
    logp, _ = logprobs.token_logp_entropy(model, batch, entropy="off")  # targets are the ids: labels copy them
    return -logp.sum(), int(batch["mask"].sum())


def step_batch(seed: int, step: int, n_examples: int, batch_size: int, cot_frac: float, tool_frac: float = 0.0
               ) -> tuple[np.ndarray, np.ndarray]:
    """Example indices and rendering styles of optimizer step ``step`` (a pure function of its args).

    Examples are visited in per-epoch permutations of ``seed``; each example's style is drawn from one uniform
    ``u`` of a generator keyed on (seed, step): ``cot`` when ``u < cot_frac``, ``tool`` when ``u < cot_frac +
    tool_frac``, else ``direct`` (so with ``tool_frac = 0`` the draws are those of a run without tool demos).
    """
    start = step * batch_size
    idx = []
    while len(idx) < batch_size:
        epoch, pos = divmod(start + len(idx), n_examples)
        perm = np.random.default_rng([seed, epoch]).permutation(n_examples)
        idx.extend(perm[pos : pos + batch_size - len(idx)].tolist())
    u = np.random.default_rng(seeds.sft_format(seed, step)).random(batch_size)
    styles = np.where(u < cot_frac, "cot", np.where(u < cot_frac + tool_frac, sft_data.TOOL, "direct"))
    return np.asarray(idx), styles


SFT_LOG_FIELDS = ["step", "phase", "loss", "lr", "grad_norm", "cot_frac"]


def sft_train(model: PreTrainedModel, tok: PreTrainedTokenizerBase, demos: Demos, cfg: Any,
              seed: int, ckpt_dir: Path, fp: str, progress: bool = True, desc: str = "sft",
              log_to: TrainLog | None = None, tools: ToolsCfg | None = None) -> dict[str, Any]:
    """Supervised fine-tuning on demonstrations with the phases of ``cfg`` (``config.Sft``), resumable.
    With tool demos (a phase's ``tool_frac`` > 0) ``tools`` (the ``tools:`` section) says how their calls and
    observations are written; observation tokens carry no loss.

    Loss on completion tokens only, token-mean over the whole batch (exact under gradient accumulation);
    AdamW with warmup + cosine over all phases. Each phase shows a ``cot_frac`` share of demos with their
    full solution and the rest with the bare answer (the mixed-format cold start). Batches are a pure
    function of (seed, step); every ``checkpoint_every`` steps a resumable checkpoint with fingerprint
    ``fp`` goes to ``ckpt_dir``, and a call that finds one resumes from it. Every ``log_every`` steps a row
    (SFT_LOG_FIELDS) goes to ``log_to`` (its CSV and MLflow, live) as it is made; a resumed run's log starts
    from the checkpoint's rows.
    Under torchrun ``model`` is the ``distributed.Dist.wrap`` handle (see ``accumulate``): the weights equal a
    one-process run's up to reduction order.
    Demos are tokenized once (``sft_data.tokenize``, cached in ``ckpt_dir``), ``cfg.max_seq_len`` /
    ``cfg.overlong`` decide what trains (``sft_data.select``) and ``cfg.batching`` how a micro-batch is laid
    out (padded, grouped by length, or packed): the loss is the same token-mean either way.
    Returns ``{"log": rows, "start": resumed step, "seconds": ..., "tokens": ..., "data": counts, "ledger": steps}``
    (``data``: what the max_seq_len policy dropped or truncated, and the padding fraction of the decoder input;
    ``ledger``: per step ``{step, ids, styles}``, the demos it consumed in order, checkpointed with the model so a
    resumed run's ledger is the whole run's).
    """
    d = distributed.current()
    device = next(model.parameters()).device
    demos = as_table(demos)  # Arrow: the stages read it so, on every rank
    demo_ids = demos.column("id")
    log_to = log_to if log_to is not None else TrainLog(None, SFT_LOG_FIELDS)
    model.train()
    total = cfg.total_steps
    saved: dict[str, Any] = {}
    opt, sched, start = start_or_resume(model, cfg.lr, cfg.weight_decay, cfg.warmup_steps, total, ckpt_dir, fp,
                                        log_to, saved)
    ledger: list[dict[str, Any]] = saved.get("ledger", [])  # the demos each step consumed (so far, if resumed)
    if start:
        log.info("resuming %s from %s step %d", desc, ckpt_dir, start)
    # both renderings of each demo (cot, direct), tokenized once (each rank its shard; a resume finds the files)
    tokenized = sft_data.tokenize(tok, demos, ckpt_dir / "tokenized", progress=progress,
                                  tools=(tools or ToolsCfg()) if cfg.tool_demos else None)
    data = sft_data.select(tokenized, cfg.max_seq_len, cfg.overlong)
    if not len(data):
        raise ConfigError(f"sft.max_seq_len: {cfg.max_seq_len} leaves no demonstration to train on ({data.counts})")

    phase_of = [(i, p) for i, p in enumerate(cfg.phases) for _ in range(p.steps)]  # step -> (phase, spec)
    # padded and real decoder positions of every step (a resumed run's steps before the checkpoint: global sums
    # restored on rank 0), so padding_frac is the whole run's
    positions, real_positions = saved.get("positions", (0, 0)) if d.main else (0, 0)
    t0, tokens = time.time(), 0
    bar = tqdm(range(start, total), initial=start, total=total, desc=desc, disable=not progress)
    for step in bar:
        phase, spec = phase_of[step]
        idx, styles = step_batch(seed, step, len(data), cfg.batch_size, spec.cot_frac, spec.tool_frac)
        examples = [data.example(i, str(st)) for i, st in zip(idx, styles, strict=True)]
        kept = [int(data.keep[i]) for i in idx]  # rows of ``demos``
        ids = demo_ids.take(pa.array(kept, pa.int64())).to_pylist()
        ledger.append({"step": step + 1, "ids": [str(k if i is None else i) for i, k in zip(ids, kept, strict=True)],
                       "styles": [str(st) for st in styles]})
        if cfg.batching == "grouped":  # similar lengths share a micro-batch; exact: the loss is order-free
            examples = sft_data.group_by_length(examples, d.world)
        n_tok = sum(sum(1 for y in ex[1][1:] if y != IGNORE) for ex in examples)  # next-token targets (global)
        loss_sum = 0.0

        def loss_of(chunk: list[tuple[list[int], list[int]]], real: bool, n_tok: int = n_tok) -> torch.Tensor:
            nonlocal loss_sum, positions, real_positions
            if cfg.batching == "packed":
                mb = sft_data.collate_packed(chunk, tok.pad_token_id, cfg.max_seq_len)
            else:
                mb = collate(chunk, tok.pad_token_id)
            s, _ = distributed.forward(model, sum_token_nll, {k: v.to(device) for k, v in mb.items()})
            if real:
                loss_sum += s.item()
                positions += (mb["ids"] if "ids" in mb else mb["input_ids"]).numel()
                real_positions += sum(len(x) for x, _ in chunk)
            return s / max(n_tok, 1)

        micro = MicroBatch(cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, lambda e: len(e[0]))
        grad_norm = accumulate(model, opt, examples, micro, loss_of, cfg.max_grad_norm)
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
            so_far = [int(x) for x in d.sum(positions, real_positions)]  # every rank saves: a collective
            checkpoint.save(ckpt_dir, done, fp, model, opt, {"scheduler": sched.state_dict(), "log": log_to.rows,
                                                             "extra": {"ledger": ledger, "positions": so_far}})
    positions, real_positions = d.sum(positions, real_positions)
    data.counts["padding_frac"] = round(1 - real_positions / positions, 4) if positions else 0.0
    model.eval()
    return {"log": log_to.rows, "start": start, "seconds": time.time() - t0, "tokens": tokens, "data": data.counts,
            "ledger": ledger}
