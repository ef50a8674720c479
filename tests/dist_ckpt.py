"""Four AdamW steps of a tiny model, checkpointed after step 2, as one process or under torchrun (ddp or fsdp2):
the distributed checkpoint tests launch it to save at one world size and resume at another.

    python [-m torch.distributed.run --nproc_per_node N] tests/dist_ckpt.py MODE STRATEGY CKPT OUT

MODE ``straight``: four steps, no checkpoint. ``save``: two steps, a checkpoint, stop (a kill after the save).
``resume``: restore the checkpoint, then steps 3 and 4. OUT gets the final full weights (rank 0) and, for
``save``, whether a full tensor was ever gathered while saving (it must not be, under FSDP2), and the moving
KL reference's weights (reset to the policy at the checkpoint's step, saved with it, restored on resume).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from posttrain import checkpoint, distributed, modeling, training
from posttrain.config import TinyModel
from posttrain.rl import update

STEPS, AT, BATCH = 4, 2, 6


def loss_of(model: torch.nn.Module, step: int):
    def f(chunk: list[int], real: bool) -> torch.Tensor:
        ids = torch.tensor([[(step * 31 + i * 7 + j) % 90 + 4 for j in range(10)] for i in chunk])
        out = distributed.forward(model, lambda m, x: m(input_ids=x, labels=x).loss, ids)
        return out * len(chunk) / BATCH  # the chunk's share of the batch mean
    return f


def main(mode: str, strategy: str, ckpt: str, out: str) -> None:
    d = distributed.init("gloo", strategy, 60) if distributed.launched() else distributed.current()
    torch.manual_seed(0)
    tok = modeling.build_char_tokenizer()
    model = modeling.build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64),
                                      tok, 0)
    model = d.wrap(model.train())
    opt = training.adamw(model, 1e-2, 0.01, training.SFT_BETAS)
    # a moving KL reference (rl.ref_reset), built as the rl stage builds it: sharded under FSDP2
    built = lambda: modeling.build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=2,  # noqa: E731
                                                        intermediate_size=64), tok, 1)
    ref = d.load_frozen(built, built, torch.device("cpu"))
    start, gathered = 0, []
    if mode == "resume":
        start = checkpoint.restore(Path(ckpt), "fp", model, opt, ref)["step"]
    for step in range(start, AT if mode == "save" else STEPS):
        training.accumulate(model, opt, list(range(BATCH)), 2, loss_of(model, step), 1.0)
    if mode == "save":
        full_tensor = DTensor.full_tensor
        DTensor.full_tensor = lambda self, *a, **k: gathered.append(1) or full_tensor(self, *a, **k)
        update.reset_reference(ref, d.scoring(model))  # the reference becomes the policy at step AT
        checkpoint.save(Path(ckpt), AT, "fp", model, opt, {"log": []}, ref)
        DTensor.full_tensor = full_tensor
    weights = {k: v.clone() for k, v in d.plain(model).state_dict().items()}
    ref_weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                   for k, v in checkpoint.ref_state(ref).items()}
    if d.main:
        torch.save({"weights": weights, "gathered": len(gathered), "ref": ref_weights}, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
