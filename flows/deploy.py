"""Deployments of the pipeline on a running Prefect server (``PREFECT_API_URL``).

- ``posttrain-pipeline/default``: the whole DAG with GPU routing on, on the cpu work pool;
- ``posttrain-pipeline/nightly-evaluate``: ``target=report`` on a cron schedule (default 03:00 daily):
  re-evaluates whatever changed (new benchmark files, evaluate params); DVC skips everything up to date;
- ``posttrain-stage/gpu``: one stage (a parameter), on the gpu work pool; the pipeline's gpu stages run here.

All three run the code of this checkout in place (``flow.from_source(<repo dir>, ...)``): workers on this
machine (or on a shared filesystem) need nothing else. Pools are created if missing: ``process`` ones, and the gpu
pool of ``prefect.gpu_pool_type`` (``kubernetes`` or ``docker``: a pod or container per flow run that asks for
GPUs, ``flows.pools``).

A gpu worker on another machine (``prefect.dvc_remote`` set) runs in its own checkout: make the cpu
deployments on the pipeline's machine (``--pools cpu``) and the gpu one on the gpu machine, from its checkout
(``--pools gpu``), both against the same server.

    posttrain deploy [--repo .] [--cron "0 3 * * *"] [--pools cpu,gpu]     # or: python -m flows.deploy

``posttrain deploy`` validates params.yaml and ``--pools``, then runs ``python -m flows.deploy`` (this module's
``main``) as a subprocess with its own interpreter: the library never imports the flows.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from posttrain import dvcrepo
from posttrain.config import EXIT_CONFIG_ERROR, ConfigError, load_params


def ensure_pool(name: str, kind: str = "process", template: dict | None = None) -> None:
    """Create a work pool called ``name`` of type ``kind`` unless it exists; a ``template`` (``flows.pools``)
    is the pool's base job template, set again on an existing pool (a changed ``prefect.gpus`` or image)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=template or {}))
        except ObjectAlreadyExists:
            pool = client.read_work_pool(name)
            if pool.type != kind:
                raise ConfigError(f"work pool {name!r} is of type {pool.type} on the server, not {kind} "
                                  f"(prefect.gpu_pool_type for the gpu pool; cpu pools are process pools): delete "
                                  f"it (prefect work-pool delete {name}) or name another pool") from None
            if template:
                client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))


def deploy(repo: str | Path = ".", cron: str = "0 3 * * *", pools: tuple[str, ...] = ("cpu", "gpu")
           ) -> dict[str, str]:
    """Create or update the deployments of ``pools`` (``cpu``: the two pipeline ones; ``gpu``: the stage
    one), running the code of ``repo``; returns their ids by name (``posttrain-pipeline/default``: id)."""
    from flows.pipeline import pipeline, stage_flow
    from flows.pools import base_job_template, image

    root = Path(repo).resolve()
    params = load_params(root / "params.yaml")
    cfg = params.prefect
    src = str(root)
    quiet = {"print_next_steps": False, "ignore_warnings": True}
    ids = {}
    if "cpu" in pools:
        ensure_pool(cfg.cpu_pool)
        ids["posttrain-pipeline/default"] = pipeline.from_source(src, "flows/pipeline.py:pipeline").deploy(
            name="default", work_pool_name=cfg.cpu_pool, parameters={"route": True, "repo": src}, **quiet)
        ids["posttrain-pipeline/nightly-evaluate"] = pipeline.from_source(src, "flows/pipeline.py:pipeline").deploy(
            name="nightly-evaluate", work_pool_name=cfg.cpu_pool, cron=cron,
            parameters={"target": "report", "route": True, "repo": src}, **quiet)
    if "gpu" in pools:
        commit = dvcrepo.git_head(root)
        ensure_pool(cfg.gpu_pool, cfg.gpu_pool_type, base_job_template(params, commit))
        if cfg.gpu_pool_type == "process":  # a worker in a checkout: this one, or its own (prefect.dvc_remote)
            ids["posttrain-stage/gpu"] = stage_flow.from_source(src, "flows/pipeline.py:stage_flow").deploy(
                name="gpu", work_pool_name=cfg.gpu_pool, parameters={"repo": src}, **quiet)
        else:  # a container per flow run: the code is the image's checkout, its working directory
            with contextlib.chdir(root):  # the entrypoint, flows/pipeline.py, relative to the checkout
                ids["posttrain-stage/gpu"] = stage_flow.deploy(
                    name="gpu", work_pool_name=cfg.gpu_pool, image=image(params, commit), build=False, push=False,
                    **quiet)
    return {name: str(i) for name, i in ids.items()}


def main(argv: list[str] | None = None) -> None:
    """Print ``name: id`` per deployment made (``posttrain deploy`` runs this as a subprocess)."""
    ap = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=".")
    ap.add_argument("--cron", default="0 3 * * *", help="schedule of the nightly-evaluate deployment")
    ap.add_argument("--pools", default="cpu,gpu", help="whose deployments to make here: cpu, gpu or cpu,gpu")
    args = ap.parse_args(argv)
    pools = tuple(p.strip() for p in args.pools.split(","))
    if not pools or set(pools) - {"cpu", "gpu"}:
        ap.error(f"--pools: cpu, gpu or cpu,gpu, got {args.pools!r}")
    try:
        made = deploy(args.repo, args.cron, pools)
    except ConfigError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    for name, i in made.items():
        print(f"{name}: {i}")


if __name__ == "__main__":
    main()
