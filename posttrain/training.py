"""Plain training functions: SFT example encoding, batching, optimizer/schedule, resumable checkpoints.

A resumable checkpoint holds model, optimizer, scheduler, RNG states, the step and the training log,
plus a fingerprint of everything that determines the run's result (params section less the fields marked
``config.NOT_RESULT``, model config, input data hash). A checkpoint whose fingerprint differs from the
current run's is stale: never resumed from, moved aside (not deleted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from posttrain import distributed, logprobs
from posttrain.config import NOT_RESULT
from posttrain.schema import atomic_path
from posttrain.tasks import get_task

IGNORE = -100
log = logging.getLogger("posttrain.training")


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(*parts: Any) -> str:
    """A stable hash of what determines a run's result. Pydantic models are dumped without the fields marked
    ``config.NOT_RESULT`` (micro-batch size, packing, checkpoint cadence): changing those between a kill and
    a resume still resumes."""
    return hashlib.sha256(json.dumps([_result_fields(p) for p in parts], sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


def _result_fields(x: Any) -> Any:
    if isinstance(x, BaseModel):
        return {name: _result_fields(getattr(x, name)) for name, f in type(x).model_fields.items()
                if (f.json_schema_extra or {}) != NOT_RESULT}
    if isinstance(x, list | tuple):
        return [_result_fields(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _result_fields(v) for k, v in x.items()}
    return x


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


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, warmup: int, total: int
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    return opt, get_cosine_schedule_with_warmup(opt, warmup, total)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


def save_resumable(ckpt_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``step_<N>.pt`` atomically, then prune all but the newest ``keep`` (rank 0 only: the others
    return the path it writes)."""
    path = ckpt_dir / f"step_{step:07d}.pt"
    if not distributed.current().main:
        return path
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def load_resumable(ckpt_dir: Path, fp: str) -> dict[str, Any] | None:
    """The newest checkpoint whose fingerprint is ``fp``. Checkpoints of another configuration are never
    resumed from, and never deleted either: the folder is moved aside to ``<name>.stale-<their fp>-<time>``
    (logged), so a changed setting cannot wipe hours of training. Under torchrun rank 0 looks first (and moves
    aside); the other ranks then read what it left (the folder must be on storage every rank sees)."""
    d = distributed.current()
    if not d.main:
        d.barrier()
    try:
        return _load_resumable(ckpt_dir, fp)
    finally:
        if d.main:
            d.barrier()


def _load_resumable(ckpt_dir: Path, fp: str) -> dict[str, Any] | None:
    if not ckpt_dir.is_dir():
        return None
    for path in sorted(ckpt_dir.glob("step_*.pt"), reverse=True):
        state = torch.load(path, weights_only=False)
        if state.get("fingerprint") == fp:
            return state
        aside = ckpt_dir.with_name(f"{ckpt_dir.name}.stale-{state.get('fingerprint')}-{time.strftime('%Y%m%d-%H%M%S')}")
        ckpt_dir.rename(aside)
        log.warning("checkpoints in %s belong to another configuration (fingerprint %s, this run %s): moved "
                    "aside to %s; delete it when it is no longer needed", ckpt_dir, state.get("fingerprint"), fp,
                    aside)
        return None
    return None


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
    use_cot = np.random.default_rng([seed, 1_000_003, step]).random(batch_size) < cot_frac
    return np.asarray(idx), use_cot


SFT_LOG_FIELDS = ["step", "phase", "loss", "lr", "grad_norm", "cot_frac"]


def sft_train(model: PreTrainedModel, tok: PreTrainedTokenizerBase, demos: Sequence[dict[str, Any]], cfg: Any,
              seed: int, ckpt_dir: Path, fp: str, progress: bool = True, desc: str = "sft") -> dict[str, Any]:
    """Supervised fine-tuning on demonstrations with the phases of ``cfg`` (``config.Sft``), resumable.

    Loss on completion tokens only, token-mean over the whole batch (exact under gradient accumulation);
    AdamW with warmup + cosine over all phases. Each phase shows a ``cot_frac`` share of demos with their
    full solution and the rest with the bare answer (the mixed-format cold start). Batches are a pure
    function of (seed, step); every ``checkpoint_every`` steps a resumable checkpoint with fingerprint
    ``fp`` goes to ``ckpt_dir``, and a call that finds one resumes from it.
    Under torchrun ``model`` is the ``distributed.Dist.wrap`` handle: each rank takes its contiguous share of
    every step's batch (the same global batch as one process), losses are normalised by the global token count
    and gradients all-reduced, so the weights equal a one-process run's up to reduction order.
    Returns ``{"log": rows (SFT_LOG_FIELDS), "start": resumed step, "seconds": ..., "tokens": ...}``.
    """
    d = distributed.current()
    device = next(model.parameters()).device
    model.train()
    # both renderings of each demo: full solution (cot) and bare answer (direct)
    enc = {style: [encode_sft(tok, d["prompt"], get_task(d["task"]).render(d["prompt"], d["answer"],
                                                                           d["solution"], style))
                   for d in demos]
           for style in ("cot", "direct")}
    total = cfg.total_steps
    opt, sched = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.warmup_steps, total)
    start, log_rows = 0, []
    state = load_resumable(ckpt_dir, fp)
    if state is not None:
        d.load_state(model, opt, state["model"], state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rank_rng(state["rng"])
        start, log_rows = state["step"], state["log"]
        log.info("resuming %s from %s step %d", desc, ckpt_dir, start)

    phase_of = [(i, p) for i, p in enumerate(cfg.phases) for _ in range(p.steps)]  # step -> (phase, spec)
    n_micro = cfg.batch_size // d.world // cfg.micro_batch_size  # config: batch = world x micro x accumulation
    t0, tokens = time.time(), 0
    bar = tqdm(range(start, total), initial=start, total=total, desc=desc, disable=not progress)
    for step in bar:
        phase, spec = phase_of[step]
        idx, use_cot = step_batch(seed, step, len(demos), cfg.batch_size, spec.cot_frac)
        examples = [enc["cot" if c else "direct"][i] for i, c in zip(idx, use_cot, strict=True)]
        n_tok = sum(sum(1 for y in ex[1][1:] if y != IGNORE) for ex in examples)  # next-token targets (global)
        mine = d.shard(examples)
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in range(n_micro):
            mb = collate(mine[m * cfg.micro_batch_size : (m + 1) * cfg.micro_batch_size], tok.pad_token_id)
            with d.grad_sync(model, m == n_micro - 1):
                s, _ = distributed.forward(model, sum_token_nll, {k: v.to(device) for k, v in mb.items()})
                (s * d.loss_scale / max(n_tok, 1)).backward()
            loss_sum += s.item()
        (loss_sum,) = d.sum(loss_sum)
        grad_norm = d.clip_grad_norm(model, cfg.max_grad_norm)
        opt.step()
        sched.step()
        loss = loss_sum / max(n_tok, 1)
        tokens += n_tok
        done = step + 1
        if done % cfg.log_every == 0 or done == total:
            log_rows.append({"step": done, "phase": phase, "loss": round(loss, 6), "lr": sched.get_last_lr()[0],
                             "grad_norm": round(grad_norm, 4), "cot_frac": spec.cot_frac})
            bar.set_postfix(loss=f"{loss:.4f}", phase=phase)
        if done % cfg.checkpoint_every == 0 and done < total:
            msd, osd = d.state(model, opt)
            save_resumable(ckpt_dir, done, {
                "fingerprint": fp, "step": done, "model": msd, "optimizer": osd,
                "scheduler": sched.state_dict(), "rng": rank_rngs(), "log": log_rows})
    model.eval()
    return {"log": log_rows, "start": start, "seconds": time.time() - t0, "tokens": tokens}


def rank_rngs() -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (a collective under torchrun)."""
    return distributed.current().gather_shards([rng_state()])


def set_rank_rng(saved: dict[str, Any] | list[dict[str, Any]]) -> None:
    """Restore this rank's RNG states from ``rank_rngs()``. Saved at another world size: rank 0 takes rank 0's
    and the others keep their fresh per-rank seeds (data order is (seed, step)-pure either way; only
    dropout-like randomness differs from an uninterrupted run)."""
    d = distributed.current()
    states = [saved] if isinstance(saved, dict) else saved
    if len(states) == d.world:
        set_rng_state(states[d.rank])
    else:
        if d.rank == 0:
            set_rng_state(states[0])
        log.warning("checkpoint saved at world size %d, resuming at %d: per-rank RNG states start fresh",
                    len(states), d.world)


def save_loop_state(ckpt_dir: Path, step: int, fp: str, cursor_pos: int, model: torch.nn.Module,
                    opt: torch.optim.Optimizer, log_rows: list[dict[str, Any]], ref: torch.nn.Module | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    """Resumable checkpoint of an online loop (rl, distill): model, optimizer, RNG, step, prompt cursor, log,
    ``ref`` (a plain reference model that changes during the run: rl.ref_reset) and ``extra`` (other loop
    state, e.g. per-prompt priors). Full (unsharded) states, written by rank 0; every rank calls it (gathering
    is a collective)."""
    msd, osd = distributed.current().state(model, opt)
    save_resumable(ckpt_dir, step, {"fingerprint": fp, "step": step, "cursor": cursor_pos, "model": msd,
                                    "optimizer": osd, "rng": rank_rngs(), "log": log_rows,
                                    "ref": None if ref is None else ref.state_dict(), "extra": extra or {}})


def restore_loop_state(ckpt_dir: Path, fp: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                       ref: torch.nn.Module | None = None, extra: dict[str, Any] | None = None
                       ) -> tuple[int, list[dict[str, Any]], int]:
    """Load the newest matching ``save_loop_state`` checkpoint into model/optimizer/RNG (and ``ref``; ``extra``
    is updated with the saved extra state). Returns (step, log rows, cursor position); (0, [], 0) when there
    is none."""
    state = load_resumable(ckpt_dir, fp)
    if state is None:
        return 0, [], 0
    if extra is not None:
        extra.update(state.get("extra") or {})
    if ref is not None and state.get("ref") is not None:
        ref.load_state_dict(state["ref"])
    distributed.current().load_state(model, opt, state["model"], state["optimizer"])
    set_rank_rng(state["rng"])
    log.info("resuming from %s step %d", ckpt_dir, state["step"])
    return state["step"], state["log"], state["cursor"]
