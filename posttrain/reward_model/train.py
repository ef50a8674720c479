"""Bradley-Terry training of one ensemble member, and the pairwise statistics of a reward model's scores.

The model: ``AutoModelForSequenceClassification`` (``num_labels=1``) loaded from the SFT policy's folder
(``modeling.load_scorer``): the policy's trunk with a scalar head reading the hidden state of the last real
token. Chosen over a value head bolted on the causal LM because the artifact is then a standard HF folder
(``from_pretrained``, TRL and vLLM's reward/classify runners load it as is), transformers does the
last-non-pad-token read-out for every architecture, and peft's ``SEQ_CLS`` task trains the head in full beside
LoRA adapters.

The loss (Bradley-Terry; Ouyang et al. 2022): ``-log sigmoid(r(chosen) - r(rejected))`` averaged over the batch's
pairs; a micro-batch's chosen and rejected sequences go through one forward. The loop is ``training.accumulate``
(the house's one optimizer-step loop) with AdamW, warmup + cosine, gradient clipping; batches are a pure function
of (member seed, step) (``training.step_batch``), so a checkpoint (``posttrain.checkpoint``, every
``checkpoint_every`` steps) resumes a killed member exactly where it was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from posttrain import checkpoint, metrics, training
from posttrain.config import RewardModel
from posttrain.reward_model.scorer import encode, score_ids
from posttrain.schema import BATCH_ROWS
from posttrain.trainlog import TrainLog

LOG_FIELDS = ["step", "loss", "acc", "margin", "lr", "grad_norm"]
# Seeds of a reward model (``posttrain.seeds`` style: named once, far from the others' keys). Here rather than in
# ``posttrain.seeds`` for now: every stage lists seeds.py as a dep, so adding them there re-runs the whole DAG.
RM_TAG = 7_000_003
STEP_STRIDE = 1_000_003  # = seeds.STEP_STRIDE
EncodedPair = tuple[np.ndarray | list[int], np.ndarray | list[int]]  # (chosen ids, rejected ids)


def bt_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair Bradley-Terry loss ``-log sigmoid(r_c - r_r)`` ([B]); softplus(r_r - r_c), the same, stably."""
    return F.softplus(r_rejected - r_chosen)


def train_member(model: torch.nn.Module, pairs: Sequence[EncodedPair], cfg: RewardModel, pad: int, seed: int,
                 ckpt_dir: Path, fp: str, progress: bool = True, desc: str = "reward_model",
                 log_to: TrainLog | None = None) -> dict[str, Any]:
    """Train ``model`` on ``pairs`` for ``cfg.steps`` steps of ``cfg.batch_size`` pairs; resumable from
    ``ckpt_dir`` (checkpoints fingerprinted ``fp``). Returns ``{"log": rows, "start": resumed step, "seconds"}``."""
    log_to = log_to if log_to is not None else TrainLog(None, LOG_FIELDS)
    model.train()
    opt, sched, start = training.start_or_resume(model, cfg.lr, cfg.weight_decay, cfg.warmup_steps, cfg.steps,
                                                 ckpt_dir, fp, log_to)
    t0 = time.time()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=desc, disable=not progress)
    for step in bar:
        idx, _ = training.step_batch(seed, step, len(pairs), cfg.batch_size, 0.0)
        batch = [pairs[i] for i in idx]
        stats = {"loss": 0.0, "correct": 0, "margin": 0.0}

        def loss_of(chunk: list[EncodedPair], real: bool, n: int = len(batch), stats: dict = stats) -> torch.Tensor:
            r = score_ids(model, [c for c, _ in chunk] + [r for _, r in chunk], pad)  # [2b]: chosen, then rejected
            rc, rr = r[: len(chunk)], r[len(chunk) :]
            loss = bt_loss(rc, rr)
            if real:
                stats["loss"] += loss.sum().item()
                stats["correct"] += int((rc > rr).sum())
                stats["margin"] += (rc - rr).sum().item()
            return loss.sum() / n  # this chunk's share of the batch mean

        grad_norm = training.accumulate(model, opt, batch, cfg.micro_batch_size, loss_of, cfg.max_grad_norm)
        sched.step()
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            n = len(batch)
            log_to.append({"step": done, "loss": round(stats["loss"] / n, 6), "acc": round(stats["correct"] / n, 4),
                           "margin": round(stats["margin"] / n, 4), "lr": sched.get_last_lr()[0],
                           "grad_norm": round(grad_norm, 4)})
            bar.set_postfix(loss=f"{stats['loss'] / n:.4f}")
        if done % cfg.checkpoint_every == 0 and done < cfg.steps:
            checkpoint.save(ckpt_dir, done, fp, model, opt, {"scheduler": sched.state_dict(), "log": log_to.rows})
    model.eval()
    return {"log": log_to.rows, "start": start, "seconds": time.time() - t0}


def pairwise(r_chosen: np.ndarray, r_rejected: np.ndarray) -> dict[str, Any]:
    """Pairwise statistics of one scorer on N pairs: accuracy (the share with r_c > r_r; a tie counts as wrong)
    with its Wilson 95% interval (``accuracy_ci``), ties, and the mean margin r_c - r_r."""
    n = len(r_chosen)
    wins = int((r_chosen > r_rejected).sum())
    return {"pairs": n, "accuracy": wins / n if n else float("nan"),
            "accuracy_ci": [round(x, 4) for x in metrics.wilson_ci(wins, n)],  # as evaluate's <metric>_ci
            "ties": int((r_chosen == r_rejected).sum()),
            "margin": float(np.mean(r_chosen - r_rejected)) if n else float("nan")}


def ensemble_stats(chosen: np.ndarray, rejected: np.ndarray) -> dict[str, Any]:
    """``pairwise`` of each member (columns of the ``[N, K]`` score arrays) and of the members' mean."""
    out = {f"member_{k}": pairwise(chosen[:, k], rejected[:, k]) for k in range(chosen.shape[1])}
    out["ensemble_mean"] = pairwise(chosen.mean(axis=1), rejected.mean(axis=1))
    return out


def member_seed(arm: int, k: int) -> int:
    """Member ``k`` of an ensemble (its head init, bootstrap and batch order); ``arm`` = seed + reward_model.seed."""
    return arm * STEP_STRIDE + RM_TAG + 13 * k


def pairs_seed(arm: int) -> list[int]:
    """The generator key of the pair draws (pairs per prompt, ``max_pairs``)."""
    return [RM_TAG, arm]


def bootstrap_indices(n: int, seed: int, resample: bool) -> np.ndarray:
    """The training pairs of one member: a resample with replacement of ``n`` (``resample``), else all of them."""
    if not resample:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).integers(0, n, size=n))


def encode_pairs(tok: PreTrainedTokenizerBase, rows: pa.Table, limit: int) -> tuple[list[EncodedPair], np.ndarray]:
    """The training pairs' token ids (chosen, rejected: int32 arrays, not lists of Python ints) and a mask [N] of
    the rows whose both sequences fit in ``limit`` tokens; ``rows`` is read ``BATCH_ROWS`` at a time."""
    train: list[EncodedPair] = []
    fits = np.zeros(rows.num_rows, dtype=bool)
    at = 0
    for batch in rows.select(["prompt", "chosen", "rejected", "split"]).to_batches(max_chunksize=BATCH_ROWS):
        for i, r in enumerate(batch.to_pylist(), start=at):
            c, j = (np.asarray(encode(tok, r["prompt"], r[k]), dtype=np.int32) for k in ("chosen", "rejected"))
            fits[i] = max(len(c), len(j)) <= limit
            if fits[i] and r["split"] == "train":
                train.append((c, j))
        at += batch.num_rows
    return train, fits
