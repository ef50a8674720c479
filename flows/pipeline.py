"""The pipeline as Prefect flows, each stage run *through DVC*. Flows orchestrate only: which stage runs where,
in which order, with which retries. Params overrides are ``posttrain.config.overrides``; the workspace (its lock,
its params.yaml for a run), DVC's DAG, what DVC will do with a stage, the stage interpreter and the handoff
between checkouts are ``posttrain.dvcrepo``.

``pipeline`` (flow ``posttrain-pipeline``) runs ``dvc.yaml``'s stages in DAG order (all, or a ``target`` and its
upstream), one at a time, one task per stage named after it: ``dvc repro --single-item <stage>``, so DVC stays
the only cache (Prefect result caching stays off) and ``dvc.lock`` records every run. DVC's API first says what
repro will do (``dvcrepo.plan``): ``skipped`` (up to date: repro is not run, so a re-run flow redoes nothing
that completed), ``restored`` (outputs from DVC's cache) or ``ran``. Tasks retry per ``prefect.retries``.

``overrides`` (``["rl.lr=1e-5"]``) are validated before anything runs (a bad one: one line naming it, exit 2)
and applied as ``dvc exp run -S`` applies them, for the run only: DVC and the stages read the overridden
params.yaml, dvc.lock records what each stage ran with, and the file's own text is back after the run, failed
or not (``dvcrepo.use_params``), so the next scheduled run does not inherit an experiment's overrides.
``exp_name`` records the finished workspace with ``dvc exp save -n <name>`` first. One pipeline run per
workspace at a time (``dvcrepo.workspace_lock``): a concurrent run waits instead of running with other params.

``route=True`` (the deployed pipeline's default): each run of consecutive ``gpu`` stages (``prefect.resources``)
is one ``posttrain-stage`` flow run of the ``gpu`` deployment (a subflow, on the gpu pool), at the pipeline's
commit, with its params.yaml and ``prefect.gpu_python``; ``cpu`` stages run in the pipeline's own flow run.
With ``prefect.dvc_remote``, a worker runs in its own checkout and DVC cache, sharing only the Prefect server
and the remote: handoffs (dvc.lock entries, metrics files) go out with the stage flow's parameters and come
back as its ``dvc-lock`` artifact; outputs go through the remote. Each stage's metrics become a Prefect table
artifact (``report``: its Markdown report too).

Run in-process: ``python -m flows.pipeline [--target rl] [-S rl.lr=1e-5] [--exp-name x]``; deploy:
``posttrain deploy`` (flows/deploy.py), then ``prefect deployment run posttrain-pipeline/default``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import State

from flows import pools
from flows.tasks import (
    LOCK_ARTIFACT,
    PARENT,
    STAGE_PYTHON,
    dvc,
    failed,
    group_name,
    remote_stage_task,
    stage_status,
    stage_task,
)
from posttrain import dvcrepo, tracking
from posttrain.config import ConfigError, Params, load_params
from posttrain.config.overrides import parse_overrides, render_overrides
from posttrain.errors import StageError


@flow(name="posttrain-stage", log_prints=True)
def stage_flow(stages: list[str], repo: str | None = None, commit: str | None = None,
               mlflow_parent: str | None = None, params_text: str | None = None,
               handoff: dict[str, Any] | None = None) -> dict[str, str] | State:
    """Stages on a worker, one task each, at the pipeline's commit and with its params (``params_text``; a
    worker in its own checkout would otherwise run the committed ones); see the module docstring."""
    try:
        return _stage_flow(stages, repo, commit, mlflow_parent, params_text, handoff)
    except (ConfigError, StageError) as e:
        return failed(e)


def _stage_flow(stages: list[str], repo: str | None, commit: str | None, mlflow_parent: str | None,
                params_text: str | None, handoff: dict[str, Any] | None) -> dict[str, str]:
    root = Path(repo or os.getcwd())
    PARENT[:] = [mlflow_parent] if mlflow_parent else []
    head = dvcrepo.git_head(root)
    if commit and head != commit:
        raise StageError(f"worker checkout {root} is at {head[:12] or 'no commit'}, the pipeline at "
                          f"{commit[:12]}: check out the pipeline's commit on the worker")
    # A worker in its own checkout (the pipeline sends a handoff exactly then) holds that workspace like a
    # pipeline run does: one run at a time there, and a killed run's params undone by the next holder.
    own = handoff is not None
    held = (dvcrepo.workspace_lock(root, f"stage flow {'+'.join(stages)}",
                                   load_params(root / "params.yaml").prefect.workspace_wait_s)
            if own else contextlib.nullcontext())
    with held, dvcrepo.use_params(root, params_text):
        cfg = load_params(root / "params.yaml").prefect
        remote = cfg.dvc_remote
        if remote:
            if handoff:
                dvcrepo.receive(root, handoff)
            upstream = [s for s in dvcrepo.stage_order(root, stages[-1]) if s not in stages]
            if upstream:
                dvc("pull", "--remote", remote, *upstream, repo=root)
        if cfg.gpu_python:
            python = root / cfg.gpu_python
            if not python.is_file():
                raise StageError(f"prefect.gpu_python: {python} not found on this worker (make setup-gpu there)")
            get_run_logger().info("stages %s run with %s", stages, python)
            STAGE_PYTHON[:] = [str(python)]
        try:
            statuses = {s: stage_status(stage_task.with_options(name=s, task_run_name=s)(s, str(root)))
                        for s in stages}
        finally:
            STAGE_PYTHON[:] = []
        if remote:
            dvc("push", "--remote", remote, *stages, repo=root)
            create_markdown_artifact(key=LOCK_ARTIFACT, markdown=dvcrepo.handoff_text(dvcrepo.handoff_of(root, stages)),
                                     description=f"lock entries, metrics of {stages}")
    return statuses


@flow(name="posttrain-pipeline", log_prints=True)
def pipeline(target: str | None = None, overrides: list[str] | None = None, exp_name: str | None = None,
             route: bool = False, repo: str | None = None) -> dict[str, str] | State:
    """Run the DAG (or ``target`` and its upstream) stage by stage through DVC; see the module docstring. A
    config error or a failed stage ends the run Failed with one line (``tasks.failed``)."""
    root = Path(repo or os.getcwd()).resolve()
    path, overrides = root / "params.yaml", list(overrides or [])
    try:
        wait = parse_overrides(path, overrides)[0].prefect.workspace_wait_s  # a bad override fails before waiting
        with dvcrepo.workspace_lock(root, f"flow run {flow_run.name!r} with overrides {overrides}", wait):
            params, edits = parse_overrides(path, overrides)  # the file as the last holder left it
            with dvcrepo.use_params(root, render_overrides(path.read_text(), edits)):
                return _pipeline(root, params, target, exp_name, route)
    except (ConfigError, StageError) as e:
        return failed(e)


def _pipeline(root: Path, params: Params, target: str | None, exp_name: str | None, route: bool
              ) -> dict[str, str]:
    """The pipeline's body, with the workspace held and its params in params.yaml (see ``pipeline``)."""
    log = get_run_logger()
    log.info("workspace %s held by this run", root)
    stages = dvcrepo.stage_order(root, target)
    cfg = params.prefect
    commit = dvcrepo.git_head(root)
    parent = tracking.start_parent(params, root, f"pipeline {flow_run.name}",
                                   {"prefect.flow_run_id": str(flow_run.id), "launcher": "prefect"})
    PARENT[:] = [parent] if parent else []
    if parent:
        _link_mlflow(params, root, parent)
    statuses: dict[str, str] = {}
    retry = {"retries": cfg.retries, "retry_delay_seconds": cfg.retry_delay_s}
    params_text = (root / "params.yaml").read_text()
    ok = False
    try:
        for kind, group in _groups(stages, cfg.resources if route else {}):
            if kind == "gpu":  # consecutive gpu stages: one flow run on the gpu pool (one worker pick-up)
                name = group_name(group)
                statuses |= remote_stage_task.with_options(name=name, task_run_name=name, **retry)(
                    group, str(root), commit, parent, params_text, cfg.dvc_remote if route else None,
                    pools.job_variables(params, commit))
            else:
                (s,) = group
                statuses[s] = stage_status(stage_task.with_options(name=s, task_run_name=s, **retry)(s, str(root)))
                if route and cfg.dvc_remote:  # workers in other checkouts pull it from there
                    dvc("push", "--remote", cfg.dvc_remote, s, repo=root)
            log.info("%s: %s", "+".join(group), [statuses[s] for s in group])
        if exp_name:  # records params, metrics and every output: needs the whole DAG's outputs in the workspace
            dvc("exp", "save", "--force", "-n", exp_name, repo=root)
        ok = True
    finally:
        tracking.end_parent(params, root, parent, "FINISHED" if ok else "FAILED")
    return statuses


def _groups(stages: list[str], resources: dict[str, str]) -> list[tuple[str, list[str]]]:
    """[("cpu", [s]), ("gpu", [s1, s2, ...]), ...]: each cpu stage alone, runs of consecutive gpu stages
    together (``resources`` empty: everything cpu, i.e. in this process)."""
    out: list[tuple[str, list[str]]] = []
    for s in stages:
        kind = resources.get(s.split("@")[0], "cpu")  # evaluate@sft: the class of evaluate
        if kind == "gpu" and out and out[-1][0] == "gpu":
            out[-1][1].append(s)
        else:
            out.append((kind, [s]))
    return out


def _link_mlflow(params: Params, root: Path, run_id: str) -> None:
    """A Prefect artifact pointing at this invocation's MLflow parent run."""
    from prefect.artifacts import create_link_artifact

    uri = tracking.store_uri(params, root)
    if uri.startswith("http"):
        create_link_artifact(key="mlflow-run", link=f"{uri.rstrip('/')}/#/runs/{run_id}",
                             link_text=f"MLflow run {run_id}", description="the pipeline's MLflow parent run")
    else:
        create_markdown_artifact(key="mlflow-run", markdown=f"MLflow parent run `{run_id}` in `{uri}`.\n\n"
                                 f"Open it: `mlflow ui --backend-store-uri {uri}`, then "
                                 f"http://127.0.0.1:5000/#/runs/{run_id}", description="the pipeline's MLflow run")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m flows.pipeline", description="Run the pipeline as a Prefect flow.")
    ap.add_argument("--target", help="a stage: run it and its upstream (default: all)")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], help="params override key=value")
    ap.add_argument("--exp-name", help="record the result as this DVC experiment")
    ap.add_argument("--route", action="store_true", help="run gpu stages on the gpu pool (needs a server)")
    args = ap.parse_args(argv)
    try:
        parse_overrides(Path.cwd() / "params.yaml", args.overrides)  # exits 2 in a second, before Prefect starts
    except ConfigError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        sys.exit(2)
    state = pipeline(target=args.target, overrides=args.overrides, exp_name=args.exp_name, route=args.route,
                     return_state=True)
    if not state.is_completed():
        print(state.message or f"posttrain: the pipeline's flow run ended {state.name}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(state.result()))


if __name__ == "__main__":
    main()
