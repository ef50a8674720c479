"""``prefect:``: how ``flows/pipeline.py`` schedules the stages. No stage reads it (no dvc.yaml param)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config import names
from posttrain.config.base import Refusal, Section


class PrefectCfg(Section):
    """How ``flows/pipeline.py`` schedules the stages (read by the flow, by no stage: no dvc.yaml param)."""

    resources: dict[str, Literal["cpu", "gpu"]] = Field(
        default_factory=lambda: {"model": "cpu", "curate": "cpu", "sft": "gpu", "rollout": "gpu", "reward": "cpu",
                                 "rl": "gpu", "distill": "gpu", "evaluate": "gpu"},
        description="resource class per stage: a 'gpu' stage runs as a stage-flow deployment on gpu_pool "
        "when the pipeline runs with routing on; a 'cpu' stage runs in the pipeline's own flow run",
    )
    cpu_pool: str = Field("cpu", min_length=1, description="work pool of the pipeline deployment (and of cpu stages)")
    gpu_pool: str = Field("gpu", min_length=1, description="work pool of the stage deployment that gpu stages run on")
    retries: int = Field(1, ge=0, le=100, description="retries of a failed stage task (a retry resumes from the "
                         "stage's own checkpoints; DVC skips what is already up to date)")
    retry_delay_s: float = Field(5.0, ge=0, le=86400, description="seconds between retries")
    dvc_remote: str | None = Field(None, min_length=1, description="DVC remote a worker in another checkout pulls a "
                                   "stage's deps from and pushes its outs to (None: workers share this checkout); "
                                   "the pipeline's params (overrides included) are sent to the worker")
    gpu_python: str | None = Field(None, min_length=1,
                                   description="the interpreter a gpu worker runs gpu stages with (e.g. "
                                   ".venv-gpu/bin/python from `make setup-gpu`: CUDA torch + vLLM, no prefect), "
                                   "relative to the worker's checkout; null: the worker's own")
    workspace_wait_s: float = Field(3600.0, ge=0, le=7 * 86400,
                                    description="a pipeline run waits this long for another run "
                                    "in the same checkout to finish (one run per workspace: overrides rewrite "
                                    "params.yaml), then refuses naming it; 0 = refuse at once")

    gpu_pool_type: Literal["process", "kubernetes", "docker"] = Field(
        "process", description="the gpu work pool's type (`posttrain deploy` creates it): process: a worker in a "
        "checkout on the GPU machine; kubernetes: a Job per flow run whose pod asks for `gpus` nvidia.com/gpu; "
        "docker: a container per flow run with a GPU device request (docs/clusters.md#prefect-work-pools-that-ask-"
        "for-gpus)")
    gpus: int | None = Field(None, ge=0, le=1024, description="GPUs a gpu flow run's pod or container asks for "
                             "(kubernetes and docker pools); null: runtime.distributed.nproc_per_node")
    image: str | None = Field(None, min_length=1, description="the worker image of kubernetes and docker gpu pools "
                              "(Containerfile: the checkout and its environment)")
    dvc_secret: str | None = Field(None, min_length=1, description="kubernetes pool: a Secret whose keys become the "
                                   "pod's environment (the DVC remote's credentials, e.g. AWS_ACCESS_KEY_ID)")

    @model_validator(mode="after")
    def _container_pool(self) -> PrefectCfg:
        if self.gpu_pool_type != "process":
            if self.image is None:
                raise Refusal("image", f"gpu_pool_type {self.gpu_pool_type} runs the stages in a container: name "
                              "its image (built from the Containerfile)")
            if self.dvc_remote is None:
                raise Refusal("dvc_remote", f"gpu_pool_type {self.gpu_pool_type}: the container has its own "
                              "checkout, so the stages' inputs and outputs go through a DVC remote; name one")
        return self

    @field_validator("resources")
    @classmethod
    def _stages(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - set(names.STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages are {list(names.STAGES)}")
        return {s: v.get(s, "cpu") for s in names.STAGES}
