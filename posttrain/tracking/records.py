"""What one stage run logs to MLflow, collected after it ran: a :class:`StageRecord` (JSON-serialisable, so it
can wait in the outbox).

The params ``dvc.yaml`` declares for the stage (flattened, as DVC reads them), per-step metrics (the rows the stage
logged live, and any ``train_log.csv`` row among its outputs not seen live), final metrics (the stage's metrics
JSON at step 0; one whose key is also a per-step metric's, such as rl's ``gen_s`` total, as ``end/<key>``, so the
per-step curve has no end-of-stage spike at step 0), artifacts (its report folders and metrics file), dataset
inputs (each Parquet dep, with DVC's md5 as the digest) and tags: git commit and dirty flag, DVC stage name, the
md5 of every dep and out *as DVC computes them* (``dvc.dep.<path>``, ``dvc.out.<path>``; ``posttrain lineage``
joins ``dvc.lock`` to runs through these), hostname, device, package and CUDA versions, the Slurm job a stage ran
as (``slurm.*``: id, nodes, restarts, version) and the image it ran in (``container.*``); the model outputs to
register and
the evaluation that may move a ``champion`` alias.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain import slurm
from posttrain.config import Params, stage_metrics
from posttrain.outputs import run_facts_path
from posttrain.runfacts import read_metrics

log = logging.getLogger("tracking")
PARENT_ENV = "POSTTRAIN_MLFLOW_PARENT"
MODEL_OUTS = {"sft": ["sft_model"], "rl": ["rl_model"], "distill": ["student_sft_model", "student_model"]}
PARENT_MODEL = {"sft_model": "base_model", "rl_model": "sft_model", "student_model": "student_sft_model"}


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
    run_id: str | None = None  # the run opened at the stage's start (None: none could be), filled by ``send``
    sent: list[tuple[str, int]] = field(default_factory=list)  # (key, step) of metrics already in that run


def _git(root: Path, *args: str) -> str:
    r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def dirty(root: Path, metrics_dir: str) -> bool:
    """Tracked files changed since the commit, the pipeline's own writes left out (``dvc.lock`` and the metrics
    files its stages rewrite as they run: every stage after the first saw them and said dirty)."""
    return bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock",
                     f":(exclude){metrics_dir.rstrip('/')}"))


IMAGE_ENV = "POSTTRAIN_IMAGE"  # the image a stage runs in, name@digest: the gpu pools' templates set it
CONTAINERENV = Path("/run/.containerenv")  # podman's description of the container, inside it


def _container() -> dict[str, str]:
    """The image the stage ran in: ``POSTTRAIN_IMAGE`` (set by the kubernetes and docker gpu pools, or by hand:
    ``podman run -e POSTTRAIN_IMAGE=...``), and what podman writes in ``/run/.containerenv`` (the engine always;
    the image and its id when it is run privileged). Empty outside a container."""
    out = {"container.image": os.environ[IMAGE_ENV]} if os.environ.get(IMAGE_ENV) else {}
    if CONTAINERENV.is_file():
        for line in CONTAINERENV.read_text().splitlines():
            key, _, value = line.partition("=")
            if key in ("engine", "image", "imageid") and value.strip('"'):
                out.setdefault(f"container.{key}", value.strip('"'))
    return out


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


END = "end/"  # the prefix of a final metric whose key is also a per-step metric's


def build_record(stage: str, params: Params, root: Path, start_ms: int, status: str,
                 live: list[tuple[str, float, int]] | None = None) -> StageRecord:
    """Collect the stage's record after it ran (see module docstring). ``live``: the per-step metrics the stage
    logged as it went (``posttrain.tracking.live``); a train-log row among the outputs that is not among them
    (a stage that logs no rows live) is read from the CSV."""
    rec = StageRecord(stage, params.tracking.experiment, start_ms, int(time.time() * 1000), status,
                      os.environ.get(PARENT_ENV) or None)
    deps, outs, declared = dvc_hashes(root, stage)
    if not declared:  # outside a DVC repo: the stage's own section (evaluate@<name>: evaluate's; "@" is not a
        section = stage.split("@")[0]  # name MLflow takes, so a record keyed by it was refused at every sync)
        declared = {section: params.model_dump(mode="json").get(section), "seed": params.seed}
    for k, v in flatten(declared).items():  # the params dvc.yaml declares for the stage, as DVC reads them
        rec.params[k] = json.dumps(v) if isinstance(v, list | dict) else str(v)
    torch = sys.modules.get("torch")  # curate never imports it
    rec.tags = {"dvc.stage": stage, "git.commit": _git(root, "rev-parse", "HEAD"),
                "git.dirty": str(dirty(root, params.paths.metrics_dir)),
                "hostname": socket.gethostname(), "platform": platform.platform(),
                "device": "cuda" if torch is not None and torch.cuda.is_available() else "cpu", **_versions(),
                "version.cuda": (torch.version.cuda or "none") if torch is not None else "none", **slurm.tags(),
                **_container(),
                **{f"dvc.dep.{p}": h for p, h in deps.items()}, **{f"dvc.out.{p}": h for p, h in outs.items()}}
    metrics_file = root / stage_metrics(params.paths.metrics_dir, stage)
    paths = params.paths.model_dump()
    reports = {v for k, v in paths.items() if k.endswith("report_dir")}
    report_outs = [root / p for p in outs if any(p == r or p.startswith(r.rstrip("/") + "/") for r in reports)]
    live = list(live or [])
    seen = {(k, step) for k, _, step in live}
    rec.metrics += live + [m for m in _train_logs(report_outs) if (m[0], m[2]) not in seen]
    per_step = {k for k, _, _ in rec.metrics}
    if metrics_file.is_file():  # the stage's final numbers, run facts too; one that shares a per-step key (rl's
        for k, v in flatten(read_metrics(metrics_file)).items():  # gen_s: the run's total beside each step's) is
            if isinstance(v, int | float) and not isinstance(v, bool):  # END/k, not a spike at step 0 of that curve
                rec.metrics.append((f"{END}{k}" if k in per_step else k, float(v), 0))
        rec.artifacts += [str(f.resolve()) for f in (metrics_file, run_facts_path(metrics_file)) if f.is_file()]
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
