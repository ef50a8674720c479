"""The pipeline as Prefect flows: one task per DVC stage, each stage run *through DVC*.

``pipeline`` (flow ``posttrain-pipeline``) runs the stages of ``dvc.yaml`` in DAG order, all of them or a
``target`` and its upstream. Each stage is a task named after the stage that runs
``dvc repro --single-item <stage>``, so DVC stays the only cache and ``dvc.lock`` records every run, whether
it came from ``dvc repro`` or from Prefect; a stage DVC finds up to date is skipped (a retried or re-run
flow redoes nothing that completed), and a stage killed mid-way resumes from its own checkpoints. Stages
run one at a time (DVC locks the repository). Tasks retry per ``prefect.retries``; Prefect result caching
stays off (DVC is the cache).

Parameters: ``target`` (a stage; None = all), ``overrides`` (``["rl.lr=1e-5", ...]``, applied to
params.yaml the way ``dvc exp run -S`` applies them: the workspace file is rewritten, comments kept, and
validated before any stage runs; one pipeline run per workspace at a time, ``dvcrepo.workspace_lock``, so a
concurrent run waits instead of running with the other's params), ``exp_name`` (when set, the finished
workspace is recorded with ``dvc exp save -n <name>``, so ``dvc exp show`` lists it with its params and
metrics), ``route`` and ``repo``.

GPU routing (``route=True``, the default of the deployed pipeline): stages whose class in
``prefect.resources`` is ``gpu`` run as a ``posttrain-stage`` flow run of the ``gpu`` deployment, on the
gpu work pool (``run_deployment``, a subflow of the pipeline's run; consecutive gpu stages share one flow
run, one task per stage, so a worker picks up and starts once per run of them); ``cpu`` stages run inside
the pipeline's own flow run, on the cpu pool. A stage flow on a worker checks that its checkout is at the pipeline's
commit.

Workers on other machines (``prefect.dvc_remote`` set): a worker runs in its own checkout (the gpu
deployment made there: ``posttrain deploy --pools gpu`` on that machine), with its own DVC cache; nothing is
shared but the Prefect server and the DVC remote. The pipeline pushes every stage it runs to the remote and
sends its ``dvc.lock`` entries and uncached outputs (the metrics files) with the stage flow's parameters; the
worker merges them, ``dvc pull``s the upstream outputs, runs its stages, pushes their outputs and publishes
their lock entries and metrics as the flow run's ``dvc-lock`` artifact (stored by the Prefect server); the
pipeline merges those and pulls the outputs. Both checkouts end with a ``dvc.lock`` that ``dvc pull`` and
``posttrain lineage --verify`` accept.

Each stage publishes Prefect artifacts: its metrics (``metrics/<stage>.json``; ``metrics/evaluate/<name>.json``
for ``evaluate@<name>``) as a table, and ``report`` the Markdown report. The stage's output streams into the
task's logs.

Run in-process: ``python -m flows.pipeline [--target rl] [-S rl.lr=1e-5] [--exp-name lr1e5]``;
deploy: ``posttrain deploy`` (flows/deploy.py), then ``prefect deployment run posttrain-pipeline/default``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from posttrain import tracking
from posttrain.config import ConfigError, Params, load_params, parse_params, read_yaml, stage_metrics
from posttrain.dvcrepo import clear_stale_locks, workspace_lock
from posttrain.errors import StageError
from posttrain.schema import write_text

STAGE_DEPLOYMENT = "posttrain-stage/gpu"
_PARENT: list[str] = []  # the MLflow parent run of this process's pipeline invocation
_STAGE_PYTHON: list[str] = []  # the interpreter the stage commands run with (gpu stages: prefect.gpu_python)


def _env() -> dict[str, str]:
    """The stage commands (``python -m stages.X``, run by DVC through the shell) must find the stage
    interpreter first on PATH: this process's, or ``prefect.gpu_python`` in a gpu stage flow (through a
    ``python`` shim that execs it, so a venv's interpreter keeps its venv). The MLflow parent run
    (``_PARENT``) reaches them through the environment."""
    env = dict(os.environ)
    if _PARENT:
        env[tracking.PARENT_ENV] = _PARENT[0]
    first = _python_shim(_STAGE_PYTHON[0]) if _STAGE_PYTHON else Path(sys.executable).parent
    env["PATH"] = str(first) + os.pathsep + env.get("PATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _python_shim(interpreter: str) -> Path:
    """A folder whose ``python`` execs ``interpreter`` (one per interpreter, in the temp folder)."""
    import hashlib
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"posttrain-python-{hashlib.sha256(interpreter.encode()).hexdigest()[:12]}"
    shim = folder / "python"
    text = f'#!/bin/sh\nexec "{interpreter}" "$@"\n'
    if not shim.is_file() or shim.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        write_text(shim, text)
        shim.chmod(0o755)
    return folder


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


def stage_order(repo: Path, target: str | None) -> list[str]:
    """Stages of ``repo``'s dvc.yaml in DAG order: ``target`` and everything upstream of it, or all."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        g = r.index.graph  # edges: stage -> a stage it depends on
        by_name = {s.addressing: s for s in r.index.stages}
        if target is not None and target not in by_name:
            raise ValueError(f"target: unknown stage {target!r}; stages are {sorted(by_name)}")
        order = [s.addressing for s in reversed(list(nx.topological_sort(g))) if s.addressing in by_name]
        if target is None:
            return order
        keep = {target} | {s.addressing for s in nx.descendants(g, by_name[target])}
    return [s for s in order if s in keep]


def parse_overrides(repo: Path, overrides: list[str]) -> tuple[Params, list[tuple[list[str], Any]]]:
    """``key.path=value`` edits of params.yaml (values parsed as YAML) and the params they give, validated;
    nothing is written. Raises :class:`ConfigError` naming the key."""
    path = repo / "params.yaml"
    raw = read_yaml(path.read_text())
    edits = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {ov!r}: expected key.path=value")
        edits.append((key.split("."), read_yaml(value)))
    for keys, value in edits:
        node = raw
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                raise ConfigError(f"override {'.'.join(keys)}: {k!r} is not a section of params.yaml")
            node = node[k]
        node[keys[-1]] = value
    if not edits:
        return load_params(path), edits
    return parse_params(raw, f"{path} with overrides {overrides}"), edits


def apply_overrides(repo: Path, overrides: list[str]) -> Params:
    """Validate the overrides (:func:`parse_overrides`), then write them into params.yaml: a ruamel round trip
    (comments and order kept, as ``dvc exp run -S`` does), written atomically (a concurrent reader never sees
    half a file)."""
    import io

    from ruamel.yaml import YAML

    path = repo / "params.yaml"
    params, edits = parse_overrides(repo, overrides)
    if not edits:
        return params
    rt = YAML()
    data = rt.load(path.read_text())
    for keys, value in edits:
        node = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    buf = io.StringIO()
    rt.dump(data, buf)
    write_text(path, buf.getvalue())
    return params


def publish(stage: str, repo: Path, params: Params, status: str) -> None:
    """Prefect artifacts of a finished stage: its metrics as a table; the report stage's report.md as Markdown.
    (Artifact keys allow lowercase letters, digits and dashes: ``evaluate@student_sft`` -> ``evaluate-student-sft``.)"""
    metrics = repo / stage_metrics(params.paths.metrics_dir, stage)
    key = re.sub(r"[^a-z0-9-]", "-", stage.lower())
    if metrics.is_file():
        flat = [{"metric": k, "value": json.dumps(v) if isinstance(v, list) else v}
                for k, v in tracking.flatten(json.loads(metrics.read_text())).items()]
        create_table_artifact(key=f"{key}-metrics", table=flat,
                              description=f"{stage}: {metrics.relative_to(repo)} ({status})")
    report = repo / params.paths.eval_report_dir / "summary" / "report.md"
    if stage == "report" and report.is_file():
        create_markdown_artifact(key="evaluation-report", markdown=report.read_text(),
                                 description="report: every model side by side (report.md)")


def run_stage(stage: str, repo: Path) -> str:
    """``dvc repro --single-item <stage>``; returns ran | skipped | restored (from DVC's run-cache)."""
    freed = clear_stale_locks(repo)
    if freed:
        get_run_logger().warning("cleared stale DVC locks of a killed run: %s", freed)
    out = dvc("repro", "--single-item", stage, repo=repo)
    if f"Running stage '{stage}'" in out:
        return "ran"
    return "restored" if "run-cache" in out else "skipped"


@task(cache_policy=None, persist_result=False)
def stage_task(stage: str, repo: str) -> str:
    """One DVC stage in this process (the task is renamed to the stage by ``pipeline``)."""
    root = Path(repo)
    status = run_stage(stage, root)
    publish(stage, root, load_params(root / "params.yaml"), status)
    return status


@task(cache_policy=None, persist_result=False)
def remote_stage_task(stages: list[str], repo: str, commit: str, mlflow_parent: str | None,
                      params_text: str | None = None, remote: str | None = None) -> dict[str, str]:
    """Consecutive gpu stages as one flow run of the gpu stage deployment; waits for it, fails if it failed.
    ``params_text``: the pipeline's params.yaml (overrides applied), for a worker in another checkout.
    ``remote`` (``prefect.dvc_remote``): the worker has its own checkout (the deployment's); it gets this
    checkout's dvc.lock, and its stages' lock entries come back and their outputs are pulled here."""
    from prefect.deployments import run_deployment

    root = Path(repo)
    parameters = {"stages": stages, "commit": commit, "mlflow_parent": mlflow_parent, "params_text": params_text}
    if remote:
        parameters["handoff"] = handoff_of(root, list(lock_entries(root, None)))
    else:
        parameters["repo"] = repo  # workers share this checkout
    fr = run_deployment(STAGE_DEPLOYMENT, parameters=parameters, flow_run_name="+".join(stages), timeout=None,
                        as_subflow=True, poll_interval=1)
    if fr.state is None or not fr.state.is_completed():
        raise StageError(f"stages {stages}: flow run {fr.id} ended {fr.state.name if fr.state else 'unknown'}")
    if remote:
        receive(root, read_lock_artifact(fr.id))
        dvc("pull", "--remote", remote, *stages, repo=root)
    return {s: "remote" for s in stages}


LOCK_ARTIFACT = "dvc-lock"


def lock_entries(repo: Path, stages: list[str] | None) -> dict[str, Any]:
    """``dvc.lock``'s entries of ``stages`` (those it has; None: all)."""
    path = repo / "dvc.lock"
    recorded = (yaml.safe_load(path.read_text()) or {}).get("stages", {}) if path.is_file() else {}
    return {s: e for s, e in recorded.items() if stages is None or s in stages}


def handoff_of(repo: Path, stages: list[str]) -> dict[str, Any]:
    """What another checkout needs of ``stages`` besides the DVC remote: their dvc.lock entries and their
    uncached outputs (``cache: false``: the metrics files, which DVC does not push)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        uncached = [str(o.def_path) for st in r.index.stages if st.addressing in stages for o in st.outs
                    if not o.use_cache]
    return {"stages": lock_entries(repo, stages),
            "files": {p: (repo / p).read_text() for p in uncached if (repo / p).is_file()}}


def receive(repo: Path, payload: dict[str, Any]) -> None:
    """Merge a ``handoff_of`` from another checkout into ``repo``: its lock entries, its uncached outputs."""
    path = repo / "dvc.lock"
    lock = (yaml.safe_load(path.read_text()) if path.is_file() else None) or {"schema": "2.0", "stages": {}}
    lock.setdefault("stages", {}).update(payload.get("stages", {}))
    write_text(path, yaml.safe_dump(lock, sort_keys=False))
    for rel, text in payload.get("files", {}).items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        write_text(repo / rel, text)


def read_lock_artifact(flow_run_id: Any) -> dict[str, Any]:
    """The ``dvc-lock`` artifact a stage flow run published (its stages' ``handoff``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[LOCK_ARTIFACT]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    if not found:
        raise StageError(f"stage flow run {flow_run_id} published no {LOCK_ARTIFACT} artifact")
    text = str(found[0].data)
    return yaml.safe_load(text.split("```yaml\n", 1)[1].rsplit("```", 1)[0])


def _head(repo: Path) -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


@flow(name="posttrain-stage", log_prints=True)
def stage_flow(stages: list[str], repo: str | None = None, commit: str | None = None,
               mlflow_parent: str | None = None, params_text: str | None = None,
               handoff: dict[str, Any] | None = None) -> dict[str, str]:
    """Stages on a worker, one task each: same commit as the pipeline, and the pipeline's params
    (``params_text``, overrides included: a worker in its own checkout would otherwise run the committed
    ones; its params.yaml is restored after). With a DVC remote, the pipeline's lock entries and metrics
    (``handoff``) are merged into this checkout, the upstream outputs are pulled first, the stages' outputs
    pushed after and their own handoff published as the ``dvc-lock`` artifact."""
    root = Path(repo or os.getcwd())
    _PARENT[:] = [mlflow_parent] if mlflow_parent else []
    if commit and _head(root) != commit:
        raise StageError(f"worker checkout {root} is at {_head(root)[:12] or 'no commit'}, the pipeline at "
                          f"{commit[:12]}: check out the pipeline's commit on the worker")
    with pipeline_params(root / "params.yaml", params_text):
        cfg = load_params(root / "params.yaml").prefect
        remote = cfg.dvc_remote
        if remote:
            if handoff:
                receive(root, handoff)
            upstream = [s for s in stage_order(root, stages[-1]) if s not in stages]
            if upstream:
                dvc("pull", "--remote", remote, *upstream, repo=root)
        if cfg.gpu_python:
            python = root / cfg.gpu_python
            if not python.is_file():
                raise StageError(f"prefect.gpu_python: {python} not found on this worker (make setup-gpu there)")
            get_run_logger().info("stages %s run with %s", stages, python)
            _STAGE_PYTHON[:] = [str(python)]
        try:
            statuses = {s: stage_task.with_options(name=s, task_run_name=s)(s, str(root)) for s in stages}
        finally:
            _STAGE_PYTHON[:] = []
        if remote:
            dvc("push", "--remote", remote, *stages, repo=root)
            create_markdown_artifact(key=LOCK_ARTIFACT, markdown="```yaml\n" + yaml.safe_dump(
                handoff_of(root, stages), sort_keys=False) + "```", description=f"lock entries, metrics of {stages}")
    return statuses


@contextmanager
def pipeline_params(path: Path, params_text: str | None) -> Iterator[None]:
    """The pipeline's params.yaml in this checkout for the ``with`` body, the checkout's own restored after
    (no-op when they are the same file content, as when workers share the pipeline's checkout)."""
    own = path.read_text()
    if params_text is None or params_text == own:
        yield
        return
    parse_params(read_yaml(params_text), "the pipeline's params")  # refuse before touching anything
    write_text(path, params_text)
    try:
        yield
    finally:
        write_text(path, own)


@flow(name="posttrain-pipeline", log_prints=True)
def pipeline(target: str | None = None, overrides: list[str] | None = None, exp_name: str | None = None,
             route: bool = False, repo: str | None = None) -> dict[str, str]:
    """Run the DAG (or ``target`` and its upstream) stage by stage through DVC; see the module docstring."""
    root = Path(repo or os.getcwd()).resolve()
    from prefect.runtime import flow_run

    wait = parse_overrides(root, list(overrides or []))[0].prefect.workspace_wait_s
    with workspace_lock(root, f"flow run {flow_run.name!r} with overrides {list(overrides or [])}", wait):
        return _pipeline(root, target, list(overrides or []), exp_name, route)


def _pipeline(root: Path, target: str | None, overrides: list[str], exp_name: str | None, route: bool
              ) -> dict[str, str]:
    """The pipeline's body, with the workspace held (see ``pipeline``)."""
    log = get_run_logger()
    log.info("workspace %s held by this run", root)
    params = apply_overrides(root, overrides)
    stages = stage_order(root, target)
    cfg = params.prefect
    commit = _head(root)
    from prefect.runtime import flow_run

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
                name = "+".join(group)
                statuses |= remote_stage_task.with_options(name=name, task_run_name=name, **retry)(
                    group, str(root), commit, parent, params_text, cfg.dvc_remote if route else None)
            else:
                (s,) = group
                statuses[s] = stage_task.with_options(name=s, task_run_name=s, **retry)(s, str(root))
                if route and cfg.dvc_remote:  # workers in other checkouts pull it from there
                    dvc("push", "--remote", cfg.dvc_remote, s, repo=root)
            log.info("%s: %s", "+".join(group), [statuses[s] for s in group])
        if exp_name:  # records params, metrics and every output: needs the whole DAG's outputs in the workspace
            dvc("exp", "save", "--force", "-n", exp_name, repo=root)
        ok = True
    finally:
        tracking.end_parent(params, root, parent, ok)
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
        parse_overrides(Path.cwd(), args.overrides)  # a bad key exits 2 in a second, before Prefect starts
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
