"""Prefect flows on real Prefect: the in-process flow on an ephemeral server (fast suite); a real
``prefect server`` with a cpu and a gpu process worker, deployments, routing and a killed worker (slow)."""

from __future__ import annotations

import json
import os
import shutil
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

from posttrain.config import ConfigError
from posttrain.errors import StageError
from posttrain.runfacts import read_metrics


def _env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PREFECT_HOME": str(home),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90", "PREFECT_LOGGING_LEVEL": "INFO",
           "PREFECT_WORKER_QUERY_SECONDS": "2",  # workers poll every 2 s (default 10), as the README advises
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


@pytest.mark.slow  # over 2 s: out of the fast suite
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


@pytest.mark.slow  # over 2 s: out of the fast suite
@pytest.mark.parametrize("override, says", [("rl.lr=[1", "not valid YAML"), ("rl.lr", "expected key.path=value")])
def test_malformed_override_exits_2_in_one_line_naming_it(tmp_path, monkeypatch, capsys, override, says):
    from flows import pipeline

    repo = _repo(tmp_path)
    monkeypatch.chdir(repo)
    monkeypatch.setattr(pipeline, "pipeline", lambda **kw: pytest.fail("the flow started"))
    with pytest.raises(SystemExit) as e:
        pipeline.main(["-S", override])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert repr(override) in err and says in err


def test_consecutive_gpu_stages_share_one_remote_run():
    from flows.pipeline import _groups, group_name

    res = {"curate": "cpu", "sft": "gpu", "rollout": "gpu", "reward": "cpu", "rl": "gpu", "distill": "gpu",
           "evaluate": "gpu", "report": "cpu"}
    stages = [s for s in res if s != "evaluate"]
    stages[-1:-1] = ["evaluate@sft", "evaluate@rl"]  # a foreach stage's instances take its class
    assert _groups(stages, res) == [("cpu", ["curate"]), ("gpu", ["sft", "rollout"]), ("cpu", ["reward"]),
                                    ("gpu", ["rl", "distill", "evaluate@sft", "evaluate@rl"]), ("cpu", ["report"])]
    assert _groups(stages, {}) == [("cpu", [s]) for s in stages]  # routing off: all in process
    # the group's task name (issue 46 finding 11: "rl+distill+evaluate@student+evaluate@student_sft+..." before)
    assert group_name(["rl", "distill", "evaluate@sft", "evaluate@rl"]) == "gpu: rl .. evaluate@rl (4 stages)"
    assert group_name(["sft"]) == "gpu: sft"


def test_posttrain_deploy_runs_flows_deploy_as_a_subprocess_and_never_imports_flows(tmp_path):
    """``posttrain deploy`` validates, then runs ``python -m flows.deploy`` with its own interpreter and passes
    its exit code through; the library never imports the flows (an import-linter contract)."""
    repo = _repo(tmp_path)
    code = ("import subprocess, sys\n"
            "from typer.testing import CliRunner\n"
            "from posttrain.cli import app\n"
            "calls = []\n"
            "subprocess.call = lambda cmd, **kw: calls.append(cmd) or 3\n"
            "r = CliRunner().invoke(app, ['deploy', '--pools', 'gpu', '--cron', '0 4 * * *'])\n"
            "print(r.exit_code, calls[0][1:], [m for m in sys.modules if m.split('.')[0] == 'flows'])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=_env(tmp_path), capture_output=True, text=True)
    assert out.stdout.split(" ", 1) == ["3", "['-m', 'flows.deploy', '--repo', '.', '--cron', '0 4 * * *', "
                                             "'--pools', 'gpu'] []\n"], out.stderr[-2000:]
    bogus = subprocess.run([sys.executable, "-m", "posttrain.cli", "deploy", "--pools", "bogus"], cwd=repo,
                           env=_env(tmp_path), capture_output=True, text=True)
    assert bogus.returncode == 2 and bogus.stderr.strip().splitlines() == [
        "posttrain: --pools: cpu, gpu or cpu,gpu, got 'bogus'"]


def test_flows_deploy_prints_one_name_and_id_per_deployment(monkeypatch, capsys):
    from flows import deploy

    made = {"posttrain-pipeline/default": "1", "posttrain-pipeline/nightly-evaluate": "2"}
    monkeypatch.setattr(deploy, "deploy", lambda repo, cron, pools: made if pools == ("cpu",) else {})
    deploy.main(["--pools", "cpu"])
    assert capsys.readouterr().out.splitlines() == ["posttrain-pipeline/default: 1",
                                                    "posttrain-pipeline/nightly-evaluate: 2"]


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
@pytest.mark.extended  # CI leaves it out (time): make test-extended
def test_two_machines_share_only_the_server_and_a_dvc_remote_and_a_killed_worker_resumes(tmp_path):
    """Two checkouts as two machines: a cpu worker in one, a gpu worker in the other, each with its own DVC
    cache, MLflow store and PREFECT_HOME; in common only a real ``prefect server`` and a DVC remote (a local
    folder here; S3/GCS/SSH remotes are the same code path). The deployed pipeline routes gpu stages to the
    other checkout; its gpu worker is killed mid-rl and restarted, and the re-run resumes rl from its checkpoint.
    Both checkouts end with every output pullable and ``posttrain lineage --verify`` passing, and the gpu
    stages ran with the gpu environment's interpreter (``prefect.gpu_python``)."""
    raw = tiny_raw(None)
    raw["rl"].update({"steps": 40, "checkpoint_every": 2})  # long enough to kill the gpu worker mid-rl
    raw["evaluate"]["models"] = {k: raw["evaluate"]["models"][k] for k in ("rl", "student")}  # evaluate@rl, @student
    raw["report"]["compare"] = [["rl", "student"]]
    raw["prefect"]["dvc_remote"] = "store"
    # the gpu machine's stage environment (prefect.gpu_python): a stand-in interpreter that logs each stage
    # command it runs, then runs it with this interpreter
    gpu_python, gpu_log = tmp_path / "venv-gpu" / "bin" / "python", tmp_path / "venv-gpu" / "ran.log"
    gpu_python.parent.mkdir(parents=True)
    gpu_python.write_text(f'#!/bin/sh\necho "$@" >> "{gpu_log}"\nexec "{sys.executable}" "$@"\n')
    gpu_python.chmod(0o755)
    raw["prefect"]["gpu_python"] = str(gpu_python)
    src = tmp_path / "src"
    copy_repo(src, raw)
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "store", str(tmp_path / "remote")], cwd=src,
                   check=True, capture_output=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "remote"], cwd=src,
                   check=True)
    repos = {pool: tmp_path / pool for pool in ("cpu", "gpu")}
    for repo in repos.values():
        subprocess.run(["git", "clone", "-q", str(src), str(repo)], check=True)
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {pool: _env(tmp_path / f"prefect-{pool}", api) for pool in repos}
    procs = Procs(tmp_path)
    try:
        procs.start("server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], {**env["cpu"], "PREFECT_API_URL": ""}, src)
        _wait(lambda: _healthy(api), 120, "prefect server")
        for pool, repo in repos.items():  # each machine deploys its own pool's flows from its own checkout
            dep = subprocess.run([sys.executable, "-m", "flows.deploy", "--repo", str(repo), "--pools", pool],
                                 cwd=repo, env=env[pool], capture_output=True, text=True, timeout=300)
            assert dep.returncode == 0, dep.stderr[-3000:]

        def worker(pool: str) -> None:
            procs.start(f"worker-{pool}", [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
                        env[pool], repos[pool])

        def trigger(*extra: str) -> str:
            r = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "posttrain-pipeline/default",
                                *extra], cwd=repos["cpu"], env=env["cpu"], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, r.stderr[-2000:]
            return next(line.split()[-1] for line in r.stdout.splitlines() if "UUID" in line)

        worker("cpu")
        worker("gpu")
        first = trigger()
        ckpt = repos["gpu"] / "checkpoints" / "rl"
        _wait(lambda: any(ckpt.glob("step_*/meta.json")), 600, "rl's first resumable checkpoint", every=0.5)
        before = {pool: _mtimes(repos[pool], paths) for pool, paths in (
            ("cpu", ["data/curated", "data/reward"]), ("gpu", ["models/sft", "data/rollout"]))}
        assert not (repos["cpu"] / "checkpoints" / "rl").exists()  # rl runs in the other checkout only
        procs.kill("worker-gpu")  # the gpu machine's worker dies mid-rl, with the flow run it was executing
        procs.kill("worker-cpu")  # and the pipeline run waiting on it
        worker("gpu")
        worker("cpu")
        second = trigger("--param", "exp_name=after-kill")  # re-run the deployment

        def done():
            run = next((r for r in _runs(env["cpu"]) if r["id"] == second), None)
            return run if run and run["state"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"} else None

        final = _wait(done, 900, "the re-run pipeline", every=5)
        assert final["state"] == "COMPLETED", (tmp_path / "worker-cpu.log").read_text()[-4000:]

        runs = _runs(env["cpu"])
        parent = next(r for r in runs if r["id"] == second)
        assert parent["flow"] == "posttrain-pipeline" and parent["pool"] == "cpu"
        stage_runs = [r for r in runs if r["flow"] == "posttrain-stage"]
        resources = raw["prefect"]["resources"]
        on_gpu = {s.split("@")[0] for r in stage_runs for s in r["params"]["stages"]}  # evaluate@sft: evaluate
        assert on_gpu == {s for s, c in resources.items() if c == "gpu"}  # every gpu stage, no cpu stage
        assert all(r["pool"] == "gpu" and r["params"].get("repo") in (None, str(repos["gpu"]))
                   for r in stage_runs)  # in the gpu machine's own checkout
        assert {s for r in stage_runs if r["state"] == "COMPLETED" for s in r["params"]["stages"]} >= {
            "rl", "distill", "evaluate@rl", "evaluate@student"}
        ran = {line.split()[1].removeprefix("stages.") for line in gpu_log.read_text().splitlines()
               if line.startswith("-m stages.")}
        assert ran == on_gpu  # gpu stages, and only they, ran with the gpu environment's interpreter

        # nothing that had completed before the kill ran again; rl resumed from its checkpoint
        for pool, mt in before.items():
            assert _mtimes(repos[pool], list(mt)) == mt
        rl = read_metrics(repos["gpu"] / "metrics" / "rl.json")
        assert rl["resumed_from_step"] >= 2 and rl["shards"] == 40
        stages = {"model", "curate", "sft", "rollout", "reward", "rl", "distill", "evaluate@rl", "evaluate@student",
                  "report"}
        for pool, repo in repos.items():  # each machine: a complete dvc.lock, every output pullable, lineage ok
            lock = yaml.safe_load((repo / "dvc.lock").read_text())
            # the gpu checkout hears of cpu stages when its next gpu group starts: report (cpu) ran after the last
            assert set(lock["stages"]) == (stages if pool == "cpu" else stages - {"report"}), pool
            for out in ("models/student", "data/rl"):
                shutil.rmtree(repo / out)
            # the gpu checkout pulls what it has lock entries for: its last stage and everything upstream
            pull = ["dvc", "pull", "--remote", "store"] + ([] if pool == "cpu" else ["--with-deps", "evaluate@student"])
            for cmd in (pull, ["posttrain.cli", "lineage", "models/student", "--verify"]):
                r = subprocess.run([sys.executable, "-m", *cmd], cwd=repo, env=env[pool], capture_output=True,
                                   text=True, timeout=300)
                assert r.returncode == 0, f"{pool}: {cmd}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        assert first != second
        exps = subprocess.run([sys.executable, "-m", "dvc", "exp", "list", "--all-commits"], cwd=repos["cpu"],
                              env=env["cpu"], capture_output=True, text=True)
        assert "after-kill" in exps.stdout  # exp_name: the finished run is a DVC experiment
    finally:
        procs.stop_all()


def _gpu_pool_on_the_server(repo: Path, env: dict) -> dict:
    """``prefect.gpu_pool_type: kubernetes``: ``flows.deploy --pools gpu`` creates the pool with the GPU template
    (the server accepts it: its placeholders are declared); asking for a docker pool of the same name then is
    one line, exit 2. Returns the pool as the server holds it."""
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["prefect"].update({"gpu_pool_type": "kubernetes", "gpus": 2, "image": "posttrain-worker:{commit}",
                           "dvc_remote": "storage"})
    (repo / "params.yaml").write_text(yaml.safe_dump(raw))
    dep = subprocess.run([sys.executable, "-m", "flows.deploy", "--repo", str(repo), "--pools", "gpu"], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=300)
    assert dep.returncode == 0, dep.stderr[-3000:]
    raw["prefect"]["gpu_pool_type"] = "docker"
    (repo / "params.yaml").write_text(yaml.safe_dump(raw))
    again = subprocess.run([sys.executable, "-m", "flows.deploy", "--repo", str(repo), "--pools", "gpu"], cwd=repo,
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "is of type kubernetes" in again.stderr, again.stderr[-3000:]
    r = subprocess.run([sys.executable, "-c", "import json; from prefect.client.orchestration import get_client\n"
                        "with get_client(sync_client=True) as c:\n"
                        "    print(c.read_work_pool('gpu').model_dump_json())\n"
                        "    print(c.read_deployment_by_name('posttrain-stage/gpu').model_dump_json())"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    pool, dep = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    # a pod runs the image's checkout: the entrypoint relative to its working directory, no path of this machine
    assert dep["entrypoint"] == "flows/pipeline.py:stage_flow" and not dep["pull_steps"]
    assert "repo" not in dep["parameters"] and dep["job_variables"]["image"] == f"posttrain-worker:{head}"
    return pool


@pytest.mark.slow
def test_the_nightly_deployment_gets_scheduled_runs_from_the_servers_scheduler(tmp_path):
    """``flows.deploy``'s cron deployment on a real ``prefect server``: the scheduler service creates its runs.
    Then the gpu pool as a kubernetes pool with the GPU template (``_gpu_pool_on_the_server``).
    With SQLAlchemy 2.1.9 (unpinned before) the scheduler failed every loop ("Can't evaluate bulk DML
    statement") and the nightly deployment never ran (watched: no scheduled run in 90 s)."""
    repo = _repo(tmp_path)
    api = f"http://127.0.0.1:{_free_port()}/api"
    env = _env(tmp_path / "prefect", api) | {"PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    procs = Procs(tmp_path)
    try:
        procs.start("server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               api.split(":")[-1].removesuffix("/api")], {**env, "PREFECT_API_URL": ""}, repo)
        _wait(lambda: _healthy(api), 120, "prefect server")
        dep = subprocess.run([sys.executable, "-m", "flows.deploy", "--repo", str(repo), "--pools", "cpu",
                              "--cron", "*/10 * * * *"], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=300)
        assert dep.returncode == 0, dep.stderr[-3000:]
        scheduled = _wait(lambda: [r for r in _runs(env) if r["state"] == "SCHEDULED"], 90, "scheduled runs",
                          every=3)
        pool = _gpu_pool_on_the_server(repo, env)
    finally:
        procs.stop_all()
    assert {r["params"].get("target") for r in scheduled} == {"report"}  # the nightly-evaluate deployment's
    assert pool["type"] == "kubernetes"
    container = pool["base_job_template"]["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert pool["base_job_template"]["variables"]["properties"]["gpus"]["default"] == 2
    assert "Can't evaluate bulk DML" not in (tmp_path / "server.log").read_text()


@pytest.mark.slow
def test_two_overlapping_flow_runs_each_run_with_their_own_params(tmp_path):
    """The in-process flow on Prefect's ephemeral server, twice at once: the nightly run and a manual run with
    overrides start together in one checkout. Both complete, each one's stage ran (and was tracked in MLflow)
    with its own params, params.yaml is the checkout's own again after each (a run's overrides hold for that run
    only), and dvc.lock records the params of the run that finished last. Re-runs with those params skip; with
    the other run's params, curate comes back from DVC's run-cache."""
    repo = _repo(tmp_path)
    text = (repo / "params.yaml").read_text()
    raw = yaml.safe_load(text)
    raw["tracking"]["enabled"] = True
    own = text.split("\n")[0] + "\n" + yaml.safe_dump(raw, sort_keys=False)
    (repo / "params.yaml").write_text(own)
    assert raw["curate"]["eval"]["rows"] not in (10, 11)  # both overrides differ from the checkout's params
    procs = []
    for i, size in enumerate((10, 11)):
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
    assert seen == [("10", 10.0), ("11", 11.0)]  # each ran, and was recorded, with its own override
    first, last = (int(r.data.params["curate.eval.rows"]) for r in sorted(runs, key=lambda r: r.info.end_time))
    assert (repo / "params.yaml").read_text() == own  # the overrides held for their runs only
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert lock["stages"]["curate"]["params"]["params.yaml"]["curate"]["eval"]["rows"] == last  # what DVC recorded

    for rows, status in ((last, "skipped"), (first, "restored")):  # restored: DVC's run-cache has that run
        again = _flow(repo, tmp_path / "prefect0", "--target", "curate", "-S", f"curate.eval.rows={rows}")
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads(again.stdout.strip().splitlines()[-1]) == {"curate": status}
        # issue 46 #11: a stage DVC skipped ends in a state of its own, not drawn as one that ran
        assert ("Task run 'curate' - Finished in state Skipped(" in again.stderr) == (status == "skipped")
        assert (repo / "params.yaml").read_text() == own
    assert read_metrics(repo / "metrics" / "curate.json")["eval"] == first  # the restored outputs


def test_gpu_stage_commands_find_the_gpu_environments_interpreter_first(tmp_path, monkeypatch):
    from flows import tasks

    fake = tmp_path / "venv-gpu" / "bin" / "python"  # stands for .venv-gpu/bin/python
    fake.parent.mkdir(parents=True)
    fake.write_text(f'#!/bin/sh\necho gpu-env "$@"\nexec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    cmd = "python -c 'import sys; print(sys.prefix)'"  # as DVC runs a stage's cmd: through the shell
    monkeypatch.setattr(tasks, "STAGE_PYTHON", [str(fake)])
    out = subprocess.run(cmd, shell=True, env=tasks._env(), capture_output=True, text=True).stdout.split("\n")
    assert out[0] == "gpu-env -c import sys; print(sys.prefix)" and out[1] == sys.prefix  # the venv is kept
    monkeypatch.setattr(tasks, "STAGE_PYTHON", [])
    out = subprocess.run(cmd, shell=True, env=tasks._env(), capture_output=True, text=True).stdout
    assert out.strip() == sys.prefix and "gpu-env" not in out  # cpu stages: this interpreter


def test_a_failed_run_ends_with_the_stages_own_line():
    """Issue 46 #8: a failed deployment run said only ``Failed``; a config error's run logged a traceback. The
    flows end Failed with one line as the state's message (``tasks.failed``): a stage's own ``posttrain ...`` line
    out of DVC's output, else the error's first line."""
    from flows.tasks import one_line

    dvc_out = StageError("python -m dvc repro --single-item rl exited 1:\nRunning stage 'rl':\n> python -m stages.rl\n"
                         "posttrain rl: data/curated/train.parquet does not exist: run the stages upstream of rl "
                         "first\nERROR: failed to reproduce 'rl': failed to run: python -m stages.rl, exited with 1\n")
    assert one_line(dvc_out) == ("posttrain rl: data/curated/train.parquet does not exist: run the stages upstream "
                                 "of rl first")
    assert one_line(ConfigError("params.yaml: rl.lerning_rate: unknown key")) == \
        "posttrain: params.yaml: rl.lerning_rate: unknown key"
    assert one_line(StageError("")) == "posttrain: StageError"
