"""Prefect flows on real Prefect: the in-process flow on an ephemeral server (fast suite); a real
``prefect server`` with a cpu and a gpu process worker, deployments, routing and a killed worker (slow)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import copy_repo, tiny_raw


def _env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PREFECT_HOME": str(home),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90", "PREFECT_LOGGING_LEVEL": "INFO",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    copy_repo(repo, tiny_raw(None))
    return repo


def _flow(repo: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.pipeline", *args], cwd=repo, env=_env(home),
                          capture_output=True, text=True, timeout=600)


def test_bad_override_exits_2_naming_the_key_before_prefect_starts(tmp_path, monkeypatch, capsys):
    from flows import pipeline

    repo = _repo(tmp_path)
    before = (repo / "params.yaml").read_text()
    monkeypatch.chdir(repo)
    monkeypatch.setattr(pipeline, "pipeline", lambda **kw: pytest.fail("the flow started"))
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--target", "curate", "-S", "curate.eval.sise=10"])
    assert e.value.code == 2 and "curate.eval.sise: unknown key" in capsys.readouterr().err
    assert (repo / "params.yaml").read_text() == before


def test_consecutive_gpu_stages_share_one_remote_run():
    from flows.pipeline import _groups

    res = {"curate": "cpu", "sft": "gpu", "rollout": "gpu", "reward": "cpu", "rl": "gpu", "distill": "gpu",
           "evaluate": "gpu"}
    stages = list(res)
    assert _groups(stages, res) == [("cpu", ["curate"]), ("gpu", ["sft", "rollout"]), ("cpu", ["reward"]),
                                    ("gpu", ["rl", "distill", "evaluate"])]
    assert _groups(stages, {}) == [("cpu", [s]) for s in stages]  # routing off: all in process


# ------------------------------------------------------------------------------------------ real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float, what: str, every: float = 1.0):
    end = time.time() + timeout
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def _healthy(api: str) -> bool:
    try:
        return urllib.request.urlopen(f"{api}/health", timeout=2).status == 200
    except OSError:
        return False


class Procs:
    """Background processes started in their own session; stopped by PID (SIGINT, then SIGKILL)."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, {}

    def start(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("a")
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        return p

    def kill(self, name: str) -> None:
        """SIGKILL the process and every descendant (a flow run a process worker starts gets its own session,
        so killing the worker's group alone would leave it running): a machine that dies."""
        import psutil

        p = self.procs.pop(name)
        tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        for proc in tree:
            proc.kill()
        psutil.wait_procs(tree, timeout=60)
        p.wait(timeout=60)

    def stop_all(self) -> None:
        for name, p in list(self.procs.items()):
            try:
                os.killpg(p.pid, signal.SIGINT)  # workers and the server stop on SIGINT
                p.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
            self.procs.pop(name)


def _runs(api_env: dict[str, str]) -> list:
    """Every flow run on the server (id, name, flow name, work pool, state, parent task run)."""
    code = ("import json; from prefect.client.orchestration import get_client\n"
            "with get_client(sync_client=True) as c:\n"
            "    flows = {f.id: f.name for f in c.read_flows()}\n"
            "    print(json.dumps([dict(id=str(r.id), name=r.name, flow=flows.get(r.flow_id), pool=r.work_pool_name,"
            " state=r.state_type.value if r.state_type else None, params=r.parameters) for r in c.read_flow_runs()]))")
    out = subprocess.run([sys.executable, "-c", code], env=api_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _mtimes(repo: Path, paths: list[str]) -> dict[str, float]:
    return {p: max(f.stat().st_mtime for f in (repo / p).rglob("*") if f.is_file()) for p in paths}


@pytest.mark.slow
def test_real_server_routes_gpu_stages_to_the_gpu_pool_and_survives_a_killed_worker(tmp_path):
    raw = tiny_raw(None)
    raw["rl"].update({"steps": 40, "checkpoint_every": 2})  # long enough to kill the gpu worker mid-rl
    repo = tmp_path / "repo"
    copy_repo(repo, raw)
    home, port = tmp_path / "prefect", _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _env(home, api)
    procs = Procs(tmp_path)
    try:
        procs.start("server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], {**env, "PREFECT_API_URL": ""}, repo)
        _wait(lambda: _healthy(api), 120, "prefect server")
        dep = subprocess.run([sys.executable, "-m", "flows.deploy", "--repo", str(repo)], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=300)
        assert dep.returncode == 0, dep.stderr[-3000:]
        for pool in ("cpu", "gpu"):
            procs.start(f"worker-{pool}", [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], env,
                        repo)

        def trigger(*extra: str) -> str:
            r = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "posttrain-pipeline/default",
                                *extra], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-2000:]
            return next(line.split()[-1] for line in r.stdout.splitlines() if "UUID" in line)

        first = trigger()
        ckpt = repo / "checkpoints" / "rl"
        _wait(lambda: any(ckpt.glob("step_*.pt")), 600,
              "rl's first resumable checkpoint", every=0.5)
        before = _mtimes(repo, ["data/curated", "models/sft", "data/rollout", "data/reward"])
        procs.kill("worker-gpu")  # the gpu worker dies mid-rl, with the flow run it was executing
        procs.kill("worker-cpu")  # and the pipeline run waiting on it
        procs.start("worker-gpu", [sys.executable, "-m", "prefect", "worker", "start", "--pool", "gpu"], env, repo)
        procs.start("worker-cpu", [sys.executable, "-m", "prefect", "worker", "start", "--pool", "cpu"], env, repo)
        second = trigger("--param", "exp_name=after-kill")  # re-run the deployment

        def done():
            run = next((r for r in _runs(env) if r["id"] == second), None)
            return run if run and run["state"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"} else None

        final = _wait(done, 900, "the re-run pipeline", every=5)
        assert final["state"] == "COMPLETED", (tmp_path / "worker-cpu.log").read_text()[-4000:]

        runs = _runs(env)
        parent = next(r for r in runs if r["id"] == second)
        assert parent["flow"] == "posttrain-pipeline" and parent["pool"] == "cpu"
        stage_runs = [r for r in runs if r["flow"] == "posttrain-stage"]
        resources = raw["prefect"]["resources"]
        on_gpu = {s for r in stage_runs for s in r["params"]["stages"]}
        assert on_gpu == {s for s, c in resources.items() if c == "gpu"}  # every gpu stage, no cpu stage
        assert all(r["pool"] == "gpu" for r in stage_runs)
        done = {s for r in stage_runs if r["state"] == "COMPLETED" for s in r["params"]["stages"]}
        assert done >= {"rl", "distill", "evaluate"}

        # nothing that had completed before the kill ran again; rl resumed from its checkpoint
        assert _mtimes(repo, list(before)) == before
        rl = json.loads((repo / "metrics" / "rl.json").read_text())
        assert rl["resumed_from_step"] >= 2 and rl["shards"] == 40
        lock = yaml.safe_load((repo / "dvc.lock").read_text())
        assert set(lock["stages"]) == {"curate", "sft", "rollout", "reward", "rl", "distill", "evaluate"}
        assert (repo / "metrics" / "evaluate.json").is_file()
        assert first != second
        exps = subprocess.run([sys.executable, "-m", "dvc", "exp", "list", "--all-commits"], cwd=repo, env=env,
                              capture_output=True, text=True)
        assert "after-kill" in exps.stdout  # exp_name: the finished run is a DVC experiment
    finally:
        procs.stop_all()


def test_a_worker_runs_with_the_pipelines_params_then_gets_its_own_back(tmp_path):
    """A gpu worker in its own checkout receives the pipeline's params.yaml (overrides included) instead of
    running its committed one; its own file is restored afterwards, also when a stage fails."""
    from flows.pipeline import pipeline_params

    repo = _repo(tmp_path)
    path = repo / "params.yaml"
    own = path.read_text()
    theirs = own.replace("  lr: 3.0e-05", "  lr: 1.0e-05")
    assert theirs != own
    with pytest.raises(RuntimeError):
        with pipeline_params(path, theirs):
            assert yaml.safe_load(path.read_text())["rl"]["lr"] == 1e-5
            raise RuntimeError("the stage failed")
    assert path.read_text() == own
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError):  # bad params from the pipeline: refused before the file is touched
        with pipeline_params(path, own.replace("  lr: 3.0e-05", "  lr: fast")):
            pass
    assert path.read_text() == own


def _hold(repo: str, ready, release) -> None:
    from posttrain.dvcrepo import workspace_lock

    with workspace_lock(repo, "flow run 'first'", 0):
        ready.set()
        release.wait(30)


def test_one_pipeline_run_per_workspace(tmp_path):
    """A second run waits for the first (then refuses, naming it); a killed holder frees the workspace."""
    import multiprocessing as mp

    from posttrain.dvcrepo import workspace_lock
    from posttrain.errors import StageError

    (tmp_path / ".dvc").mkdir()
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    assert ready.wait(60)
    t = time.time()
    with pytest.raises(StageError, match="in use by another pipeline run \\(flow run 'first', pid"):
        with workspace_lock(tmp_path, "second", wait_s=1.0):
            pass
    assert time.time() - t >= 1.0  # it waited before refusing
    holder.kill()
    holder.join()
    with workspace_lock(tmp_path, "second", wait_s=5.0):  # the kernel released the dead holder's lock
        pass


@pytest.mark.slow
def test_two_overlapping_flow_runs_each_run_with_their_own_params(tmp_path):
    """The in-process flow on Prefect's ephemeral server, twice at once: the nightly run and a manual run with
    overrides start together in one checkout. Both complete, each one's stage ran (and was tracked in MLflow)
    with its own params, dvc.lock records the params of the run that finished last, and a re-run skips."""
    repo = _repo(tmp_path)
    text = (repo / "params.yaml").read_text()
    raw = yaml.safe_load(text)
    raw["tracking"]["enabled"] = True
    (repo / "params.yaml").write_text(text.split("\n")[0] + "\n" + yaml.safe_dump(raw, sort_keys=False))
    procs = []
    for i, size in enumerate((10, 12)):
        procs.append(subprocess.Popen([sys.executable, "-m", "flows.pipeline", "--target", "curate", "-S",
                                       f"curate.eval.rows={size}"], cwd=repo, env=_env(tmp_path / f"prefect{i}"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(1)
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"curate": "ran"}
        assert "Running stage 'curate'" in err  # the stage's output streams into the flow's logs
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id],
                              "tags.mlflow.runName = 'curate'")
    seen = sorted((r.data.params["curate.eval.rows"], r.data.metrics["eval"]) for r in runs)
    assert seen == [("10", 10.0), ("12", 12.0)]  # each ran, and was recorded, with its own override
    last = yaml.safe_load((repo / "params.yaml").read_text())["curate"]["eval"]["rows"]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert lock["stages"]["curate"]["params"]["params.yaml"]["curate"]["eval"]["rows"] == last  # what DVC recorded
    assert "# posttrain parameters" in (repo / "params.yaml").read_text()  # rewritten as by dvc exp run -S

    again = _flow(repo, tmp_path / "prefect0", "--target", "curate")
    assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1]) == {"curate": "skipped"}
