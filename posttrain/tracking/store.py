"""MLflow I/O: the client, a stage run opened at its start, a :class:`~posttrain.tracking.records.StageRecord`
sent as one batched fill of that run (or of a new one), and the pipeline's parent run.

Default store: ``sqlite:///<absolute repo path>/mlflow.db`` with artifacts in ``<repo>/mlartifacts``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from typing import Any

from posttrain.config import ConfigError, Params
from posttrain.outputs import link_tree
from posttrain.tracking.champion import promote, register
from posttrain.tracking.records import StageRecord, _git

log = logging.getLogger("tracking")


def store_uri(params: Params, root: Path) -> str:
    return params.tracking.uri or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def mlflow_client(uri: str) -> Any:
    """An ``MlflowClient`` for tracking and registry at ``uri``; a down server fails fast (to the outbox)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a down server fails fast, to the outbox
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    # MLflow migrates a new sqlite file's schema when a client opens it: two of our processes doing it at once
    # (two stages or flow runs, a stage and `posttrain repro`) fail one in alembic, so our openings are
    # serialized (`mlflow ui` / `mlflow server` do not take this lock)
    import fcntl

    db = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    try:
        lock = open(db.with_name(db.name + ".lock"), "a")  # noqa: SIM115 (closed below; closing releases it)
    except OSError:  # a read-only folder, or one that does not exist: MLflow says what is wrong
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # opens (and migrates) the tracking store
        client.search_registered_models(max_results=1)  # and the registry's
    return client


# MLflow 3's UI opens an experiment without this tag in its GenAI view ("No data", "Evaluation runs"); with it,
# in the training view: runs, metrics, charts
KIND_TAG = {"mlflow.experimentKind": "custom_model_development"}


def _experiment_id(client: Any, name: str, root: Path | None) -> str:
    """The experiment ``name``'s id, made (artifacts in ``root``/mlartifacts, the training view's tag) if new.
    In the checkout's own store (``root``/mlflow.db) an experiment whose artifact folder is another checkout's
    (the store was moved or copied here: MLflow keeps the absolute path) is refused in one line."""
    exp = client.get_experiment_by_name(name)
    if exp is not None and root is not None:
        _refuse_moved(client, exp, name, root)
    if exp is not None:
        if "mlflow.experimentKind" not in exp.tags:  # made before the tag was set, or by someone else
            client.set_experiment_tag(exp.experiment_id, *next(iter(KIND_TAG.items())))
        return exp.experiment_id
    loc = (root / "mlartifacts").resolve().as_uri() if root is not None else None
    return client.create_experiment(name, artifact_location=loc, tags=KIND_TAG)


def _refuse_moved(client: Any, exp: Any, name: str, root: Path) -> None:
    from urllib.parse import unquote, urlparse

    db = (root / "mlflow.db").resolve()
    here = (root / "mlartifacts").resolve()
    loc = exp.artifact_location or ""
    if (client.tracking_uri.split("?", 1)[0] != f"sqlite:///{db}" or db.parent != root.resolve()
            or not loc.startswith("file:")):
        return  # a store outside the checkout (tracking.uri, or mlflow.db a link to one), shared on purpose
    kept = Path(unquote(urlparse(loc).path))
    if kept != here:
        raise ConfigError(f"tracking: in {db} the experiment {name!r} keeps its artifacts in {kept}, not in this "
                          f"checkout's {here} (the checkout was moved or copied, mlflow.db with it): set "
                          f"tracking.experiment to a new name (its runs go to {here}), or move mlflow.db and "
                          "mlartifacts/ aside")


def open_run(uri: str, experiment: str, stage: str, start_ms: int, parent: str | None, root: Path | None) -> str:
    """Create the stage's run at its start (so its per-step metrics can be logged live); returns its id."""
    c = mlflow_client(uri)
    exp_id = _experiment_id(c, experiment, root)
    reap_runs(c, exp_id)
    tags = {"mlflow.runName": stage, "dvc.stage": stage, "hostname": socket.gethostname(), "pid": str(os.getpid())}
    if parent:
        tags["mlflow.parentRunId"] = parent
    return c.create_run(exp_id, start_time=start_ms, tags=tags, run_name=stage).info.run_id


def send(rec: StageRecord, uri: str, root: Path | None) -> str:
    """Log ``rec`` to MLflow (batched) and register its models; returns the run id.

    The run opened at the stage's start (``rec.run_id``) is filled with everything but what it already has:
    the metrics of ``rec.sent`` and the models that carry a registered ``version``. ``rec`` records its own
    progress as the fill goes, so a fill that fails half-way leaves a record (for the outbox) whose replay
    neither logs a metric twice nor registers a model twice. Without a live run (the store was down at the start,
    or the run is not in this store) a new run gets all of it; one that fails half-way is deleted, so the replay
    logs it whole."""
    from mlflow.exceptions import MlflowException

    c = mlflow_client(uri)
    run = None
    if rec.run_id:
        try:
            run = c.get_run(rec.run_id)
        except MlflowException:
            run = None
    if run is not None:
        sent = {(k, int(step)) for k, step in rec.sent}
        todo = [m for m in rec.metrics if (m[0], int(m[2])) not in sent]
        if todo:  # a log_batch that failed may have reached the store all the same (its answer was lost): ask it
            have = {(k, h.step) for k in {m[0] for m in todo}
                    for h in c.get_metric_history(run.info.run_id, metric_key(k))}
            todo = [m for m in todo if (m[0], int(m[2])) not in have]
        _fill(c, run, rec, uri, todo, rec.tags)
        return run.info.run_id
    progress = (list(rec.sent), [dict(m) for m in rec.models])
    tags = {"mlflow.runName": rec.stage, **rec.tags}
    if rec.parent:
        tags["mlflow.parentRunId"] = rec.parent
    run = c.create_run(_experiment_id(c, rec.experiment, root), start_time=rec.start_ms, tags=tags,
                       run_name=rec.stage)
    rid = run.info.run_id
    try:
        _fill(c, run, rec, uri, rec.metrics, {})  # tags were set at creation
    except Exception:
        rec.sent, rec.models = progress  # nothing of the deleted run counts as done
        try:  # no half-logged run stays behind: the replay from the outbox logs it whole
            c.delete_run(rid)
        except Exception:
            pass
        raise
    return rid


def metric_key(k: str) -> str:
    """MLflow metric names allow letters, digits, ``_-. :/``: ``pass@1`` -> ``pass_at_1``."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", k.replace("@", "_at_"))


def _fill(client: Any, run: Any, rec: StageRecord, uri: str, metrics: list[tuple[str, float, int]],
          tags: dict[str, str]) -> None:
    """Params, ``tags``, ``metrics``, datasets, artifacts, registered models and evaluations of ``rec`` into
    ``run``, then end it with the stage's status."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    rid = run.info.run_id
    params = [Param(k, v[:6000]) for k, v in rec.params.items()]
    entries = [Metric(metric_key(k), v, rec.end_ms, s) for k, v, s in metrics]
    for i in range(0, max(len(params), 1), 100):
        client.log_batch(rid, params=params[i : i + 100])
    if tags:
        client.log_batch(rid, tags=[RunTag(k, v) for k, v in tags.items()])
    for i in range(0, len(entries), 1000):
        client.log_batch(rid, metrics=entries[i : i + 1000])
        rec.sent += [(k, s) for k, _, s in metrics[i : i + 1000]]
    if rec.datasets:
        client.log_inputs(rid, datasets=[DatasetInput(Dataset(d["name"], d["digest"], "local", d["source"]),
                                                      [InputTag("mlflow.data.context", rec.stage)])
                                         for d in rec.datasets])
    for a in rec.artifacts:
        p = Path(a)
        if p.is_dir():
            client.log_artifacts(rid, str(p), artifact_path=p.name)
        elif p.is_file():
            client.log_artifact(rid, str(p), artifact_path=p.parent.name)
    for m in rec.models if rec.status == "FINISHED" else []:  # a stage that did not finish registers nothing
        if m.get("version"):
            continue  # registered by an earlier, interrupted fill of this record
        if not Path(m["source"]).is_dir():
            log.warning("%s: no model folder %s to register", rec.stage, m["source"])
            continue
        m["version"] = register(client, {**m, "source": own_copy(client, run, Path(m["source"]))}, rid)
    for e in rec.evals:
        promote(client, e)
    client.set_terminated(rid, rec.status, end_time=rec.end_ms)


def own_copy(client: Any, run: Any, folder: Path) -> str:
    """The model folder as the run's own artifact ``model/<name>``, its URI: what a registered version points
    at, so ``models:/<name>@<alias>`` loads that version's bytes whatever the workspace holds later (the
    workspace folder is replaced by every later run and every ``dvc checkout``). A local artifact store gets
    hard links (no second copy on disk; the stages replace files whole, never in place, so a link keeps the
    old bytes), a copy where links cannot be made; a server gets an upload."""
    import shutil
    from urllib.parse import unquote, urlparse

    base = run.info.artifact_uri
    dest_uri = f"{base}/model/{folder.name}"
    parsed = urlparse(base)
    if parsed.scheme in ("", "file"):
        dest = Path(unquote(parsed.path)) / "model" / folder.name
        if not dest.exists():
            tmp = dest.with_name(f".{dest.name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            link_tree(folder, tmp)
            tmp.rename(dest)  # whole or not at all
        return dest_uri
    client.log_artifacts(run.info.run_id, str(folder), artifact_path=f"model/{folder.name}")
    return dest_uri


PARENT_TAG = "posttrain.parent"  # marks a pipeline invocation's parent run; with its host and pid


def start_parent(params: Params, root: Path, name: str, tags: dict[str, str] | None = None) -> str | None:
    """Create a parent run for one pipeline invocation; None (with a warning) when the store is down. Parent
    runs of this host whose process is gone (a SIGKILLed ``posttrain repro``) are ended as KILLED first."""
    if not params.tracking.enabled:
        return None
    try:
        client = mlflow_client(store_uri(params, root))
        exp_id = _experiment_id(client, params.tracking.experiment, root)
        reap_runs(client, exp_id)
        run = client.create_run(exp_id, tags={"mlflow.runName": name, "git.commit": _git(root, "rev-parse", "HEAD"),
                                              PARENT_TAG: "true", "hostname": socket.gethostname(),
                                              "pid": str(os.getpid()), **(tags or {})}, run_name=name)
        return run.info.run_id
    except ConfigError:  # the checkout's store refuses it (moved): the caller says so in one line
        raise
    except Exception as e:
        log.warning("no parent run (tracking store unreachable: %s)", type(e).__name__)
        return None


def exp_parent(params: Params, root: Path, name: str, baseline: str) -> str | None:
    """The parent run of a ``dvc exp run`` experiment's stages (DVC gives each stage ``DVC_EXP_NAME`` and
    ``DVC_EXP_BASELINE_REV``): found by its tags, else created, named after the experiment, with the params that
    differ from the baseline commit's ``params.yaml`` as its params (the experiment's overrides). Ended at once:
    its stages nest under it as they come. None (with a warning) when the store is down."""
    import yaml

    from posttrain.tracking.records import flatten

    try:
        client = mlflow_client(store_uri(params, root))
        exp_id = _experiment_id(client, params.tracking.experiment, root)
        found = [r for r in client.search_runs([exp_id], f"tags.`dvc.exp_baseline` = '{baseline}'")
                 if r.data.tags.get("dvc.exp_name") == name]  # (the name compared here: any character may be in it)
        if found:
            return found[0].info.run_id
        run = client.create_run(exp_id, run_name=name, tags={PARENT_TAG: "true", "dvc.exp_name": name,
                                                              "dvc.exp_baseline": baseline, "git.commit": baseline,
                                                              "launcher": "dvc exp run"})
        base = flatten(yaml.safe_load(_git(root, "show", f"{baseline}:params.yaml") or "{}") or {})
        now = flatten(yaml.safe_load((root / "params.yaml").read_text()) or {})
        for k, v in now.items():
            if base.get(k, object()) != v:
                client.log_param(run.info.run_id, k, str(v)[:6000])
        client.set_terminated(run.info.run_id, "FINISHED")
        return run.info.run_id
    except Exception as e:
        log.warning("no experiment parent run for %s (tracking store unreachable: %s)", name, type(e).__name__)
        return None


def reap_runs(client: Any, exp_id: str) -> list[str]:
    """End as KILLED every RUNNING run (a pipeline's parent, a stage's) of this host whose process no longer
    exists (SIGKILLed: nothing ended it); returns their ids. Runs keep every metric they logged."""
    import psutil

    host, gone = socket.gethostname(), []
    for run in client.search_runs([exp_id], f"attributes.status = 'RUNNING' and tags.hostname = '{host}'"):
        pid = int(run.data.tags.get("pid", "0") or 0)
        if pid and not psutil.pid_exists(pid):
            client.set_terminated(run.info.run_id, "KILLED")
            gone.append(run.info.run_id)
            log.warning("run %s (%s) of a process that is gone (pid %d) ended as KILLED", run.info.run_id,
                        run.info.run_name, pid)
    return gone


def end_parent(params: Params, root: Path, run_id: str | None, status: str) -> None:
    """End the parent run: FINISHED, FAILED or KILLED. A FINISHED parent no stage ran under (``dvc repro`` found
    everything up to date) is deleted: a no-op run leaves no empty ``pipeline`` run behind."""
    if run_id:
        try:
            client = mlflow_client(store_uri(params, root))
            exp = client.get_run(run_id).info.experiment_id
            if status == "FINISHED" and not client.search_runs([exp], f"tags.mlflow.parentRunId = '{run_id}'",
                                                                 max_results=1):
                client.delete_run(run_id)
                return
            client.set_terminated(run_id, status)
        except Exception as e:
            log.warning("could not close parent run %s: %s", run_id, e)
