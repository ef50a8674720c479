"""``Dist``: what a training loop asks of torch.distributed (its rank's share, global sums, the wrapped model and
the copies it generates and scores with); the package docstring (``posttrain.distributed``) says how the loops
use it. One process when not launched by torchrun (``Dist()``): every method is then the identity or a no-op."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

from posttrain.distributed import placement
from posttrain.distributed.placement import Forward

T = TypeVar("T")


@dataclass
class Dist:
    """This process's place in the job. ``world == 1``: every method is the single-process identity."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    strategy: str = "ddp"
    comm_device: str = "cpu"  # where reduced tensors live: NCCL reduces only CUDA tensors (cuda:<local rank>)
    mesh: Any = None  # FSDP2's device mesh (None: torch's default, every rank); made once by the memory plan
    _copies: dict[int, torch.nn.Module] = field(default_factory=dict, repr=False)  # FSDP2: full-weight copies
    gathered_bytes: int = 0  # received by ``gather_tensor`` (all-gathers of numeric data), over the job
    sent_bytes: int = 0  # sent to rank 0 by ``stream_to_main``

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def loads_on_meta(self) -> bool:
        """FSDP2 ranks but rank 0 build the policy (a pretrained student) on the meta device (no weights read):
        ``wrap`` shards it and broadcasts rank 0's weights into the shards."""
        return self.active and self.strategy == "fsdp2" and not self.main

    # ---------------------------------------------------------------- splitting work
    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's items: a contiguous block, the blocks in rank order (sizes differ by at most one)."""
        n = len(items)
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        return list(items[lo:hi])

    def gather_shards(self, local: list[T]) -> list[T]:
        """Concatenate every rank's ``shard`` results in rank order (the inverse of ``shard``), on every rank.
        Pickled Python objects: for small ones (RNG states, the rows of the sft/distill stages); numeric data
        goes through ``gather_tensor``."""
        if not self.active:
            return list(local)
        parts: list[Any] = [None] * self.world
        tdist.all_gather_object(parts, local)
        return [x for p in parts for x in p]

    def gather_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` ([n_rank, ...], n_rank may differ, same trailing shape and dtype) concatenated
        in rank order along dim 0, on every rank: ``all_gather`` of the sizes, then of the rows padded to the
        largest (no pickling). The bytes this rank receives are counted in ``gathered_bytes``."""
        if not self.active:
            return local.clone()
        n = torch.tensor([local.shape[0]], dtype=torch.int64, device=self.comm_device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        tdist.all_gather(sizes, n)
        counts = [int(x) for x in sizes]
        pad = local.new_zeros((max(counts), *local.shape[1:]), device=self.comm_device)
        pad[: local.shape[0]] = local
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        tdist.all_gather(parts, pad)
        self.gathered_bytes += sum(x.numel() * x.element_size() for x in (*sizes, *parts))
        return torch.cat([x[:c] for x, c in zip(parts, counts, strict=True)]).to(local.device)

    def stream_to_main(self, payload: bytes) -> Iterator[bytes]:
        """Rank 0 gets every rank's ``payload`` (its own first), one at a time in rank order, through
        point-to-point sends of a byte tensor: only rank 0 receives, and it holds one rank's payload at a time
        (the rl stage's per-step shard, written as it arrives). Other ranks get an empty iterator; every rank
        must iterate it to the end. Bytes sent count in ``sent_bytes``."""
        if not self.active:
            yield payload
            return
        if not self.main:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0,
                                                                                                  dtype=torch.uint8)
            tdist.send(torch.tensor([data.numel()], dtype=torch.int64, device=self.comm_device), 0)
            if data.numel():
                tdist.send(data.to(self.comm_device), 0)
            self.sent_bytes += data.numel() + 8
            return
        yield payload
        for r in range(1, self.world):
            n = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
            tdist.recv(n, r)
            data = torch.empty(int(n), dtype=torch.uint8, device=self.comm_device)
            if data.numel():
                tdist.recv(data, r)
            yield data.cpu().numpy().tobytes()

    def micro_count(self, n_local: int) -> int:
        """The number of micro-batches every rank runs: the largest rank's (at least one)."""
        return max(1, int(self.max(float(n_local))))

    # ---------------------------------------------------------------- reductions of python numbers
    def sum(self, *xs: float) -> list[float]:
        if not self.active:
            return [float(x) for x in xs]
        t = torch.tensor(xs, dtype=torch.float64, device=self.comm_device)
        tdist.all_reduce(t)
        return t.tolist()

    def max(self, x: float) -> float:
        if not self.active:
            return float(x)
        t = torch.tensor([x], dtype=torch.float64, device=self.comm_device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t.item())

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    # ---------------------------------------------------------------- the model
    @property
    def loss_scale(self) -> float:
        """DDP and FSDP2 average gradients over ranks; scaling each rank's loss by the world size makes the
        result the sum, i.e. the one-process gradient of the whole batch."""
        return float(self.world)

    def wrap(self, model: torch.nn.Module, dtype: str = "float32") -> torch.nn.Module:
        """The training handle of ``model`` under this job's strategy (the model itself when alone): call it
        through ``forward``, build the optimizer on its parameters after this. ``dtype`` (``model.dtype``):
        FSDP2 all-gathers parameters in it (gradients reduced in fp32), and ``plain``'s copy is kept in it."""
        if not self.active:
            return model
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            dev = next(model.parameters()).device
            return DistributedDataParallel(Forward(model), device_ids=[dev.index] if dev.type == "cuda" else None)
        from_rank0 = bool(self.max(float(any(p.is_meta for p in model.parameters()))))  # Dist.loads_on_meta
        wrapped, copy_ = placement.fsdp2(model, self.main, torch.device(self.comm_device), from_rank0,
                                         self.mesh, dtype)
        self._copies[id(wrapped)] = copy_
        return wrapped

    def load_on_rank0(self, load: Callable[[], torch.nn.Module], empty: Callable[[], torch.nn.Module],
                      device: torch.device) -> torch.nn.Module:
        """A frozen model (the KL reference, the teacher) that rank 0 alone reads: ``load()`` there; every other
        rank builds ``empty()`` (the same model on the meta device, in the same dtype), allocates it on
        ``device`` and receives rank 0's parameters and buffers one tensor at a time (no second full copy on any
        rank). Any world size > 1 and either strategy: DDP ranks need full copies too, and N ranks deserialising
        the same folder at once hold N full host copies and read the disk N times. Alone: ``load()``."""
        if not self.active:
            return load()
        if self.main:
            model = load()
        else:
            model = empty()
            placement.to_empty_tied(model, device)
        placement.broadcast_module(model, self.comm_device)
        return model

    def load_frozen(self, load: Callable[[], torch.nn.Module], empty: Callable[[], torch.nn.Module],
                    device: torch.device, dtype: str = "float32") -> torch.nn.Module:
        """A frozen model that is only scored (rl's KL reference), read by rank 0 alone. Under FSDP2 it is sharded
        as the policy is (``fully_shard`` per layer, ``dtype`` as ``wrap``'s, no copy, no optimizer): each rank
        holds 1/world of it (a 7B bf16 reference: 14.2 GiB a rank as a full copy, 1.8 GiB at 8 ranks) and
        all-gathers a layer at a time while scoring. Score it through ``forward`` (``logprobs.fill``, which runs
        the ranks' forwards in lockstep). DDP and alone: ``load_on_rank0``'s full model."""
        if not (self.active and self.strategy == "fsdp2"):
            return self.load_on_rank0(load, empty, device)
        model = load() if self.main else empty()  # ranks > 0: on the meta device, no weights read
        for p in model.parameters():
            p.requires_grad_(False)
        wrapped, _ = placement.fsdp2(model, self.main, torch.device(self.comm_device), True, self.mesh, dtype,
                                     with_copy=False)
        return wrapped

    def scoring(self, wrapped: torch.nn.Module) -> torch.nn.Module:
        """The handle that scores the training model without gradients (old log-probs): under FSDP2 the sharded
        model itself (forwards are collectives: ``logprobs.fill`` runs them in lockstep; no full copy needed),
        else ``plain``'s model."""
        if self.active and self.strategy == "fsdp2":
            return wrapped
        return self.plain(wrapped)

    def plain(self, wrapped: torch.nn.Module) -> torch.nn.Module:
        """The model with the current full weights, run without collectives (generation, scoring, saving).
        DDP: the wrapped model itself. FSDP2: this rank's full copy in ``model.dtype`` (allocated at the first
        call), refreshed from the shards here parameter by parameter (an all-gather each, into the copy; a
        collective: every rank calls it at the same point)."""
        if not self.active:
            return wrapped
        if self.strategy == "ddp":
            return wrapped.module.model
        return placement.refresh(self._copies[id(wrapped)], wrapped, self.comm_device)

    def for_generation(self, wrapped: torch.nn.Module, backend: Any) -> Any:
        """What ``backend.load_weights`` gets this step: ``plain``'s model for a backend that samples with it
        (hf); for one that copies weights into its own engine (vLLM: ``samples_with_module`` False) under FSDP2,
        the stream of ``placement.full_weights`` (one all-gathered parameter at a time, in ``model.dtype``; a
        collective the backend consumes on every rank), so no full copy is ever allocated (a LoRA policy under
        FSDP2 still goes through the copy: its merge needs the adapters' full weights beside the base's)."""
        if getattr(backend, "samples_with_module", True) or not (self.active and self.strategy == "fsdp2"):
            return self.plain(wrapped)
        if any(".lora_" in name for name, _ in wrapped.named_parameters()):
            return self.plain(wrapped)
        return placement.full_weights(wrapped, self._copies[id(wrapped)])

    @contextlib.contextmanager
    def grad_sync(self, model: torch.nn.Module, sync: bool) -> Iterator[None]:
        """Inside: under DDP, backward all-reduces gradients only if ``sync`` (the last micro-batch of a step).
        FSDP2 reduce-scatters every micro-batch into the sharded ``.grad`` (``sync`` ignored): skipping it would
        leave each rank the whole unsharded gradient between micro-batches (``set_requires_gradient_sync(False)``
        keeps it on the unsharded parameter: +P x 4 bytes per rank, 28.4 GiB at 7B; tests/dist_grads.py measures
        it), the memory FSDP2 exists to save; the price is one reduce-scatter per micro-batch."""
        if not self.active or sync or self.strategy != "ddp":
            yield
        else:
            with model.no_sync():
                yield

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the global gradient norm (over every rank's shards under FSDP2); returns it."""
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
