"""Where a model's weights live across ranks: the training handle (``Forward``, FSDP2 shards), the full-weight copy
refreshed from the shards (in ``model.dtype``, allocated when first asked for), and meta-built models
materialised with rank 0's weights.

Rank 0 alone reads a model from disk when the others build it on the meta device (``Dist.loads_on_meta`` for the
policy and, sharded, the KL reference: ``Dist.load_frozen``; ``Dist.load_on_rank0`` for the teacher): they
allocate it empty here
(:func:`to_empty_tied`) and receive rank 0's tensors. A sharded model gets them through torch's
``set_model_state_dict(broadcast_from_rank0=True)``; a whole frozen model through :func:`broadcast_module`,
one tensor at a time (torch has no whole-module broadcast that spares a second full state dict: DDP's
``_sync_module_states`` is private and coalesces buffers; ``broadcast_from_rank0`` wants a full state dict on
rank 0 and only fills DTensors or same-device tensors).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as tdist

PREFIX = "model."  # Forward's parameter names: checkpoints store the model's own names


class Forward(torch.nn.Module):
    """``Forward(model)(fn, *args)`` = ``fn(model, *args)``: the module DDP and FSDP2 wrap, so that any training
    forward (``logprobs.token_logp_entropy``, ``logprobs.hidden_at_targets``) runs their forward hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self.model, *args, **kwargs)


def forward(wrapped: torch.nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(model, *args)`` through ``wrapped`` (the result of ``Dist.wrap``: the model itself when alone)."""
    if isinstance(wrapped, Forward) or isinstance(getattr(wrapped, "module", None), Forward):  # FSDP2 / DDP
        return wrapped(fn, *args, **kwargs)
    return fn(wrapped, *args, **kwargs)


def sharded(model: torch.nn.Module) -> bool:
    """True for an FSDP2 handle (``fsdp2``'s): every forward through it all-gathers, a collective."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fsdp2(model: torch.nn.Module, main: bool, device: torch.device, from_rank0: bool, mesh: Any = None,
          dtype: str = "float32", with_copy: bool = True) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """``model`` sharded (``fully_shard`` per decoder layer and at the root of its ``Forward``) and a skeleton of
    its full-weight copy (on the meta device: no memory until ``refresh`` first fills it). ``from_rank0`` (some
    rank built the model on the meta device): every rank's shards and buffers get rank 0's values, the meta
    ranks' model allocated on ``device``. ``mesh``: the ranks to shard over (None: all of them, torch's default
    mesh). ``dtype`` (``model.dtype``) below float32: FSDP2's ``MixedPrecisionPolicy`` all-gathers parameters in
    it and reduces gradients in fp32 (the masters stay fp32), and the copy is kept in it. ``with_copy=False``: no
    copy (a frozen model that is only ever scored through the handle: ``Dist.load_frozen``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = getattr(torch, dtype)
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low != torch.float32 else None
    kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    on_meta = any(p.is_meta for p in model.parameters())
    copy_ = skeleton(model, low) if with_copy else None
    full = model.state_dict() if main and from_rank0 else {}  # rank 0's weights, for the meta ranks
    for layer in _decoder_layers(model):
        fully_shard(layer, **kw)
    # a frozen model (no copy) never runs backward, where the root would be resharded: reshard it after forward,
    # or its root group (embeddings, the LM head, the final norm) stays gathered after the first scoring
    wrapped = fully_shard(Forward(model), **kw, **({} if with_copy else {"reshard_after_forward": True}))
    if from_rank0:
        if on_meta:
            wrapped.to_empty(device=device)
        set_model_state_dict(wrapped, {PREFIX + k: v for k, v in full.items()},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for _, b in wrapped.named_buffers():  # non-persistent buffers (rotary tables): in no state dict, small
            tdist.broadcast(b, 0)
    del full
    return wrapped, copy_


def skeleton(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model``'s modules whose parameters and buffers are on the meta device (floating parameters in
    ``dtype``), tied ones tied: no bytes until :func:`refresh` allocates it (``copy.deepcopy`` would hold a whole
    second model from the start, through training steps that never generate: every SFT step)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point()
                                                              else p.dtype), requires_grad=False)
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return copy.deepcopy(model, memo)


def refresh(full: torch.nn.Module, wrapped: torch.nn.Module, device: torch.device | str = "cpu") -> torch.nn.Module:
    """``full`` (the skeleton ``fsdp2`` made; allocated on ``device`` the first time) with the current weights of
    ``wrapped``, all-gathered parameter by parameter into it and cast to its dtype (a collective: every rank
    calls it at the same point), and its buffers."""
    if any(p.is_meta for p in full.parameters()):
        to_empty_tied(full, device)
    into = dict(full.named_parameters())
    with torch.no_grad():  # one parameter at a time: never a whole full state dict beside the copy
        for name, p in wrapped.named_parameters():
            into[name.removeprefix(PREFIX)].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
        bufs = dict(full.named_buffers())
        for name, b in wrapped.named_buffers():  # FSDP2 leaves buffers whole on every rank
            bufs[name.removeprefix(PREFIX)].copy_(b)
    return full


def full_weights(wrapped: torch.nn.Module, like: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The current full weights of the FSDP2 module ``wrapped`` as checkpoint-named tensors (its state dict's
    names and order, except that a tied weight's later names follow its first at once: the one gathered tensor
    under each), each in the dtype of its namesake in ``like`` (``fsdp2``'s skeleton: ``model.dtype``, what the
    engine holds). A parameter is all-gathered (``full_tensor``) only when the consumer asks for it, once however
    many names it has (tied embeddings and LM head: 28M parameters at SmolLM2-135M's 49k vocabulary, 311M at
    Qwen2.5-3B's 152k; the names share one tensor, which the consumer copies and must not change in place), and
    is the consumer's to drop: the full model never exists on a rank (:func:`refresh` fills a whole copy). A
    collective: every rank consumes the whole stream, in the same order."""
    dtypes = {k: t.dtype for k, t in like.state_dict(keep_vars=True).items()}  # the skeleton: no bytes read
    state = wrapped.state_dict(keep_vars=True)  # FSDP2: local shards as DTensors, nothing gathered; tied: one object
    names: dict[int, list[str]] = {}
    for name, t in state.items():
        names.setdefault(id(t), []).append(name.removeprefix(PREFIX))
    for t in state.values():
        if (keys := names.pop(id(t), None)) is None:
            continue  # a tied weight's later name: streamed with its first
        t = t.detach().to(dtypes.get(keys[0], t.dtype))  # the shard cast first: a bf16 engine gathers half the bytes
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        for key in keys:
            yield key, full
        del full, t


def broadcast_module(module: torch.nn.Module, comm_device: str) -> None:
    """Every rank's ``module`` (the same architecture and dtypes) gets rank 0's parameters and buffers
    (non-persistent ones too), broadcast one tensor at a time in ``named_parameters``/``named_buffers`` order
    (tied parameters once). A tensor off ``comm_device`` (NCCL reduces only CUDA tensors) goes through a
    staging copy of that one tensor. Rank 0's names, shapes and dtypes are checked first: a mismatch is a bug."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    spec = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
    theirs = [spec]
    tdist.broadcast_object_list(theirs, 0, device=torch.device(comm_device))
    if theirs[0] != spec:
        diff = next((a, b) for a, b in zip([*theirs[0], None], [*spec, None], strict=False) if a != b)
        raise RuntimeError(f"broadcast_module: rank 0 has {diff[0]}, this rank {diff[1]}")
    with torch.no_grad():
        for _, t in tensors:
            staged = t if t.device == torch.device(comm_device) else t.to(comm_device)
            tdist.broadcast(staged, 0)
            if staged is not t:
                t.copy_(staged)


def to_empty_tied(module: torch.nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=...)`` keeping shared parameters and buffers shared: each distinct tensor is
    replaced by one uninitialised tensor on ``device`` (a Parameter by a Parameter with its ``requires_grad``),
    set on every module that holds it. (``to_empty`` makes one new parameter per owner, so a tied LM head came
    apart from its embedding, and it swaps tensors in place, which fake tensors refuse: the memory plan.)"""
    new: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for slot in (m._parameters, m._buffers):
            for name, t in slot.items():
                if t is None:
                    continue
                if id(t) not in new:
                    e = torch.empty_like(t, device=device)
                    new[id(t)] = torch.nn.Parameter(e, t.requires_grad) if isinstance(t, torch.nn.Parameter) else e
                slot[name] = new[id(t)]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one (HF decoders: ``model.layers``; else every direct child)."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return list(layers)
    return list(model.children())
