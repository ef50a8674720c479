"""Loading at world size 2 (gloo, FSDP2): the frozen model (distill's teacher; rl's KL reference under DDP)
through ``Dist.load_on_rank0`` as those stages call it, and a pretrained distill student through
``stages.distill._student`` + ``Dist.wrap``. ``tests/test_distributed.py`` launches it and compares the ranks.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_frozen.py FOLDER DTYPE OUT

Every rank counts the weight files transformers opens (``safe_open``) while each model loads, and saves the
counts with its models' parameters and buffers (by name) to ``OUT.<rank>``.
"""

from __future__ import annotations

import sys

import torch
import transformers.modeling_utils
from conftest import tiny_raw

from posttrain import distributed, modeling
from posttrain.config import parse_params
from stages import distill

OPENED: list[str] = []
_safe_open = transformers.modeling_utils.safe_open
transformers.modeling_utils.safe_open = lambda path, *a, **k: OPENED.append(str(path)) or _safe_open(path, *a, **k)


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in (*model.named_parameters(), *model.named_buffers())}


def main(folder: str, dtype: str, out: str) -> None:
    d = distributed.init("gloo", "fsdp2", 60)
    device = torch.device("cpu")
    frozen = d.load_on_rank0(lambda: modeling.load_model(folder, dtype, device),  # as stages/distill.py
                             lambda: modeling.empty_model(folder, dtype=dtype), device)
    opened_frozen, OPENED[:] = list(OPENED), []
    raw = tiny_raw(None)
    raw["model"]["dtype"], raw["distill"]["student"] = dtype, folder
    params = parse_params(raw)
    student = distill._student(params, modeling.load_tokenizer(folder), frozen, device, d.loads_on_meta)
    opened_student = list(OPENED)
    student = d.plain(d.wrap(student))
    tied = frozen.get_output_embeddings().weight is frozen.get_input_embeddings().weight
    torch.save({"opened_frozen": opened_frozen, "opened_student": opened_student, "frozen": tensors(frozen),
                "student": tensors(student), "tied": tied, "dtype": str(frozen.dtype),
                "eos": frozen.generation_config.eos_token_id}, f"{out}.{d.rank}")
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
