"""sft: cold-start supervised fine-tuning on the curated demonstrations.

Inputs: ``paths.curated_dir/sft.parquet``; the starting model ``paths.base_model`` (the model stage's import of
``model.base``: its tokenizer carries the prompt format).
Outputs: ``paths.sft_model`` (HF checkpoint), ``paths.sft_report_dir/train_log.csv`` (for dvc plots),
``paths.sft_report_dir/ledger.parquet`` (the demo ids each step trained on, in order: the sample ledger,
``posttrain.lineage.ledger``), ``metrics/sft.json``.

Data: demos tokenized once (rank 0, cached in the checkpoint folder, ``posttrain.sft_data``); ``sft.max_seq_len``
with ``sft.overlong`` (drop | truncate) bounds every sequence, counted in the metrics; ``sft.batching`` lays out
micro-batches (padded, grouped by length, or packed).
Training: chat template, loss on completion tokens only (token-mean over the full batch, exact under
gradient accumulation), AdamW with linear warmup + cosine decay over all phases. Phases implement the
mixed-format cold start (``sft.phases[*].cot_frac``: the share of demos shown with their full solution,
``tool_frac``: the share shown calling a tool (observation masked out of the loss, docs/tools.md), the rest
with the bare answer). Batches are a pure function of (seed, step), so the data position is
restored by the step alone. Every ``checkpoint_every`` steps a resumable checkpoint goes to
``paths.sft_checkpoints`` (not a DVC out, so DVC does not delete it before a re-run): re-running after a
crash resumes there and ends with the same weights as an uninterrupted run.

Several processes (``runtime.distributed``): the same command relaunches under torchrun; each rank trains on
its share of every global batch (``posttrain.distributed``) and rank 0 writes the outputs.

Run: ``dvc repro sft`` or ``python -m stages.sft [--params params.yaml]``.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

from posttrain import checkpoint, distributed, modeling, plots, training
from posttrain.config import Params
from posttrain.demos import read_demos
from posttrain.lineage.ledger import SFT_LEDGER, write_sft
from posttrain.outputs import as_one_set, atomic_path
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main
from posttrain.trainlog import TrainLog
from stages.layout import NEEDS
from stages.layout import sft as paths

log = logging.getLogger("sft")


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Train. ``inputs``: demos (sft.parquet), base (the imported base folder). ``out``: model, checkpoints,
    report_dir, metrics."""
    with as_one_set(out, "sft"):  # a kill leaves the old outputs or the new ones, never a mix
        return _run(params, inputs, out)


def _run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    d = distributed.current()
    device = modeling.resolve_device(params.runtime.device)
    demos = read_demos(inputs["demos"])  # Arrow on every rank, never a dict per demo
    model, tok = modeling.load_base(str(inputs["base"]), params.model, meta=d.loads_on_meta)  # FSDP2: rank 0 reads
    model = modeling.make_trainable(model, params.model.lora, params.model.gradient_checkpointing)
    model = d.wrap((model if d.loads_on_meta else model.to(device)).train(), params.model.dtype)  # meta: wrap fills it

    tools = [params.tools] if params.sft.tool_demos else []  # how tool demos are written (none: key as before)
    fp = checkpoint.fingerprint(params.sft, params.model, params.seed, checkpoint.file_digest(inputs["demos"]), *tools)
    with modeling.autocast(params.model.dtype, device):  # fp32 masters; bf16 compute when model.dtype says so
        train_log = TrainLog(out["report_dir"] / "train_log.csv" if d.main else None, training.SFT_LOG_FIELDS)
        res = training.sft_train(model, tok, demos, params.sft, params.seed, out["checkpoints"], fp,
                                 progress=params.runtime.progress, log_to=train_log, tools=params.tools)
    log_rows, start, elapsed = res["log"], res["start"], res["seconds"]
    total = params.sft.total_steps

    model.eval()
    final = d.plain(model)
    metrics = {
        "final_loss": log_rows[-1]["loss"],
        "steps": total, "resumed_from_step": start, "params": modeling.num_params(final),
        "demos": demos.num_rows, "seconds": round(elapsed, 1),
        "seconds_per_step": round(elapsed / max(total - start, 1), 4),
        "tokens_per_s": round(res["tokens"] / elapsed, 1) if elapsed > 0 else math.nan, "world_size": d.world,
        **res["data"],  # sft.max_seq_len: demos dropped / truncated (and tokens cut); padding_frac of the input
    }
    if not d.main:
        return metrics
    with atomic_path(out["model"]) as tmp:
        modeling.save_checkpoint(final, tok, tmp, params.model.dtype)
    train_log.close()
    write_sft(res["ledger"], out["report_dir"] / SFT_LEDGER)  # the demos each step trained on (lineage --samples)
    plots.training_curves(log_rows, "step", ["loss", "lr", "grad_norm"], "sft", out["report_dir"] / "curves.png")
    write_metrics(out["metrics"], metrics)
    shutil.rmtree(out["checkpoints"], ignore_errors=True)  # finished: the checkpoint is the output now
    log.info("final loss %.4f after %d steps (%.1fs)", metrics["final_loss"], total, elapsed)
    return metrics


def main() -> None:
    stage_main("sft", lambda p: run(p, *paths(p)), distributed=True, needs=lambda p: NEEDS["sft"](p, None))


if __name__ == "__main__":
    main()
