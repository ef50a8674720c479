"""``prefect.gpu_pool_type``: the gpu pool's base job template for Kubernetes and Docker (``flows/pools.py``),
checked as Prefect's server checks it (``WorkPoolCreate``) and rendered for one flow run by the workers' own job
configuration classes (prefect-kubernetes, prefect-docker). No Kubernetes cluster or Docker daemon runs here: what
is checked is the job the worker would submit."""

import asyncio
import uuid

import pytest
from conftest import tiny_raw
from prefect.client.schemas.objects import FlowRun
from prefect.server.schemas.actions import WorkPoolCreate

from flows.pools import GPU, base_job_template
from posttrain.config import ConfigError, parse_params


def _params(kind: str, **prefect):
    raw = tiny_raw(None)
    raw["prefect"].update({"gpu_pool_type": kind, "image": "posttrain-worker@sha256:" + "ab" * 32,
                           "dvc_remote": "storage", **prefect})
    raw["runtime"]["distributed"] = {"nproc_per_node": 4}
    return parse_params(raw)


class NoServer:
    """A test double for the Prefect client the render is given: the templates hold no block or variable
    references, so the render must never call it (an ephemeral server would start otherwise)."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the render called the Prefect API: {name}")


def _render(config_cls, template: dict, values: dict) -> object:
    config = asyncio.run(config_cls.from_template_and_values(template, values, client=NoServer()))
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="rl", flow_id=uuid.uuid4()))
    return config


def test_the_kubernetes_pool_asks_for_the_stages_gpus_with_the_image_and_the_dvc_secret():
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = base_job_template(_params("kubernetes", dvc_secret="dvc-s3"))
    WorkPoolCreate(name="gpu", type="kubernetes", base_job_template=template)  # the server's own check
    job = _render(KubernetesWorkerJobConfiguration, template, {}).job_manifest
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"][GPU] == 4  # runtime.distributed.nproc_per_node: one GPU per rank
    assert c["image"] == "posttrain-worker@sha256:" + "ab" * 32
    assert c["envFrom"] == [{"secretRef": {"name": "dvc-s3"}}]
    assert {"name": "POSTTRAIN_IMAGE", "value": "posttrain-worker@sha256:" + "ab" * 32} in c["env"]
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    over = _render(KubernetesWorkerJobConfiguration, template, {"gpus": 8}).job_manifest  # a run's job variable
    assert over["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][GPU] == 8


def test_the_docker_pool_sends_a_gpu_device_request_prefects_template_lacks():
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    plain = DockerWorker.get_default_base_job_template()
    assert plain["variables"]["properties"]["container_create_kwargs"].get("default") is None  # no GPU field
    template = base_job_template(_params("docker", gpus=2))
    WorkPoolCreate(name="gpu", type="docker", base_job_template=template)
    config = _render(DockerWorkerJobConfiguration, template, {})
    assert config.image == "posttrain-worker@sha256:" + "ab" * 32
    assert config.env["POSTTRAIN_IMAGE"] == config.image  # the stages' MLflow runs record it
    assert config.container_create_kwargs == {
        "device_requests": [{"Driver": "nvidia", "Count": 2, "Capabilities": [["gpu"]]}]}  # docker run --gpus 2


def test_a_process_pool_keeps_prefects_template():
    assert base_job_template(parse_params(tiny_raw(None))) is None


@pytest.mark.parametrize(("edit", "key"), [({"image": None}, "prefect.image"),
                                           ({"dvc_remote": None}, "prefect.dvc_remote")])
def test_a_container_pool_without_an_image_or_a_dvc_remote_is_refused_naming_the_key(edit, key):
    raw = tiny_raw(None)
    raw["prefect"].update({"gpu_pool_type": "kubernetes", "image": "w:1", "dvc_remote": "storage", **edit})
    with pytest.raises(ConfigError, match=key):
        parse_params(raw)


def test_a_stage_records_the_image_it_ran_in(tmp_path, monkeypatch):
    """``POSTTRAIN_IMAGE`` (the pools set it) and podman's ``/run/.containerenv`` become ``container.*`` tags."""
    from posttrain.tracking import records

    monkeypatch.setattr(records, "CONTAINERENV", tmp_path / ".containerenv")
    monkeypatch.delenv("POSTTRAIN_IMAGE", raising=False)
    assert records._container() == {}  # not in a container
    (tmp_path / ".containerenv").write_text('engine="podman-4.3.1"\nname="x"\nimage=""\nimageid=""\nrootless=0\n')
    assert records._container() == {"container.engine": "podman-4.3.1"}  # unprivileged: the engine only
    monkeypatch.setenv("POSTTRAIN_IMAGE", "localhost/posttrain-worker@sha256:" + "cd" * 32)
    (tmp_path / ".containerenv").write_text('engine="podman-4.3.1"\nimage="localhost/posttrain-worker:dev"\n'
                                            'imageid="' + "ef" * 32 + '"\n')
    assert records._container() == {"container.image": "localhost/posttrain-worker@sha256:" + "cd" * 32,
                                    "container.engine": "podman-4.3.1", "container.imageid": "ef" * 32}


def test_each_gpu_flow_run_asks_for_the_image_of_the_pipelines_commit():
    """``prefect.image`` with ``{commit}``: the template's default is the deploying checkout's image, and each
    flow run's job variables the pipeline's (a stage flow runs only at the pipeline's commit)."""
    from flows.pools import job_variables

    p = _params("kubernetes", image="registry.example/posttrain-worker:{commit}")
    t = base_job_template(p, "c0ffee")
    assert t["variables"]["properties"]["image"]["default"] == "registry.example/posttrain-worker:c0ffee"
    assert job_variables(p, "abc123") == {"image": "registry.example/posttrain-worker:abc123",
                                          "env": {"POSTTRAIN_IMAGE": "registry.example/posttrain-worker:abc123"}}
    assert job_variables(parse_params(tiny_raw(None)), "abc123") == {}  # a process pool: nothing to ask
