"""Data-parallel and sharded training on torch.distributed: the one place that knows about ranks.

The training stages (sft, rl, distill) run unchanged as one process or under ``torchrun`` (``runner.stage_main``
relaunches itself under torchrun when ``runtime.distributed`` asks for more than one process). The strategies are
torch's own: ``ddp`` (``DistributedDataParallel``: every rank holds the model, gradients are all-reduced) and
``fsdp2`` (``fully_shard`` per decoder layer and at the root: parameters, gradients and optimizer state sharded,
parameters all-gathered per layer for forward and backward). Plain torch.distributed rather than ``accelerate``:
our loops are hand-written for exact gradient accumulation and group statistics, so what accelerate adds (its
dataloader sharding, mixed precision, config files) we would bypass, and what we need (``no_sync``,
``set_requires_gradient_sync``, sharded state dicts through ``torch.distributed.checkpoint``) is torch's.

What every loop does with a ``Dist`` (``current()``; a single-process one when not launched by torchrun):

- **Work is split, sums are global.** Each rank takes its share of a step's examples or groups (``shard``) but
  normalises its loss by the *global* token/sequence counts, and multiplies it by the world size because DDP and
  FSDP2 average gradients over ranks: the all-reduced gradient is then exactly the one-process gradient of the
  whole batch (up to fp32 reduction order; in bf16 under FSDP2 its MixedPrecisionPolicy computes every
  parameter in bf16, which one process's autocast does not).
- **Training forwards go through the wrapper.** Our forwards bypass ``model.forward`` (the LM head runs only
  where scored, ``posttrain.logprobs``), so ``wrap`` puts the model inside ``Forward``, a module whose forward
  is ``fn(model, *args)``; DDP's and FSDP2's hooks then see every training forward (``forward(W, fn, ...)``).
- **Collectives line up.** Every forward/backward of a wrapped model is a collective under FSDP2 (all-gathers)
  and every synchronising backward is one under DDP, so all ranks run the same number of micro-batches:
  ``micro_count`` is the global maximum, and a rank with fewer runs zero-weight ones on its first micro-batch.
  Under DDP gradients synchronise on the last micro-batch only; FSDP2 reduce-scatters each (``grad_sync``).
- **Scoring and generation never touch the wrapped model**: they use ``plain(model)``, the unwrapped module
  (DDP) or a full-weight copy refreshed from the shards one parameter at a time (FSDP2; a collective, called by
  every rank at the same point). Under FSDP2 the copy is in ``model.dtype`` and allocated the first time
  ``plain`` is called: SFT makes it only to save; rl and distill hold it for generation, as a colocated vLLM
  engine would. With ``model.dtype`` below fp32, FSDP2 all-gathers in it (``MixedPrecisionPolicy``).
- **Rank 0 alone reads weights.** Under FSDP2 ranks other than 0 build the policy (and a loaded distill student)
  on the meta device (``loads_on_meta``); ``wrap`` shards it and broadcasts rank 0's weights into the shards.
  Frozen models go through rank 0 too: the rl KL reference through ``load_frozen`` (under FSDP2 sharded like the
  policy, 1/world of its bytes per rank, scored through the handle: every scoring forward is then a collective,
  which ``logprobs.fill`` runs in lockstep), the distill teacher through ``load_on_rank0`` (a full model per
  rank, since it also generates): rank 0 reads it, the others build it empty and receive it tensor by tensor.
- **Rank 0 alone writes** outputs, logs and the MLflow run. Resumable checkpoints are written by every rank
  (``posttrain.checkpoint``: DCP, each rank its shards, never a gathered full state); any world size and
  strategy can load them.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import signal
from collections.abc import Callable

import torch
import torch.distributed as tdist

from posttrain.distributed.dist import Dist
from posttrain.distributed.placement import PREFIX, Forward, forward

__all__ = ["PREFIX", "Dist", "Forward", "before_shutdown", "current", "forward", "init", "launched", "shutdown"]
log = logging.getLogger("posttrain.distributed")


_CURRENT = Dist()


def current() -> Dist:
    """This process's ``Dist`` (single-process unless ``init`` ran under torchrun)."""
    return _CURRENT


def launched() -> bool:
    """True inside a torchrun worker."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(backend: str, strategy: str, timeout_s: float) -> Dist:
    """Join the torchrun job (env://): the process group with ``backend`` (``auto``: nccl on CUDA, else gloo)
    and a ``timeout_s`` on every collective, so a dead rank fails the others instead of hanging them. A rank
    that seems stuck prints its Python stacks on ``kill -USR2 <pid>`` (and stays alive)."""
    global _CURRENT
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not tdist.is_initialized():
        tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _CURRENT = Dist(rank, world, local, strategy, f"cuda:{local}" if backend == "nccl" else "cpu")
    log.info("rank %d of %d (%s, %s)", rank, world, backend, strategy)
    return _CURRENT


_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def before_shutdown(fn: Callable[[], None]) -> None:
    """Run ``fn`` (once, however often it is registered) before the process group is destroyed: for an engine
    whose own groups live inside it (vLLM), which would otherwise destroy them at exit after the group is gone."""
    if fn not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(fn)


def shutdown() -> None:
    global _CURRENT
    if tdist.is_initialized():
        while _BEFORE_SHUTDOWN:
            _BEFORE_SHUTDOWN.pop()()
        if tdist.is_initialized():
            tdist.destroy_process_group()
    _CURRENT = Dist()
