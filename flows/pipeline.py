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
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, State

from flows import pools
from posttrain import dvcrepo, tracking
from posttrain.config import ConfigError, Params, load_params, stage_metrics
from posttrain.config.overrides import parse_overrides, render_overrides
from posttrain.errors import StageError
from posttrain.runfacts import read_metrics

STAGE_DEPLOYMENT = "posttrain-stage/gpu"
_PARENT: list[str] = []  # the MLflow parent run of this process's pipeline invocation
_STAGE_PYTHON: list[str] = []  # the interpreter the stage commands run with (gpu stages: prefect.gpu_python)


def _env() -> dict[str, str]:
    """The environment of the ``dvc`` commands: stage commands find the stage interpreter first on PATH (this
    process's, or ``prefect.gpu_python`` in a gpu stage flow: ``dvcrepo.stage_env``) and the MLflow parent
    run (``_PARENT``) in ``tracking.PARENT_ENV``."""
    env = dvcrepo.stage_env(os.environ, _STAGE_PYTHON[0] if _STAGE_PYTHON else None)
    if _PARENT:
        env[tracking.PARENT_ENV] = _PARENT[0]
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _run(cmd: list[str], repo: Path) -> str:
    """Run ``cmd`` in ``repo``, streaming each output line to the Prefect logger; return the output."""
    log = get_run_logger()
    proc = subprocess.Popen(cmd, cwd=repo, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        log.info(line.rstrip())
    if proc.wait():
        raise StageError(f"{' '.join(cmd)} exited {proc.returncode}:\n{''.join(lines[-20:])}")
    return "".join(lines)


def dvc(*args: str, repo: Path) -> str:
    return _run([sys.executable, "-m", "dvc", *args], repo)


def publish(stage: str, repo: Path, params: Params, status: str) -> None:
    """Prefect artifacts of a finished stage: its metrics as a table; the report stage's report.md as Markdown.
    (Artifact keys allow lowercase letters, digits and dashes: ``evaluate@student_sft`` -> ``evaluate-student-sft``.)"""
    metrics = repo / stage_metrics(params.paths.metrics_dir, stage)
    key = re.sub(r"[^a-z0-9-]", "-", stage.lower())
    if metrics.is_file():
        flat = [{"metric": k, "value": json.dumps(v) if isinstance(v, list) else v}
                for k, v in tracking.flatten(read_metrics(metrics)).items()]
        create_table_artifact(key=f"{key}-metrics", table=flat,
                              description=f"{stage}: {metrics.relative_to(repo)} ({status})")
    report = repo / params.paths.eval_report_dir / "summary" / "report.md"
    if stage == "report" and report.is_file():
        create_markdown_artifact(key="evaluation-report", markdown=report.read_text(),
                                 description="report: every model side by side (report.md)")


@task(cache_policy=None, persist_result=False)
def stage_task(stage: str, repo: str) -> str | State:
    """One DVC stage in this process (the task is renamed to the stage by ``pipeline``): ``dvc repro
    --single-item <stage>`` unless DVC finds it up to date; returns what DVC said it would do (``dvcrepo.plan``):
    ran | skipped | restored (outputs checked out of DVC's cache). A skipped stage ends in a completed state
    named ``Skipped`` (the UI draws it apart from a stage that ran; :func:`stage_status` reads it back)."""
    root = Path(repo)
    freed = dvcrepo.clear_stale_locks(root)
    if freed:
        get_run_logger().warning("cleared stale DVC locks of a killed run: %s", freed)
    status = dvcrepo.plan(root, stage)
    if status != "skipped":
        dvc("repro", "--single-item", stage, repo=root)
    publish(stage, root, load_params(root / "params.yaml"), status)
    return Completed(name="Skipped", message=f"{stage}: up to date, DVC ran nothing") if status == "skipped" else status


def stage_status(returned: str | State) -> str:
    """What :func:`stage_task` returned, as ran | skipped | restored."""
    return "skipped" if isinstance(returned, State) else returned


@task(cache_policy=None, persist_result=False)
def remote_stage_task(stages: list[str], repo: str, commit: str, mlflow_parent: str | None,
                      params_text: str | None = None, remote: str | None = None,
                      job_variables: dict[str, Any] | None = None) -> dict[str, str]:
    """Consecutive gpu stages as one flow run of the gpu stage deployment, with the pipeline's params.yaml
    (``params_text``); waits for it, fails if it failed. ``remote``: the worker is in its own checkout, so the
    handoffs go both ways and the outputs are pulled here. ``job_variables``: the run's (``flows.pools``: the
    commit's image on a kubernetes or docker pool)."""
    from prefect.deployments import run_deployment

    root = Path(repo)
    parameters = {"stages": stages, "commit": commit, "mlflow_parent": mlflow_parent, "params_text": params_text}
    if remote:
        parameters["handoff"] = dvcrepo.handoff_of(root, list(dvcrepo.lock_entries(root, None)))
    else:
        parameters["repo"] = repo  # workers share this checkout
    fr = run_deployment(STAGE_DEPLOYMENT, parameters=parameters, flow_run_name=group_name(stages), timeout=None,
                        as_subflow=True, poll_interval=1, job_variables=job_variables or None)
    if fr.state is None or not fr.state.is_completed():
        raise StageError(f"stages {stages}: flow run {fr.id} ended {fr.state.name if fr.state else 'unknown'}")
    if remote:
        dvcrepo.receive(root, read_lock_artifact(fr.id))
        dvc("pull", "--remote", remote, *stages, repo=root)
    return {s: "remote" for s in stages}


LOCK_ARTIFACT = "dvc-lock"


def read_lock_artifact(flow_run_id: Any) -> dict[str, Any]:
    """The ``dvc-lock`` artifact a stage flow run published (its stages' ``handoff``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[LOCK_ARTIFACT]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    if not found:
        raise StageError(f"stage flow run {flow_run_id} published no {LOCK_ARTIFACT} artifact")
    return dvcrepo.parse_handoff(str(found[0].data))


@flow(name="posttrain-stage", log_prints=True)
def stage_flow(stages: list[str], repo: str | None = None, commit: str | None = None,
               mlflow_parent: str | None = None, params_text: str | None = None,
               handoff: dict[str, Any] | None = None) -> dict[str, str]:
    """Stages on a worker, one task each, at the pipeline's commit and with its params (``params_text``; a
    worker in its own checkout would otherwise run the committed ones); see the module docstring."""
    root = Path(repo or os.getcwd())
    _PARENT[:] = [mlflow_parent] if mlflow_parent else []
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
            _STAGE_PYTHON[:] = [str(python)]
        try:
            statuses = {s: stage_status(stage_task.with_options(name=s, task_run_name=s)(s, str(root)))
                        for s in stages}
        finally:
            _STAGE_PYTHON[:] = []
        if remote:
            dvc("push", "--remote", remote, *stages, repo=root)
            create_markdown_artifact(key=LOCK_ARTIFACT, markdown=dvcrepo.handoff_text(dvcrepo.handoff_of(root, stages)),
                                     description=f"lock entries, metrics of {stages}")
    return statuses


@flow(name="posttrain-pipeline", log_prints=True)
def pipeline(target: str | None = None, overrides: list[str] | None = None, exp_name: str | None = None,
             route: bool = False, repo: str | None = None) -> dict[str, str]:
    """Run the DAG (or ``target`` and its upstream) stage by stage through DVC; see the module docstring."""
    root = Path(repo or os.getcwd()).resolve()
    path, overrides = root / "params.yaml", list(overrides or [])
    wait = parse_overrides(path, overrides)[0].prefect.workspace_wait_s  # a bad override fails before waiting
    with dvcrepo.workspace_lock(root, f"flow run {flow_run.name!r} with overrides {overrides}", wait):
        params, edits = parse_overrides(path, overrides)  # the file as the last holder left it
        with dvcrepo.use_params(root, render_overrides(path.read_text(), edits)):
            return _pipeline(root, params, target, exp_name, route)


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
    _PARENT[:] = [parent] if parent else []
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


def group_name(group: list[str]) -> str:
    """The task name of a run of gpu stages: ``gpu: rl`` or ``gpu: rl .. evaluate@student (5 stages)`` (the
    stages joined with ``+`` made names of hundreds of characters the UI cut)."""
    return f"gpu: {group[0]}" + (f" .. {group[-1]} ({len(group)} stages)" if len(group) > 1 else "")


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
        statuses = pipeline(target=args.target, overrides=args.overrides, exp_name=args.exp_name, route=args.route)
    except ConfigError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        sys.exit(2)
    except StageError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(statuses))


if __name__ == "__main__":
    main()
