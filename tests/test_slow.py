"""Slow end-to-end tests: a real SIGKILL of rl and distill and resume (sft: tests/test_distributed.py). The
real-model DAG under dvc repro: tests/test_smollm2.py."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, tiny_raw
from safetensors.torch import load_file

from posttrain.runfacts import read_metrics

pytestmark = pytest.mark.slow
# dvc.yaml runs `python -m stages.<name>`: the interpreter running the tests must be the `python` on PATH
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


def _stage(name: str, params: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"stages.{name}", "--params", str(params)], cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_checkpoint_then_kill(proc: subprocess.Popen, ckpt: Path) -> int:
    deadline = time.time() + 120
    while not list(ckpt.glob("step_*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.3)  # a little past the first checkpoint
    assert proc.poll() is None, "the stage finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return max(int(p.stem.split("_")[1]) for p in ckpt.glob("step_*"))


def _straight_and_killed(tmp_path: Path, stage: str, upstream: tuple[str, ...], edit, model: str,
                         before_kill=None, after_kill=None) -> tuple[dict[str, dict], int]:
    """Two copies of a tiny config (``edit`` applied): upstream stages in both, ``stage`` straight through in
    one and SIGKILLed after its first resumable checkpoint then re-run in the other. ``before_kill`` edits the
    killed copy's params for its first (killed) run only; ``after_kill(root, killed_at)`` looks at the killed
    copy right after the kill. Returns each copy's metrics/<stage>.json and the step the killed run had
    checkpointed."""
    runs = {}
    for name in ("straight", "killed"):
        root = tmp_path / name
        raw = tiny_raw(root)
        edit(raw)
        runs[name] = (root, raw)
    straight, _ = runs["straight"]
    straight.mkdir()
    (straight / "params.yaml").write_text(yaml.safe_dump(runs["straight"][1]))
    for up in upstream:  # once; the killed copy starts from the same upstream outputs (no absolute paths in them)
        assert _stage(up, straight / "params.yaml").wait() == 0
    # each copy its own store: a checkout copied with its mlflow.db is refused (tracking/store.py, issue 46 #3)
    shutil.copytree(straight, tmp_path / "killed", ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    (tmp_path / "killed" / "params.yaml").write_text(yaml.safe_dump(runs["killed"][1]))
    runs = {name: root / "params.yaml" for name, (root, _) in runs.items()}
    assert _stage(stage, runs["straight"]).wait() == 0

    final = runs["killed"].read_text()
    if before_kill is not None:
        raw = yaml.safe_load(final)
        before_kill(raw)
        runs["killed"].write_text(yaml.safe_dump(raw))
    proc = _stage(stage, runs["killed"])
    killed_at = _wait_for_checkpoint_then_kill(proc, tmp_path / "killed" / "checkpoints" / stage)
    assert killed_at > 0 and not (tmp_path / "killed" / "models" / model).exists()
    if after_kill is not None:
        after_kill(tmp_path / "killed", killed_at)
    runs["killed"].write_text(final)
    assert _stage(stage, runs["killed"]).wait() == 0
    m = {n: read_metrics(tmp_path / n / "metrics" / f"{stage}.json") for n in runs}
    assert m["killed"]["resumed_from_step"] >= killed_at
    return m, killed_at


def _live_rows_survive_the_kill(root: Path, killed_at: int) -> None:
    """Live telemetry: the killed run's train log has every step up to the kill, in the CSV and in its MLflow
    run (still RUNNING: nobody ended it), at most the row being logged at the kill missing from MLflow."""
    from mlflow import MlflowClient

    lines = (root / "reports" / "rl" / "train_log.csv").read_text().splitlines()
    steps = [int(line.split(",")[0]) for line in lines[1:]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= killed_at
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id],
                                "attributes.run_name = 'rl'")
    assert run.info.status == "RUNNING"
    logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    assert logged == steps[: len(logged)] and len(logged) >= len(steps) - 1, (logged, steps)


def test_rl_sigkill_then_rerun_resumes_without_repeating_or_skipping_steps(tmp_path):
    """A killed run resumes exactly (same shards, same final reward), its per-step rows up to the kill are in
    the CSV and in MLflow (live telemetry), and a run killed while it had fewer ``rl.steps`` continues when
    re-run with more (20 -> 30) instead of starting over (``rl.steps`` is not part of the fingerprint)."""

    def edit(raw: dict) -> None:
        raw["rl"].update({"steps": 30, "checkpoint_every": 5})
        root = Path(raw["paths"]["metrics_dir"]).parent  # each copy its own store
        raw["tracking"] = {"enabled": True, "uri": f"sqlite:///{root / 'mlflow.db'}"}

    m, killed_at = _straight_and_killed(tmp_path, "rl", ("model", "curate", "sft", "rollout", "reward"), edit, "rl",
                                        before_kill=lambda raw: raw["rl"].update({"steps": 20}),
                                        after_kill=_live_rows_survive_the_kill)
    runs = ("straight", "killed")
    assert m["killed"]["shards"] == m["straight"]["shards"] == 30
    assert m["killed"]["final_reward"] == m["straight"]["final_reward"]
    logs = {n: (tmp_path / n / "reports" / "rl" / "train_log.csv").read_text().splitlines() for n in runs}
    assert [line.split(",")[0] for line in logs["killed"]] == [line.split(",")[0] for line in logs["straight"]]
    for step in (1, killed_at + 1, 30):  # the same rollouts before, right after, and long after the crash
        shard = {n: pq_rows(tmp_path / n / "data" / "rl" / "shards" / f"step_{step:05d}.parquet") for n in runs}
        assert shard["killed"] == shard["straight"]
    # the sample ledger alone says so (issue 49 item 8): the same split, the same prompts step by step, in order
    from posttrain.config import load_params
    from posttrain.lineage.ledger import ledger

    led = {n: ledger(tmp_path / n, load_params(tmp_path / n / "params.yaml")) for n in runs}
    assert len(led["killed"]["steps"]) == 30 and led["killed"]["split"]["sha256"] is not None
    assert led["killed"] == led["straight"]


def pq_rows(path: Path) -> list[tuple]:
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["prompt_id", "sample", "completion", "reward", "used"])
    return list(zip(*[t.column(c).to_pylist() for c in t.column_names], strict=True))


@pytest.mark.extended  # CI leaves it out (time): make test-extended
def test_distill_sigkill_then_rerun_resumes_to_the_same_student(tmp_path):
    def edit(raw):
        raw["distill"]["on_policy"]["steps"] = 40
        raw["distill"]["checkpoint_every"] = 5

    _straight_and_killed(tmp_path, "distill", ("model", "curate", "sft", "rollout", "reward", "rl"), edit, "student")
    runs = ("straight", "killed")
    logs = {n: (tmp_path / n / "reports" / "distill" / "train_log.csv").read_text().splitlines() for n in runs}
    strip = [[",".join(line.split(",")[:-1]) for line in logs[n]] for n in runs]  # drop the seconds column
    assert strip[0] == strip[1]
    w = {n: load_file(tmp_path / n / "models" / "student" / "model.safetensors") for n in runs}
    for k in w["straight"]:
        torch.testing.assert_close(w["killed"][k], w["straight"][k], rtol=1e-5, atol=1e-6)
    # the sample ledger alone says so (issue 49 item 8): the same prompts step by step, sampled by the same model
    from posttrain.config import load_params
    from posttrain.lineage.ledger import distill_ledger

    led = {n: distill_ledger(tmp_path / n, load_params(tmp_path / n / "params.yaml")) for n in runs}
    assert len(led["killed"]["steps"]) == 2 + 40 + 2 and led["killed"] == led["straight"]


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130,
                                                                           marks=pytest.mark.extended)])
def test_an_interrupted_stage_says_so_in_one_line_and_its_run_ends_killed(tmp_path, sig, code):
    """Issue 46, finding 9: Ctrl-C in a stage printed a 94-line traceback, and a SIGTERM'd stage left its MLflow
    run RUNNING (SIGTERM's default action ends the process with no cleanup). Now either signal is one line with
    the resume hint, the shell's exit code for it, and a KILLED run; the re-run resumes from the checkpoint."""
    from mlflow import MlflowClient

    raw = tiny_raw(tmp_path)
    raw["sft"].update({"phases": [{"steps": 400, "cot_frac": 0.5}], "checkpoint_every": 5})
    raw["tracking"] = {"enabled": True, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "t"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    for up in ("model", "curate"):
        assert _stage(up, tmp_path / "params.yaml").wait() == 0
    proc = _stage("sft", tmp_path / "params.yaml")
    deadline = time.time() + 120
    while not list((tmp_path / "checkpoints" / "sft").glob("step_*")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == code, err[-3000:]
    last = max(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints" / "sft").glob("step_*[0-9]"))
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"posttrain sft: interrupted; re-run the same command to resume from step {last} (its checkpoint in "
        f"{raw['paths']['sft_checkpoints']})")
    client = MlflowClient(raw["tracking"]["uri"])
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id], "attributes.run_name = 'sft'")
    assert run.info.status == "KILLED"


@pytest.mark.slow
def test_a_stage_started_before_its_upstream_refuses_in_one_line_before_any_work(tmp_path):
    """Issue 46, finding 9: rl started with no curated data or SFT model failed after opening an MLflow run
    (left FAILED), with the stage's own error deep in its work. Now the missing input is one line and exit 1,
    and nothing is written: no MLflow store, no output."""
    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "t"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    proc = _stage("rl", tmp_path / "params.yaml")
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [f"posttrain rl: {raw['paths']['curated_dir']}/train.parquet does not exist: "
                                        "run the stages upstream of rl first (`dvc repro rl` or `posttrain repro`)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # no mlflow.db, no output
