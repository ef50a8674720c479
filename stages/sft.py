"""sft: cold-start supervised fine-tuning on the curated demonstrations.

Inputs: ``paths.curated_dir/sft.parquet``; the starting model ``model.base`` (``tiny`` = built from
``model.tiny`` with a character tokenizer; or a local HF folder / hub id).
Outputs: ``paths.base_model`` (the starting checkpoint, so evaluation and lineage have the exact base
weights), ``paths.sft_model`` (HF checkpoint), ``paths.sft_report_dir/train_log.csv`` (for dvc plots),
``metrics/sft.json``.

Training: chat template, loss on completion tokens only (token-mean over the full batch, exact under
gradient accumulation), AdamW with linear warmup + cosine decay over all phases. Phases implement the
mixed-format cold start (``sft.phases[*].cot_frac``: the share of demos shown with their full solution,
the rest with the bare answer). Batches are a pure function of (seed, step), so the data position is
restored by the step alone. Every ``checkpoint_every`` steps a resumable checkpoint goes to
``paths.sft_checkpoints`` (not a DVC out, so DVC does not delete it before a re-run): re-running after a
crash resumes there and ends with the same weights as an uninterrupted run.

Run: ``dvc repro sft`` or ``python -m stages.sft [--params params.yaml]``.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from posttrain import modeling, plots, training
from posttrain.config import Params
from posttrain.runner import stage_main
from posttrain.schema import atomic_path, read_problems, write_json, write_text
from posttrain.tasks import get_task

log = logging.getLogger("sft")


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


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Train. ``inputs``: demos (sft.parquet). ``out``: base_model, model, checkpoints, report_dir, metrics."""
    cfg = params.sft
    device = modeling.resolve_device(params.runtime.device)
    demos = read_problems(inputs["demos"])
    if not demos:
        raise ValueError(f"{inputs['demos']}: no demonstrations")
    model, tok = modeling.init_base(params.model, params.seed)
    with atomic_path(out["base_model"]) as tmp:
        modeling.save_checkpoint(model, tok, tmp)
    model.to(device).train()

    # Pre-encode both renderings of each demo: full solution (cot) and bare answer (direct).
    enc = {style: [training.encode_sft(tok, d["prompt"],
                                       get_task(d["task"]).render(d["prompt"], d["answer"], d["solution"], style))
                   for d in demos]
           for style in ("cot", "direct")}

    total = cfg.total_steps
    opt, sched = training.make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.warmup_steps, total)
    fp = training.fingerprint(cfg, params.model, params.seed, training.file_digest(inputs["demos"]))
    start, log_rows = 0, []
    state = training.load_resumable(out["checkpoints"], fp)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        training.set_rng_state(state["rng"])
        start, log_rows = state["step"], state["log"]
        log.info("resuming from %s step %d", out["checkpoints"], start)

    phase_of = [(i, p) for i, p in enumerate(cfg.phases) for _ in range(p.steps)]  # step -> (phase, spec)
    n_micro = cfg.batch_size // cfg.micro_batch_size
    t0, tokens_seen, loss = time.time(), 0, float("nan")
    bar = tqdm(range(start, total), initial=start, total=total, desc="sft", disable=not params.runtime.progress)
    for step in bar:
        phase, spec = phase_of[step]
        idx, use_cot = step_batch(params.seed, step, len(demos), cfg.batch_size, spec.cot_frac)
        examples = [enc["cot" if c else "direct"][i] for i, c in zip(idx, use_cot, strict=True)]
        n_tok = sum(sum(1 for y in ex[1] if y != training.IGNORE) - 1 for ex in examples)  # shifted count
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in range(n_micro):
            mb = training.collate(examples[m * cfg.micro_batch_size : (m + 1) * cfg.micro_batch_size],
                                  tok.pad_token_id)
            s, _ = training.sum_token_nll(model, {k: v.to(device) for k, v in mb.items()})
            (s / max(n_tok, 1)).backward()
            loss_sum += s.item()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        opt.step()
        sched.step()
        loss = loss_sum / max(n_tok, 1)
        tokens_seen += n_tok
        done = step + 1
        if done % cfg.log_every == 0 or done == total:
            log_rows.append({"step": done, "phase": phase, "loss": round(loss, 6), "lr": sched.get_last_lr()[0],
                             "grad_norm": round(grad_norm, 4), "cot_frac": spec.cot_frac})
            bar.set_postfix(loss=f"{loss:.4f}", phase=phase)
        if done % cfg.checkpoint_every == 0 and done < total:
            training.save_resumable(out["checkpoints"], done, {
                "fingerprint": fp, "step": done, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": training.rng_state(), "log": log_rows})
    elapsed = time.time() - t0

    model.eval()
    with atomic_path(out["model"]) as tmp:
        modeling.save_checkpoint(model, tok, tmp)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["step", "phase", "loss", "lr", "grad_norm", "cot_frac"])
    w.writeheader()
    w.writerows(log_rows)
    write_text(out["report_dir"] / "train_log.csv", buf.getvalue())
    plots.training_curves(log_rows, "step", ["loss", "lr", "grad_norm"], "sft", out["report_dir"] / "curves.png")
    metrics = {
        "final_loss": log_rows[-1]["loss"] if log_rows else loss,
        "steps": total, "resumed_from_step": start, "params": modeling.num_params(model),
        "demos": len(demos), "seconds": round(elapsed, 1),
        "seconds_per_step": round(elapsed / max(total - start, 1), 4),
        "tokens_per_s": round(tokens_seen / elapsed, 1) if elapsed > 0 else math.nan,
    }
    write_json(out["metrics"], metrics)
    shutil.rmtree(out["checkpoints"], ignore_errors=True)  # finished: the checkpoint is the output now
    log.info("final loss %.4f after %d steps (%.1fs)", metrics["final_loss"], total, elapsed)
    return metrics


def paths(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    """This stage's inputs and outputs, from ``params.paths`` (used by ``main`` and by tests)."""
    P = p.paths
    return {"demos": Path(P.curated_dir) / "sft.parquet"}, {
        "base_model": Path(P.base_model), "model": Path(P.sft_model), "checkpoints": Path(P.sft_checkpoints),
        "report_dir": Path(P.sft_report_dir), "metrics": Path(P.metrics_dir) / "sft.json"}


def main() -> None:
    stage_main("sft", lambda p: run(p, *paths(p)))


if __name__ == "__main__":
    main()
