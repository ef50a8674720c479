"""Shared fixtures: a tiny, fast configuration rooted in a temp folder."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
# The benchmark files some tests read (GSM8K, MATH-500, HumanEval, ...; docs/real-models.md#benchmark-files): the
# folder $POSTTRAIN_BENCH names. Unset or without the file, those tests skip saying so: a clone needs nothing
# outside itself (.ci/run sets it on our machines).
BENCH = Path(os.environ.get("POSTTRAIN_BENCH") or "/POSTTRAIN_BENCH-is-unset")


def bench_file(name: str) -> Path:
    """``$POSTTRAIN_BENCH/name``, or the calling test skipped with the reason."""
    f = BENCH / name
    if not f.is_file():
        pytest.skip(f"{name} not in $POSTTRAIN_BENCH ({os.environ.get('POSTTRAIN_BENCH') or 'unset'})")
    return f


def repo_params() -> dict[str, Any]:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def tiny_raw(root: Path | None) -> dict[str, Any]:
    """The repo's params.yaml shrunk to seconds of CPU, every path under ``root`` (None: kept relative)."""
    p = copy.deepcopy(repo_params())
    if root is not None:
        p["paths"] = {k: str(root / v) for k, v in p["paths"].items()}
    p["evaluate"]["models"] = {k: p["paths"][f"{k}_model"] for k in ("base", "sft", "rl", "student_sft", "student")}
    p["runtime"]["progress"] = False
    p["tracking"]["enabled"] = False  # tests that track say so
    p["model"]["tiny"] = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
                          "max_position_embeddings": 128}
    p["curate"]["sources"][0]["num_rows"] = 300
    p["curate"]["eval"]["rows"] = 12
    p["curate"]["sft_size"] = 100
    p["sft"].update({"phases": [{"steps": 6, "cot_frac": 1.0}, {"steps": 2, "cot_frac": 0.5}],
                     "batch_size": 8, "micro_batch_size": 4, "warmup_steps": 2, "checkpoint_every": 3,
                     "log_every": 2})
    p["rollout"].update({"num_prompts": 8, "samples_per_prompt": 4, "generate_batch_size": 64})
    p["rollout"]["sampling"]["max_new_tokens"] = 24
    # an untrained tiny policy never solves the task: a length penalty gives groups reward variance
    p["reward"]["rewards"] = [{"name": "correct", "weight": 1.0},
                              {"name": "overlong", "weight": 1.0, "kwargs": {"buffer": 24}}]
    p["rl"].update({"steps": 4, "prompts_per_step": 4, "samples_per_prompt": 4, "micro_batch_size": 8,
                    "checkpoint_every": 2, "select": {"min_pass_rate": 0.0, "max_pass_rate": 1.0}})
    p["rl"]["sampling"]["max_new_tokens"] = 24
    p["distill"]["teacher"] = p["paths"]["rl_model"]
    p["distill"]["student"] = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 32,
                               "max_position_embeddings": 128}
    for phase in ("warmup", "on_policy"):
        p["distill"][phase].update({"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 2})
    p["distill"].update({"grpo_steps": 2, "max_new_tokens": 24, "micro_batch_size": 8, "checkpoint_every": 2})
    p["evaluate"].update({"samples_per_prompt": 4, "ks": [1, 2, 4], "generate_batch_size": 64, "bootstrap": 50})
    p["evaluate"]["sampling"]["max_new_tokens"] = 24
    return p


def copy_repo(dst: Path, raw: dict[str, Any]) -> None:
    """A git repo at ``dst`` with this repo's tracked files (no dvc.lock, no metrics) and ``raw`` as params.yaml."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file() and not f.startswith(("metrics/", "dvc.lock", "benchmarks/results/")):
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)
    text = (REPO / "params.yaml").read_text().split("\n")[0] + "\n" + yaml.safe_dump(raw, sort_keys=False)
    (dst / "params.yaml").write_text(text)  # first line: the file's header comment
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dst, check=True)


@pytest.fixture
def tiny(tmp_path: Path) -> dict[str, Any]:
    return tiny_raw(tmp_path)


@pytest.fixture(scope="session")
def _empty_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow sqlite store made by MLflow itself, once a session: creating a store runs MLflow's schema
    migrations (1-2 s each time), which a dozen tracking tests paid each."""
    from posttrain.tracking import store

    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    store.mlflow_client(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_uri(tmp_path: Path, _empty_mlflow_db: Path) -> str:
    """A fresh, real MLflow sqlite store at ``tmp_path / "mlflow.db"`` (a copy of the session's empty one). That
    is also where a ``tiny_raw(tmp_path)`` repo with tracking on writes by default: a test that checks no store
    was created must not take this fixture."""
    shutil.copy(_empty_mlflow_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def GradCapture(params):  # noqa: N802 (used like the optimizer class it builds)
    """An optimizer that records the gradient it is asked to step with (``.grads``) and moves nothing
    (``training.accumulate`` clears ``.grad`` after its step, so the gradient must be read inside it)."""
    import torch  # (conftest stays torch-free for the tests that are)

    class _Capture(torch.optim.Optimizer):
        def __init__(self, ps):
            super().__init__(ps, {})
            self.grads = []

        def step(self, closure=None):
            self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for g in self.param_groups for p in g["params"]]

    return _Capture(params)


def import_base(p: Any) -> None:
    """The model stage's output (``paths.base_model``) for params ``p``: what sft starts from."""
    from stages import model

    model.run(p, *model.paths(p))


def tiny_model(cfg: Any, seed: int) -> tuple[Any, Any]:
    """``model.base: tiny`` built as the model stage builds it (prompt format applied): (model, tokenizer)."""
    import tempfile

    from posttrain.modeling import imports

    with tempfile.TemporaryDirectory() as work:
        model, tok, _ = imports.import_base(cfg, seed, Path(work))
    return model, tok
