"""Gradient memory of FSDP2 under gradient accumulation, at world size N (gloo). ``tests/test_distributed.py``
launches it on a tiny model; on SmolLM2-135M (``benchmarks/results/fsdp_grads_smollm2.json``) it ran by hand.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_grads.py FOLDER OUT

Every rank runs one ``training.accumulate`` step of 3 micro-batches through ``Dist.wrap`` (FSDP2) and records,
after the first micro-batch's backward (inside the second micro-batch's loss, before its forward), the bytes of
gradient it holds: the sharded ``.grad`` of each parameter (its local shard) and any unsharded gradient FSDP2
keeps on an unsharded parameter (its ``.grad``, or ``FSDPParam.unsharded_accumulated_grad`` under a reduce
dtype: what a micro-batch run with ``set_requires_gradient_sync(False)`` leaves). It saves them, the parameter
bytes (local shards and the whole model) and the full-weight copy's bytes (``Dist.plain``'s) to ``OUT.<rank>``;
before that copy is made, the weights as ``Dist.for_generation`` streams them to a weight-copying backend (vLLM),
compared with the copy afterwards.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from posttrain import distributed, modeling, training
from posttrain.distributed import placement


def _bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.numel() * t.element_size()


def grad_bytes(wrapped: torch.nn.Module) -> dict[str, int]:
    """Bytes of gradient this rank holds now: sharded ``.grad`` and FSDP2's unsharded accumulated gradients."""
    sharded = sum(_bytes(p.grad) for p in wrapped.parameters())
    unsharded = 0
    for m in wrapped.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        for group in (getattr(state, "_fsdp_param_groups", None) or []):
            for fp in group.fsdp_params:  # left on the unsharded parameter, or upcast into the accumulator
                param = getattr(fp, "_unsharded_param", None)
                unsharded += _bytes(getattr(fp, "unsharded_accumulated_grad", None))
                unsharded += _bytes(param.grad if param is not None else None)
    return {"sharded_grad": sharded, "unsharded_grad": unsharded}


class Engine:
    """Stands in for the vLLM backend's one trait ``Dist.for_generation`` reads: it copies weights in."""

    samples_with_module = False


def main(folder: str, out: str, dtype: str = "float32") -> None:
    d = distributed.init("gloo", "fsdp2", 120)
    torch.manual_seed(0)
    model = modeling.load_model(folder, "float32", torch.device("cpu"), trainable=True)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapped = d.wrap(model, dtype)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    seqs = [torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(i)) for i in range(6 * d.world)]
    seen: list[dict[str, int]] = []
    gathered: list[str] = []  # the dtype a layer's weight is all-gathered in, seen inside the forward

    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, _: gathered.append(str(m.up_proj.weight.dtype)))

    def loss(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(input_ids=x).logits.float().pow(2).mean()

    def loss_of_batch(chunk: list[torch.Tensor], real: bool) -> torch.Tensor:
        seen.append(grad_bytes(wrapped))  # before this micro-batch's forward: what the earlier ones left
        ids = torch.stack(chunk)
        return placement.forward(wrapped, loss, ids) / 3

    training.accumulate(wrapped, opt, seqs, 2, loss_of_batch, 1e9)
    copy_ = d._copies.get(id(wrapped))
    gathers = []  # each all-gather the stream makes (DTensor.full_tensor), by the shard's shape
    real_full = DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kw: gathers.append(list(self.shape)) or real_full(self, **kw)
    streamed = list(d.for_generation(wrapped, Engine()))  # what vLLM's load_weights pulls: one gather a tensor
    DTensor.full_tensor = real_full
    allocated = sum(p.numel() * p.element_size() for p in copy_.parameters() if not p.is_meta) if copy_ else 0
    plain = d.plain(wrapped)
    full = plain.state_dict()
    ptrs = [t.data_ptr() for t in full.values()]  # a tied weight's second name shares its first's storage
    res = {"gathered_dtype": sorted(set(gathered)), "copy_bytes_before_plain": allocated,
           "copy_dtype": sorted({str(p.dtype) for p in plain.parameters()}), "world": d.world,
           "whole_param_bytes": whole,
           "local_param_bytes": sum(_bytes(p) for p in wrapped.parameters()),
           "after_first_backward": seen[1], "after_second_backward": seen[2],
           "full_copy_bytes": sum(p.numel() * p.element_size() for p in plain.parameters()),
           "stream_names_are_the_copys": sorted(n for n, _ in streamed) == sorted(full),
           "stream_gathers": len(gathers), "distinct_params": len(list(wrapped.parameters())),
           "tied": [n for i, n in enumerate(full) if ptrs[i] in ptrs[:i]],
           "stream_equals_the_copy": all(torch.equal(t, full[n]) for n, t in streamed),
           "stream_dtype": sorted({str(t.dtype) for n, t in streamed if t.is_floating_point()})}
    with open(f"{out}.{d.rank}", "w") as f:
        json.dump(res, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
