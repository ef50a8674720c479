"""The gpu work pool's base job template for Prefect's ``kubernetes`` and ``docker`` pool types
(``prefect.gpu_pool_type``; docs/clusters.md).

Prefect's own templates (``KubernetesWorker`` and ``DockerWorker.get_default_base_job_template()`` of
prefect-kubernetes and prefect-docker) run a flow in a pod or container but cannot ask for a GPU: the Kubernetes
one has CPU and memory only, the Docker one no device field at all (Prefect issues #12920, #18544). This module
edits those templates, and nothing else:

- kubernetes: the container's ``resources.limits`` gain ``nvidia.com/gpu: {{ gpus }}`` (a new variable, default
  ``prefect.gpus``), the pod tolerates the ``nvidia.com/gpu`` taint GPU node pools carry, the image defaults
  to ``prefect.image``, and ``prefect.dvc_secret`` (a Secret of the DVC remote's credentials) becomes the
  container's environment (``envFrom``);
- docker: ``container_create_kwargs`` defaults to a device request for ``gpus`` NVIDIA GPUs (docker-py's
  ``device_requests``: what ``docker run --gpus N`` sends), the image to ``prefect.image``.

Both set ``POSTTRAIN_IMAGE`` to the image in the environment, so each stage's MLflow run (and ``posttrain
lineage``) records the image it ran in. ``prefect.image`` may hold ``{commit}``: each gpu flow run asks for the
image of the pipeline's commit (``job_variables``), since a stage flow runs only in a checkout at that commit
(the image's, at ``/opt/posttrain``, where the deployment's entrypoint is relative to).

The server checks a template's placeholders against its variables (``posttrain deploy`` creates or updates the
pool through it); ``tests/test_pools.py`` renders both for a sample flow run with the workers' own classes.
"""

from __future__ import annotations

import copy
from typing import Any

from posttrain.config import Params
from posttrain.tracking.records import IMAGE_ENV

GPU = "nvidia.com/gpu"  # the NVIDIA device plugin's resource name


def image(params: Params, commit: str) -> str | None:
    """``prefect.image`` for the checkout at ``commit``: its ``{commit}`` (``make image`` tags with it) filled in,
    so params.yaml names the image of whatever commit runs without naming one itself."""
    ref = params.prefect.image
    return ref.replace("{commit}", commit) if ref is not None else None


def job_variables(params: Params, commit: str) -> dict[str, Any]:
    """The job variables of one gpu flow run at ``commit`` on a kubernetes or docker pool: that commit's image,
    recorded by the stages (``POSTTRAIN_IMAGE``); empty for a process pool."""
    if params.prefect.gpu_pool_type == "process":
        return {}
    ref = image(params, commit)
    return {"image": ref, "env": {IMAGE_ENV: ref}}


def gpus(params: Params) -> int:
    """GPUs one gpu flow run asks for: ``prefect.gpus``, else ``runtime.distributed.nproc_per_node``."""
    cfg = params.prefect
    return cfg.gpus if cfg.gpus is not None else params.runtime.distributed.nproc_per_node


def base_job_template(params: Params, commit: str = "") -> dict[str, Any] | None:
    """The gpu pool's base job template for ``prefect.gpu_pool_type`` (None for ``process``: Prefect's own); its
    image the one of ``commit`` (the deploying checkout's)."""
    kind = params.prefect.gpu_pool_type
    if kind == "kubernetes":
        from prefect_kubernetes.worker import KubernetesWorker

        return kubernetes(KubernetesWorker.get_default_base_job_template(), params, commit)
    if kind == "docker":
        from prefect_docker.worker import DockerWorker

        return docker(DockerWorker.get_default_base_job_template(), params, commit)
    return None


def kubernetes(template: dict[str, Any], params: Params, commit: str = "") -> dict[str, Any]:
    """Prefect's Kubernetes template (``template``, not changed) with a GPU limit, the GPU taint tolerated,
    the image and the DVC credentials' Secret."""
    cfg, t = params.prefect, copy.deepcopy(template)
    variables = t["variables"]["properties"]
    variables["gpus"] = {"title": "GPUs", "type": "integer", "minimum": 0, "default": gpus(params),
                         "description": f"{GPU} the pod asks for (posttrain: prefect.gpus)"}
    variables["image"]["default"] = image(params, commit)
    variables["env"]["default"] = {IMAGE_ENV: image(params, commit)}  # the stages' MLflow runs record the image
    pod = t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    container["resources"]["limits"][GPU] = "{{ gpus }}"
    pod["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    if cfg.dvc_secret:
        variables["dvc_secret"] = {"title": "DVC credentials", "type": "string", "default": cfg.dvc_secret,
                                   "description": "a Secret whose keys become the environment (posttrain: "
                                   "prefect.dvc_secret)"}
        container["envFrom"] = [{"secretRef": {"name": "{{ dvc_secret }}"}}]
    return t


def docker(template: dict[str, Any], params: Params, commit: str = "") -> dict[str, Any]:
    """Prefect's Docker template (``template``, not changed) whose ``container_create_kwargs`` ask for GPUs."""
    t = copy.deepcopy(template)
    variables = t["variables"]["properties"]
    variables["image"]["default"] = image(params, commit)
    variables["env"]["default"] = {IMAGE_ENV: image(params, commit)}
    variables["container_create_kwargs"]["default"] = {
        "device_requests": [{"Driver": "nvidia", "Count": gpus(params), "Capabilities": [["gpu"]]}]}
    return t
