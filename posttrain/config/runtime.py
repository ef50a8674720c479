"""``runtime:``: threads, device, progress bars and the distributed job (no result depends on it but the world size)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.base import MAX_THREADS, Refusal, Section


class Distributed(Section):
    """Several training processes (``posttrain.distributed``): sft, rl and distill relaunch themselves under
    ``torchrun`` when ``nproc_per_node * nnodes`` > 1. Global batch = per-rank micro-batches x ranks x
    accumulation: ``sft.batch_size``, ``rl.prompts_per_step`` x ``samples_per_prompt`` and the distill batches stay the
    *global* batch, split over ranks, so a run's result does not depend on the world size beyond fp32 reduction
    order (sft, and an rl/distill update from the same samples) and sampling (rl/distill ranks generate their
    share of prompts with their own seeds: reproducible for a given world size)."""

    nproc_per_node: int = Field(1, ge=1, le=1024, description="processes per machine (one per GPU)")
    nnodes: int = Field(1, ge=1, le=100_000,
                        description="machines; above 1 every machine runs the same stage command and "
                        "they meet at rdzv_endpoint")
    strategy: Literal["ddp", "fsdp2"] = Field("ddp", description="ddp: replicated model, all-reduced gradients; "
                                              "fsdp2: fully_shard per decoder layer (parameters, gradients, "
                                              "optimizer state sharded)")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto = nccl on CUDA, else gloo")
    rdzv_endpoint: str | None = Field(None, min_length=1, description="host:port of node 0, needed when nnodes > 1")
    timeout_s: float = Field(600, gt=0, le=7 * 86400,
                             description="a collective waiting longer fails the stage (a dead rank "
                             "cannot hang the others past this)")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _nodes(self) -> Distributed:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise Refusal("rdzv_endpoint", "nnodes > 1 needs rdzv_endpoint (host:port of node 0)")
        return self


class Runtime(Section):
    """Where and how stages run: threads, device, progress bars, several processes."""

    train_threads: int = Field(2, ge=1, le=MAX_THREADS,
                               description="torch threads for training steps (2 is fastest here)")
    generate_threads: int = Field(2, ge=1, le=MAX_THREADS,
                                  description="torch threads for generation (2 is fastest here from "
                                  "batch 64 up: benchmarks/rollout.py)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    progress: bool = Field(True, description="show tqdm progress bars on long loops")
    distributed: Distributed = Field(default_factory=Distributed)
