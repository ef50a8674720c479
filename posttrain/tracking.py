"""MLflow tracking of every stage run, with a local outbox so nothing is lost when the server is down.

``stage_main`` wraps each stage in :func:`stage_run`. A :class:`StageRecord` collects what the run will log:
the params dvc.yaml declares for the stage (flattened, as DVC reads them), per-step metrics (every
``train_log.csv`` among the stage's outputs, one metric per column and step), final metrics (the stage's
metrics JSON), artifacts (its report folders and metrics file), dataset inputs (each Parquet dep, with DVC's
md5 as the digest) and tags: git commit and dirty flag, DVC stage name, the md5 of every dep and out *as DVC
computes them* (``dvc.dep.<path>``, ``dvc.out.<path>``; ``posttrain lineage`` joins ``dvc.lock`` to runs
through these), hostname, device and package versions. Model outputs of ``sft``, ``rl`` and ``distill`` become
registered model versions (``create_model_version(source=<model folder>)``; on a tracking server, which
accepts only sources inside a run's artifacts, the folder is uploaded as the run's ``model/<name>`` artifact
first), tagged with the run, the out's md5 and the parent model's version, with the alias ``candidate``;
``evaluate@<name>`` moves the alias ``champion`` to a version whose ``tracking.champion`` metric beats the current
champion's.

Everything is sent in one go when the stage ends (``log_batch`` in chunks: no call per value), so tracking
costs the stage nothing while it runs. When the store cannot be reached the record goes to the outbox
(``tracking.outbox``, one JSON file per run, artifacts copied beside it) and ``posttrain tracking sync``
replays it later. ``tracking.enabled: false`` logs nothing.

Nesting: ``POSTTRAIN_MLFLOW_PARENT`` (a run id) in the environment makes each stage run a child of that
run; ``posttrain repro`` and the Prefect flow create one parent per pipeline invocation and set it.
Default store: ``sqlite:///<absolute repo path>/mlflow.db`` with artifacts in ``<repo>/mlartifacts``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.config import Params, stage_metrics

log = logging.getLogger("tracking")
PARENT_ENV = "POSTTRAIN_MLFLOW_PARENT"
MODEL_OUTS = {"sft": ["sft_model"], "rl": ["rl_model"], "distill": ["student_sft_model", "student_model"]}
PARENT_MODEL = {"sft_model": "base_model", "rl_model": "sft_model", "student_model": "student_sft_model"}


def store_uri(params: Params, root: Path) -> str:
    return params.tracking.uri or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b.c": value}``; lists stay values."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


@dataclass
class StageRecord:
    """Everything one stage run logs; JSON-serialisable so it can wait in the outbox."""

    stage: str
    experiment: str
    start_ms: int
    end_ms: int = 0
    status: str = "FINISHED"
    parent: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    metrics: list[tuple[str, float, int]] = field(default_factory=list)  # (key, value, step)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)  # absolute paths (files or folders)
    datasets: list[dict[str, str]] = field(default_factory=list)  # name, digest, source
    models: list[dict[str, Any]] = field(default_factory=list)  # name, source, md5, parent_md5
    evals: list[dict[str, Any]] = field(default_factory=list)  # md5 (of an evaluated model), metric, value


def _git(root: Path, *args: str) -> str:
    r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "vllm", "dvc", "mlflow", "prefect"):
        try:
            out[f"version.{pkg}"] = version(pkg)
        except PackageNotFoundError:
            out[f"version.{pkg}"] = "not installed"
    return out


def dvc_hashes(root: Path, stage: str) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """md5 of the stage's deps and outs in the workspace, computed by DVC (what dvc.lock will record), and
    the values of the params the stage declares in dvc.yaml."""
    from dvc.repo import Repo

    deps: dict[str, str] = {}
    outs: dict[str, str] = {}
    declared: dict[str, Any] = {}
    if not (root / "dvc.yaml").is_file():
        return deps, outs, declared  # a stage run by hand outside a DVC repo: no hash tags
    try:
        with Repo(str(root)) as repo:
            st = next((s for s in repo.index.stages if s.addressing == stage), None)
            if st is None:
                return deps, outs, declared
            for d in st.deps:
                value = d.get_hash().value
                if isinstance(value, str):
                    deps[str(d.def_path)] = value
                elif isinstance(value, dict):  # a params dep "hashes" to the values of its params
                    declared.update(value)
            for o in st.outs:
                outs[str(o.def_path)] = o.get_hash().value or ""
    except Exception as e:  # no DVC repo (a stage run by hand elsewhere): tags are simply absent
        log.warning("DVC hashes unavailable: %s", e)
    return deps, outs, declared


def _train_logs(paths: list[Path]) -> list[tuple[str, float, int]]:
    import csv

    out = []
    for base in paths:
        files = sorted(base.rglob("train_log.csv")) if base.is_dir() else [base] * (base.name == "train_log.csv")
        for f in files:
            prefix = f.parent.name if base.is_dir() and f.parent != base else ""
            for row in csv.DictReader(f.open()):
                step = int(float(row.get("step") or 0))
                for k, v in row.items():
                    if k == "step" or v in ("", None):
                        continue
                    try:
                        out.append((f"{prefix + '/' if prefix else ''}{k}", float(v), step))
                    except ValueError:
                        continue
    return out


def build_record(stage: str, params: Params, root: Path, start_ms: int, status: str) -> StageRecord:
    """Collect the stage's record after it ran (see module docstring)."""
    rec = StageRecord(stage, params.tracking.experiment, start_ms, int(time.time() * 1000), status,
                      os.environ.get(PARENT_ENV) or None)
    deps, outs, declared = dvc_hashes(root, stage)
    if not declared:  # outside a DVC repo: the stage's own section
        declared = {stage: params.model_dump(mode="json").get(stage), "seed": params.seed}
    for k, v in flatten(declared).items():  # the params dvc.yaml declares for the stage, as DVC reads them
        rec.params[k] = json.dumps(v) if isinstance(v, list | dict) else str(v)
    torch = sys.modules.get("torch")  # curate never imports it
    rec.tags = {"dvc.stage": stage, "git.commit": _git(root, "rev-parse", "HEAD"),
                "git.dirty": str(bool(_git(root, "status", "--porcelain", "--untracked-files=no"))),
                "hostname": socket.gethostname(), "platform": platform.platform(),
                "device": "cuda" if torch is not None and torch.cuda.is_available() else "cpu", **_versions(),
                **{f"dvc.dep.{p}": h for p, h in deps.items()}, **{f"dvc.out.{p}": h for p, h in outs.items()}}
    metrics_file = root / stage_metrics(params.paths.metrics_dir, stage)
    if metrics_file.is_file():
        for k, v in flatten(json.loads(metrics_file.read_text())).items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                rec.metrics.append((k, float(v), 0))
        rec.artifacts.append(str(metrics_file.resolve()))
    paths = params.paths.model_dump()
    reports = {v for k, v in paths.items() if k.endswith("report_dir")}
    report_outs = [root / p for p in outs if any(p == r or p.startswith(r.rstrip("/") + "/") for r in reports)]
    rec.metrics += _train_logs(report_outs)
    rec.artifacts += [str(p.resolve()) for p in report_outs if p.exists()]
    for p, h in deps.items():
        if p.endswith(".parquet") or (root / p).is_dir() and any((root / p).glob("*.parquet")):
            rec.datasets.append({"name": p, "digest": h[:36], "source": str((root / p).resolve())})
    for key in MODEL_OUTS.get(stage, []):
        path, parent = paths[key], paths.get(PARENT_MODEL.get(key, ""))
        rec.models.append({"name": f"{params.tracking.model_prefix}{key.removesuffix('_model')}",
                           "source": str((root / path).resolve()), "md5": outs.get(path, ""),
                           "parent_md5": (deps.get(parent) or outs.get(parent) or "") if parent else ""})
    name = stage.removeprefix("evaluate@")
    if name != stage and params.tracking.champion and metrics_file.is_file() and name in params.evaluate.models:
        split, metric = params.tracking.champion.split(".", 1)
        value = json.loads(metrics_file.read_text()).get(split, {}).get(metric)
        path = params.evaluate.models[name]
        if isinstance(value, int | float) and deps.get(path):
            rec.evals.append({"md5": deps[path], "metric": params.tracking.champion, "value": float(value)})
    return rec


# ------------------------------------------------------------------------------------------ sending
def _client(uri: str) -> Any:
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a down server fails fast, to the outbox
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _experiment_id(client: Any, name: str, root: Path | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    loc = (root / "mlartifacts").resolve().as_uri() if root is not None else None
    return client.create_experiment(name, artifact_location=loc)


def send(rec: StageRecord, uri: str, root: Path | None) -> str:
    """Log ``rec`` as one MLflow run (batched); register its models. Returns the run id."""

    client = _client(uri)
    exp_id = _experiment_id(client, rec.experiment, root)
    tags = {"mlflow.runName": rec.stage, **rec.tags}
    if rec.parent:
        tags["mlflow.parentRunId"] = rec.parent
    run = client.create_run(exp_id, start_time=rec.start_ms, tags=tags, run_name=rec.stage)
    rid = run.info.run_id
    try:
        _fill(client, run, rec, uri)
    except Exception:
        try:  # no half-logged run stays behind: the replay from the outbox logs it whole
            client.delete_run(rid)
        except Exception:
            pass
        raise
    return rid


def metric_key(k: str) -> str:
    """MLflow metric names allow letters, digits, ``_-. :/``: ``pass@1`` -> ``pass_at_1``."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", k.replace("@", "_at_"))


def _fill(client: Any, run: Any, rec: StageRecord, uri: str) -> None:
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param

    rid = run.info.run_id
    params = [Param(k, v[:6000]) for k, v in rec.params.items()]
    metrics = [Metric(metric_key(k), v, rec.end_ms, s) for k, v, s in rec.metrics]
    for i in range(0, max(len(params), 1), 100):
        client.log_batch(rid, params=params[i : i + 100])
    for i in range(0, len(metrics), 1000):
        client.log_batch(rid, metrics=metrics[i : i + 1000])
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
    remote = uri.startswith(("http://", "https://", "databricks"))
    for m in rec.models:
        if remote:  # a server accepts only sources inside the run's artifacts: upload the folder there
            name = Path(m["source"]).name
            client.log_artifacts(rid, m["source"], artifact_path=f"model/{name}")
            m = {**m, "source": f"{run.info.artifact_uri}/model/{name}"}
        register(client, m, rid)
    for e in rec.evals:
        promote(client, e)
    client.set_terminated(rid, rec.status, end_time=rec.end_ms)


def register(client: Any, m: dict[str, Any], run_id: str) -> str:
    """A model version for the folder ``m['source']``, linked to its run, DVC md5 and parent version."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(m["name"])
    except MlflowException:
        pass  # exists
    parent = find_version_by_md5(client, m["parent_md5"]) if m.get("parent_md5") else None
    tags = {"dvc_md5": m["md5"], "run_id": run_id,
            "parent_version": f"{parent.name}/{parent.version}" if parent else ""}
    mv = client.create_model_version(m["name"], source=m["source"], run_id=run_id, tags=tags)
    client.set_registered_model_alias(m["name"], "candidate", mv.version)
    return mv.version


def promote(client: Any, e: dict[str, Any]) -> bool:
    """Tag the evaluated version with its metric; move ``champion`` to it if it beats the current one."""
    from mlflow.exceptions import MlflowException

    mv = find_version_by_md5(client, e["md5"])
    if mv is None:
        return False  # not a registered model (base, or an older checkpoint)
    client.set_model_version_tag(mv.name, mv.version, e["metric"], str(e["value"]))
    try:
        champ = client.get_model_version_by_alias(mv.name, "champion")
        best = float(champ.tags.get(e["metric"], "-inf"))
    except MlflowException:
        best = float("-inf")
    if e["value"] > best:
        client.set_registered_model_alias(mv.name, "champion", mv.version)
        return True
    return False


def find_version_by_md5(client: Any, md5: str) -> Any:
    """The newest registered model version whose ``dvc_md5`` tag is ``md5`` (None if none)."""
    found = client.search_model_versions(f"tags.dvc_md5 = '{md5}'")
    return max(found, key=lambda v: int(v.version)) if found else None


# ------------------------------------------------------------------------------------------ outbox
def outbox_dir(params: Params, root: Path) -> Path:
    return root / params.tracking.outbox


def to_outbox(rec: StageRecord, box: Path) -> Path:
    """Write the record and a copy of its artifacts (they may change before the replay)."""
    rid = f"{rec.start_ms}-{rec.stage}-{uuid.uuid4().hex[:8]}"
    folder = box / rid
    files = folder / "artifacts"
    files.mkdir(parents=True)
    copied = []
    for a in rec.artifacts:
        p = Path(a)
        dst = files / p.name if p.is_dir() else files / p.parent.name / p.name  # same artifact paths on replay
        dst.parent.mkdir(parents=True, exist_ok=True)
        if p.is_dir():
            shutil.copytree(p, dst)
        elif p.is_file():
            shutil.copy2(p, dst)
        copied.append(str(dst))
    data = asdict(rec) | {"artifacts": copied}
    tmp = folder / "record.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(folder / "record.json")
    return folder


def sync(box: Path, uri: str, root: Path | None) -> tuple[int, int]:
    """Replay every outbox record to ``uri``; a sent record is removed. Returns (sent, left)."""
    sent = left = 0
    for rec_file in sorted(box.glob("*/record.json")):
        data = json.loads(rec_file.read_text())
        data["metrics"] = [tuple(m) for m in data["metrics"]]
        try:
            send(StageRecord(**data), uri, root)
        except Exception as e:
            log.warning("outbox %s not sent: %s", rec_file.parent.name, e)
            left += 1
            continue
        shutil.rmtree(rec_file.parent)
        sent += 1
    return sent, left


@contextmanager
def stage_run(stage: str, params: Params, root: Path = Path(".")) -> Iterator[None]:
    """Track the stage run in the ``with`` body (see module docstring). Tracking never fails the stage."""
    if not params.tracking.enabled:
        yield
        return
    start = int(time.time() * 1000)
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    finally:
        t0 = time.time()
        try:
            rec = build_record(stage, params, root, start, status)
        except Exception as e:
            log.warning("tracking: could not collect the %s run: %s", stage, e)
            rec = None
        if rec is not None:
            uri = store_uri(params, root)
            try:
                rid = send(rec, uri, root)
                log.info("tracked as MLflow run %s (%s) in %.2fs", rid, uri, time.time() - t0)
            except Exception as e:
                try:
                    folder = to_outbox(rec, outbox_dir(params, root))
                except Exception as box_err:  # never hide the stage's own outcome (or exception) behind this
                    log.error("tracking store %s unreachable (%s: %s) and the outbox %s is not writable (%s: %s): "
                              "this %s run is not tracked", uri, type(e).__name__, str(e)[:200],
                              outbox_dir(params, root), type(box_err).__name__, box_err, stage)
                else:
                    log.warning("tracking store %s unreachable or refused the run (%s: %s): run kept in %s; "
                                "`posttrain tracking sync` sends it", uri, type(e).__name__, str(e)[:200], folder)


def start_parent(params: Params, root: Path, name: str, tags: dict[str, str] | None = None) -> str | None:
    """Create a parent run for one pipeline invocation; None (with a warning) when the store is down."""
    if not params.tracking.enabled:
        return None
    try:
        client = _client(store_uri(params, root))
        exp_id = _experiment_id(client, params.tracking.experiment, root)
        run = client.create_run(exp_id, tags={"mlflow.runName": name, "git.commit": _git(root, "rev-parse", "HEAD"),
                                              **(tags or {})}, run_name=name)
        return run.info.run_id
    except Exception as e:
        log.warning("no parent run (tracking store unreachable: %s)", type(e).__name__)
        return None


def end_parent(params: Params, root: Path, run_id: str | None, ok: bool) -> None:
    if run_id:
        try:
            _client(store_uri(params, root)).set_terminated(run_id, "FINISHED" if ok else "FAILED")
        except Exception as e:
            log.warning("could not close parent run %s: %s", run_id, e)
