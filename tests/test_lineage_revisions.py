"""``posttrain lineage models:/...`` for a version the workspace's dvc.lock no longer holds (issue 49, finding 1):
registered by a ``dvc exp run`` experiment (its commit under ``refs/exps``) or at an earlier commit. A git
repository and a DVC cache made by hand: the states two runs of the pipeline would leave."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from posttrain.errors import StageError
from posttrain.lineage import trace
from posttrain.lineage.check import verify

mlflow = pytest.importorskip("mlflow")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def _cache_dir(root: Path, files: dict[str, bytes]) -> str:
    """Put a folder's files and its ``.dir`` manifest in DVC's cache layout; its hash."""
    def put(data: bytes, md5: str) -> None:
        obj = root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(data)

    entries = []
    for rel, data in sorted(files.items()):
        md5 = hashlib.md5(data).hexdigest()
        put(data, md5)
        entries.append({"md5": md5, "relpath": rel})
    manifest = json.dumps(entries).encode()
    md5 = hashlib.md5(manifest).hexdigest() + ".dir"
    put(manifest, md5)
    return md5


def _state(root: Path, curated: str, rl: str, reward: float) -> None:
    """Commit dvc.lock (curate -> rl) and rl's git-tracked metrics for one pipeline state."""
    (root / "metrics").mkdir(exist_ok=True)
    metrics = json.dumps({"final_reward": reward}).encode()
    (root / "metrics" / "rl.json").write_bytes(metrics)
    lock = {"schema": "2.0", "stages": {
        "curate": {"cmd": "python -m stages.curate", "outs": [{"path": "data/curated", "md5": curated}]},
        "rl": {"cmd": "python -m stages.rl", "deps": [{"path": "data/curated", "md5": curated}],
               "params": {"params.yaml": {"rl.lr": 1e-5 if reward > 0.6 else 3e-5}},
               "outs": [{"path": "models/rl", "md5": rl},
                        {"path": "metrics/rl.json", "md5": hashlib.md5(metrics).hexdigest()}]}}}
    (root / "dvc.lock").write_text(yaml.safe_dump(lock))
    _git(root, "add", "dvc.lock", "metrics/rl.json")
    _git(root, "commit", "-q", "-m", f"state {reward}")


def _register(uri: str, name: str, md5: str) -> str:
    from posttrain.tracking import mlflow_client

    client = mlflow_client(uri)
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    return client.create_model_version(name, "file:///nowhere", tags={"dvc_md5": md5}).version


def test_a_version_an_experiment_registered_traces_through_the_experiments_dvc_lock(tmp_path, mlflow_uri):
    """Before: ``trace`` looked for the version's hash in the workspace's dvc.lock only and refused ("an older
    pipeline state: check out the commit of its run", whose git.commit is the experiment's baseline, which never
    held that dvc.lock). Now the experiment's commit is found under ``refs/exps``, its dvc.lock walked, its
    metrics read from git at that commit, the curated folder's verdict from the cache, and ``verify`` checks
    the bytes the cache keeps for it."""
    root = tmp_path
    _git(root, "init", "-q", "-b", "main")
    curated = _cache_dir(root, {"train.parquet": b"rows", "decontamination.json": json.dumps(
        {"contaminated_rows": 2, "rows_checked": 10, "ngram": 13, "threshold": 0.5,
         "benchmarks": {"gsm8k_test": 2}}).encode()})
    v1 = _cache_dir(root, {"model.safetensors": b"weights at lr 3e-5"})
    v2 = _cache_dir(root, {"model.safetensors": b"weights at lr 1e-5"})
    _state(root, curated, v1, 0.5)
    baseline = _git(root, "rev-parse", "HEAD")
    _state(root, curated, v2, 0.7)  # what `dvc exp run -S rl.lr=1e-5 -n lr1e5` commits, under refs/exps
    exp = _git(root, "rev-parse", "HEAD")
    _git(root, "update-ref", f"refs/exps/{baseline[:2]}/{baseline[2:]}/lr1e5", exp)
    _git(root, "reset", "-q", "--hard", baseline)  # the workspace restored: dvc.lock holds v1 again
    version = _register(mlflow_uri, "posttrain-rl", v2)

    tree = trace(root, f"models:/posttrain-rl/{version}", "metrics", mlflow_uri)
    assert (tree.stage, tree.at, tree.outs[0].md5, tree.metrics) == ("rl", exp, v2, {"final_reward": 0.7})
    (up,) = tree.parents
    assert up.stage == "curate" and up.at == exp and up.verdict.startswith("2 of 10 rows dropped")
    assert verify(root, tree) == []

    obj = root / ".dvc" / "cache" / "files" / "md5" / hashlib.md5(b"weights at lr 1e-5").hexdigest()[:2]
    next(obj.iterdir()).write_bytes(b"tampered")
    assert verify(root, trace(root, f"models:/posttrain-rl/{version}", "metrics", mlflow_uri)) == [
        f"models/rl/model.safetensors: cache object changed (md5 {hashlib.md5(b'tampered').hexdigest()} != "
        f"{hashlib.md5(b'weights at lr 1e-5').hexdigest()})"]

    here = trace(root, f"models:/posttrain-rl/{_register(mlflow_uri, 'posttrain-rl', v1)}", "metrics", mlflow_uri)
    assert here.at is None and here.metrics == {"final_reward": 0.5}  # the workspace's own state: as before

    with pytest.raises(StageError, match="an output of no dvc.lock in this repository") as e:
        trace(root, f"models:/posttrain-rl/{_register(mlflow_uri, 'posttrain-rl', 'f' * 32 + '.dir')}", "metrics",
              mlflow_uri)
    assert "\n" not in str(e.value)
