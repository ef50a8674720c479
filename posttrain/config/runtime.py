"""``runtime:``: threads, device, progress bars and the distributed job (no result depends on it but the world size)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.base import MAX_THREADS, Refusal, Section

# sbatch options the launcher sets itself: another value would break the rendezvous, the log it follows or the
# environment the job needs
_OWNED = {"--nodes", "--ntasks-per-node", "--ntasks", "--output", "--error", "--open-mode", "--chdir", "--array",
          "--export", "--clusters", "--hold", "--job-name", "--parsable", "--wait"}

# sbatch's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (``man sbatch``)
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


class Slurm(Section):
    """``runtime.distributed.launcher: slurm``: the job the stage submits (``posttrain.slurm``). One task per
    node; each starts torchrun with ``nproc_per_node`` workers, meeting at the first node of the allocation."""

    partition: str | None = Field(None, min_length=1, description="sbatch --partition (null: the cluster's default)")
    account: str | None = Field(None, min_length=1, description="sbatch --account (null: the user's default)")
    time: str | None = Field(None, description="sbatch --time, e.g. 04:00:00 or 2-00:00:00; a job that reaches it is "
                             "resubmitted and resumes from its last checkpoint (null: the partition's limit)")
    gpus_per_node: int = Field(0, ge=0, le=1024, description="sbatch --gpus-per-node (0: CPU nodes); usually "
                               "nproc_per_node")
    cpus_per_task: int | None = Field(None, ge=1, le=MAX_THREADS, description="sbatch --cpus-per-task (null: "
                                      "the partition's default)")
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$", description="sbatch --mem per node, e.g. 200G")
    extra: list[str] = Field(default_factory=list, description="more sbatch options, each one `--name=value` "
                             "(--qos, --constraint, --exclusive)")
    port: int = Field(29500, ge=1024, le=65535, description="torchrun's rendezvous port on the job's first node")
    resubmits: int = Field(3, ge=0, le=1000, description="times a job that timed out, was pre-empted or lost a "
                           "node is submitted again (it resumes from its checkpoint); a cancelled job is not")
    poll_s: float = Field(5.0, gt=0, le=60, description="seconds between looks at the job's state and log (at most "
                          "60: slurmctld forgets an ended job after MinJobAge, 300 s by default)")
    log_dir: str = Field(".slurm", min_length=1, description="the job scripts and logs (on the shared file system; "
                         "relative to the working directory, as paths.* are); not tracked by DVC")

    @field_validator("time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_TIME.match(v):
            raise ValueError(f"{v!r} is not a Slurm time limit (minutes, HH:MM:SS or D-HH:MM:SS)")
        return v

    @field_validator("extra")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not opt.startswith("--") or any(c.isspace() for c in opt):
                raise ValueError(f"{opt!r}: each extra sbatch option is one `--name=value` (or `--flag`), "
                                 "without spaces")
            if opt.split("=", 1)[0] in _OWNED:
                raise ValueError(f"{opt!r}: posttrain sets {opt.split('=', 1)[0]} itself (nodes from nnodes, "
                                 "the log, the working directory, the environment); drop it")
        return v


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
    rdzv_endpoint: str | None = Field(None, min_length=1, description="host:port of node 0, needed when nnodes > 1 "
                                      "and launcher is local (under Slurm: the job's first node)")
    launcher: Literal["local", "slurm"] = Field("local", description="local: torchrun on this machine (every "
                                                "machine runs the stage when nnodes > 1); slurm: the stage submits "
                                                "itself as a Slurm job (runtime.distributed.slurm), follows its "
                                                "log and exits with its status (docs/clusters.md)")
    slurm: Slurm = Field(default_factory=Slurm)
    timeout_s: float = Field(600, gt=0, le=7 * 86400,
                             description="a collective waiting longer fails the stage (a dead rank "
                             "cannot hang the others past this); a stage's stage_timeout_s entry can raise it")
    stage_timeout_s: dict[Literal["sft", "rl", "distill"], Annotated[float, Field(gt=0, le=7 * 86400)]] = Field(
        default_factory=lambda: {"rl": 3600.0, "distill": 3600.0},
        description="per-stage collective timeout (s); a stage waits the larger of this and timeout_s: rl and "
        "distill ranks generate between collectives, and at long completions one rank's share can take minutes "
        "longer than another's")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def timeout_for(self, stage: str) -> float:
        """The collective timeout of ``stage``: the larger of its ``stage_timeout_s`` entry and ``timeout_s`` (a
        user who raises ``timeout_s`` for long completions raises every stage's)."""
        return max(self.stage_timeout_s.get(stage, 0.0), self.timeout_s)

    @model_validator(mode="after")
    def _nodes(self) -> Distributed:
        if self.nnodes > 1 and not self.rdzv_endpoint and self.launcher == "local":
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
    keep_freed_memory: bool = Field(True, description="glibc: freed blocks stay in the process for reuse (no mmap "
                                    "for large ones, no trimming), so big CPU tensors are not page-faulted in again "
                                    "every step (the rl update 1.14-1.29x faster on SmolLM2); RSS keeps its peak "
                                    "(posttrain/allocator.py)")
    distributed: Distributed = Field(default_factory=Distributed)
