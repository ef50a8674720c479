"""Slow end-to-end tests: a real SIGKILL of rl and distill and resume (sft: tests/test_distributed.py); the
real-model DAG under dvc repro on a temp copy of the repo."""

import json
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
from conftest import REPO, copy_repo, tiny_raw
from safetensors.torch import load_file

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
    shutil.copytree(straight, tmp_path / "killed")
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
    m = {n: json.loads((tmp_path / n / "metrics" / f"{stage}.json").read_text()) for n in runs}
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


def pq_rows(path: Path) -> list[tuple]:
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["prompt_id", "sample", "completion", "reward", "used"])
    return list(zip(*[t.column(c).to_pylist() for c in t.column_names], strict=True))


def _dvc(repo: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def _lineage(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.cli", "lineage", *args], cwd=repo, env=ENV,
                          capture_output=True, text=True)


def _check_tracking_and_lineage(repo: Path, rl_steps: int, models: tuple[str, ...]) -> None:
    """Seven stage runs nested under one parent in the sqlite store; the student's lineage is the DAG;
    --verify passes, then fails naming the one flipped byte of the RL checkpoint."""
    from posttrain.tracking import mlflow_client

    client = mlflow_client(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id])
    parents = [r for r in runs if r.info.run_name == "pipeline"]
    assert len(parents) == 1
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) == {"model", "curate", "sft", "rollout", "reward", "rl", "distill", "report",
                             *(f"evaluate@{m}" for m in models)}
    assert len(client.get_metric_history(children["rl"].info.run_id, "reward_mean")) == rl_steps  # every step
    assert client.get_model_version_by_alias("posttrain-student", "candidate").tags["parent_version"] == \
        "posttrain-student_sft/1"

    r = _lineage(repo, "models/student", "--json", "--verify")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    tree = json.loads(r.stdout)["tree"]
    seen: dict[str, list[str]] = {}

    def walk(n):
        seen[n["stage"]] = sorted(p["stage"] for p in n["parents"])
        if n["stage"] in ("rollout", "rl", "distill"):  # what sampled, with its version
            assert n["metrics"]["generator"].startswith("hf (transformers "), n["metrics"]
        assert n["mlflow_run_id"] == children[n["stage"]].info.run_id  # each lock entry joined with its run
        for p in n["parents"]:
            walk(p)

    walk(tree)
    assert seen == {"distill": ["curate", "rl"], "rl": ["curate", "reward", "sft"], "reward": ["rollout"],
                    "rollout": ["curate", "sft"], "sft": ["curate", "model"], "curate": [],
                    "model": []}  # dvc.yaml's DAG
    assert "contaminated" in json.dumps(tree)  # the curate node carries the decontamination verdict

    weights = repo / "models" / "rl" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    r = _lineage(repo, "models/student", "--verify")
    assert r.returncode == 1 and "models/rl/model.safetensors: changed" in r.stdout
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))


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


def test_real_model_dag_on_gsm8k_with_lora(tmp_path):
    """The real-run profile (profiles/real-gsm8k.yaml) shrunk to minutes: the 7-stage DAG under `dvc repro` on a
    Qwen2-architecture model + byte-level BPE tokenizer built offline (tests/realmodel.py), GSM8K rows scored by
    math-verify, eval on GSM8K-test and MATH-500 subsets, decontamination against the shared benchmarks, LoRA
    on (bf16 base, fp32 adapters), a KL reference by adapter-off, and a pretrained-style student of the same
    tokenizer. Random weights learn nothing; the path is what is checked."""
    from transformers import AutoModelForCausalLM

    from tests.realmodel import save_folder

    base = save_folder(tmp_path / "qwen2-base", hidden=32, layers=2, vocab_size=400)
    student = save_folder(tmp_path / "qwen2-student", hidden=16, layers=1, vocab_size=400, seed=1)
    raw = yaml.safe_load((REPO / "profiles" / "real-gsm8k.yaml").read_text())
    bench = REPO.parent / "shared" / "benchmarks"

    def src(name, fmt, limit):
        return {"kind": "file", "name": name, "path": str(bench / f"{name}.jsonl"), "format": fmt, "limit": limit}

    raw["model"].update({"base": str(base), "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}})
    raw["curate"].update({"sources": [src("gsm8k_train", "gsm8k", 300)], "sft_size": 100})
    raw["curate"]["eval"] = {"source": src("gsm8k_test", "gsm8k", 40), "rows": 16}
    raw["curate"]["decontam"]["benchmarks"] = [src("math500", "math", None), src("aime24", "math", None),
                                               src("amc2023", "math", None)]
    raw["sft"].update({"phases": [{"steps": 3, "cot_frac": 1.0}], "batch_size": 8, "micro_batch_size": 4,
                       "warmup_steps": 1, "checkpoint_every": 2, "log_every": 1})
    # num_prompts: null, as profiled: every prompt
    raw["rollout"].update({"samples_per_prompt": 2, "generate_batch_size": 256})
    raw["reward"]["rewards"].append({"name": "overlong", "weight": 1.0, "kwargs": {"buffer": 16}})
    raw["rl"].update({"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 4, "micro_batch_size": 8,
                      "kl_coef": 0.05, "dynamic_sampling": "off",
                      "select": {"min_pass_rate": 0.0, "max_pass_rate": 1.0}})
    raw["distill"].update({"student": str(student), "max_new_tokens": 16, "micro_batch_size": 8, "grpo_steps": 0})
    for phase in ("warmup", "on_policy"):
        raw["distill"][phase].update({"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2})
    models = ("sft", "rl", "student")  # one evaluate@<name> stage each
    raw["evaluate"]["models"] = {m: raw["evaluate"]["models"][m] for m in models}
    raw["report"]["compare"] = [["sft", "rl"]]
    raw["evaluate"].update({"samples_per_prompt": 2, "sample_prompts": 4, "ks": [1, 2], "bootstrap": 20,
                            "generate_batch_size": 64, "benchmarks": [src("math500", "math", 8)]})
    for sec in (raw["rollout"], raw["rl"], raw["evaluate"]):
        sec["sampling"]["max_new_tokens"] = 16
    raw["tracking"]["enabled"] = True
    raw["runtime"]["progress"] = False
    repo = tmp_path / "repo"
    copy_repo(repo, raw)

    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "repro"], cwd=repo, env=ENV, capture_output=True,
                       text=True)  # dvc repro under one MLflow parent run
    assert r.returncode == 0, r.stderr[-4000:]
    for stage in ("curate", "sft", "rollout", "reward", "rl", "distill", "report", *(f"evaluate@{m}" for m in models)):
        assert f"Running stage '{stage}'" in r.stdout + r.stderr
    metrics = {s: json.loads((repo / "metrics" / f"{s}.json").read_text())
               for s in ("curate", "sft", "rollout", "reward", "rl", "distill", "report")}
    evals = {m: json.loads((repo / "metrics" / "evaluate" / f"{m}.json").read_text()) for m in models}
    cur = metrics["curate"]  # counts reconcile: every row read is kept, quarantined, a duplicate or contaminated
    assert cur["in"] == 300 and cur["kept"] + cur["quarantined"] + cur["duplicates"] + cur["contaminated"] == cur["in"]
    assert cur["kept"] == cur["train"] + cur["sft"]
    assert {"math500", "aime24", "amc2023", "eval_split"} >= set(cur["contaminated_by_benchmark"])
    train = pd_rows(repo / "data" / "curated" / "train.parquet")
    assert metrics["rollout"]["prompts"] == metrics["rollout"]["train_prompts"] == len(train) == cur["train"]
    from posttrain.schema import join_rollouts

    scored = join_rollouts(repo / "data" / "rollout" / "rollouts.parquet", repo / "data" / "reward" / "rewards.parquet",
                           ["task"]).to_pylist()  # num_prompts null: every prompt scored
    assert len(scored) == metrics["rollout"]["samples"] == 2 * len(train)
    assert all(r["task"] == "math" and json.loads(r["rewards"])["correct"] is not None for r in scored[:50])
    for name in ("sft", "rl", "student_sft", "student"):  # LoRA: merged folders, adapters beside them
        folder = repo / "models" / name
        assert (folder / "adapter" / "adapter_config.json").is_file(), name
        m = AutoModelForCausalLM.from_pretrained(folder)
        assert not any("lora" in k for k in m.state_dict()), name
        assert sorted(m.generation_config.eos_token_id) == [0, 2], name  # <|endoftext|> and <|im_end|>
    assert all(set(evals[m]) == {"eval", "math500"} and evals[m]["eval"]["n"] > 0 for m in models)
    assert list(metrics["report"]["eval"]) == ["sft vs rl"] and "greedy" in metrics["report"]["eval"]["sft vs rl"]
    assert metrics["rl"]["shards"] == raw["rl"]["steps"]
    _check_tracking_and_lineage(repo, raw["rl"]["steps"], models)  # MLflow runs + registry; lineage tree, --verify

    assert "Data and pipelines are up to date" in _dvc(repo, "repro")  # a second repro is a no-op
    raw["report"]["compare"] = [["sft", "student"]]  # a report-only param: no model is evaluated again
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    out = _dvc(repo, "repro")
    assert "Running stage 'report'" in out and "Running stage 'evaluate@" not in out
    assert all(f"Running stage '{s}'" not in out for s in ("curate", "sft", "rollout", "reward", "rl", "distill"))
    shown = _dvc(repo, "metrics", "show")
    assert "report.json" in shown and "evaluate/student.json" in shown


def pd_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
