"""The tasks of the pipeline's flows (``flows/pipeline.py``) and what they share: one DVC stage in this
process (``stage_task``), a run of gpu stages as a flow run on the gpu pool (``remote_stage_task``), the stage
commands' environment, the Prefect artifacts of a finished stage, and how a flow run ends on a config error or a
failed stage (``failed``: one line, no traceback).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed, Failed, State

from posttrain import dvcrepo, tracking
from posttrain.config import Params, load_params, stage_metrics
from posttrain.errors import StageError
from posttrain.runfacts import read_metrics

STAGE_DEPLOYMENT = "posttrain-stage/gpu"
PARENT: list[str] = []  # the MLflow parent run of this process's pipeline invocation
STAGE_PYTHON: list[str] = []  # the interpreter the stage commands run with (gpu stages: prefect.gpu_python)


def _env() -> dict[str, str]:
    """The environment of the ``dvc`` commands: stage commands find the stage interpreter first on PATH (this
    process's, or ``prefect.gpu_python`` in a gpu stage flow: ``dvcrepo.stage_env``) and the MLflow parent
    run (``PARENT``) in ``tracking.PARENT_ENV``."""
    env = dvcrepo.stage_env(os.environ, STAGE_PYTHON[0] if STAGE_PYTHON else None)
    if PARENT:
        env[tracking.PARENT_ENV] = PARENT[0]
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
        why = f": {fr.state.message}" if fr.state is not None and fr.state.message else ""
        raise StageError(f"stages {stages}: flow run {fr.id} ended {fr.state.name if fr.state else 'unknown'}{why}")
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


def one_line(e: Exception) -> str:
    """What a user needs of a config error or a failed stage: a stage's own line (its last ``posttrain ...``
    line, e.g. ``posttrain rl: data/curated/train.parquet does not exist: ...``), else the error's first."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    own = [x for x in lines if x.startswith("posttrain")]
    return own[-1] if own else f"posttrain: {lines[0] if lines else type(e).__name__}"


def failed(e: Exception) -> State:
    """A flow run's end on a config error or a failed stage: Failed with the one line as its message (what the UI
    shows; logged too, which ``prefect deployment run --watch`` prints when the server streams logs:
    docs/prefect.md), and no traceback: those are for bugs."""
    line = one_line(e)
    get_run_logger().error(line)
    return Failed(message=line)


def group_name(group: list[str]) -> str:
    """The task name of a run of gpu stages: ``gpu: rl`` or ``gpu: rl .. evaluate@student (5 stages)`` (the
    stages joined with ``+`` made names of hundreds of characters the UI cut)."""
    return f"gpu: {group[0]}" + (f" .. {group[-1]} ({len(group)} stages)" if len(group) > 1 else "")
