"""``runtime.distributed.launcher: slurm`` (``posttrain.slurm``): the batch script, the rendezvous inside a job,
and a real Slurm cluster on this host (``munged``, ``slurmctld`` and one ``slurmd``, Debian's slurm-wlm 22.05,
installed by ``.ci/run`` as bubblewrap is): the rl stage at 2 ranks (gloo) submitted, requeued by Slurm, cancelled,
re-run, ending at the weights of an uninterrupted job. Debian's build runs one ``slurmd`` per host, so the cluster
has one node: what two nodes add (torchrun's c10d rendezvous across machines) is not run here."""

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, tiny_raw

from posttrain import runner, slurm
from posttrain.config import ConfigError, parse_params
from posttrain.errors import StageError
from posttrain.judge.server import free_port
from posttrain.runfacts import read_metrics

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def _slurm_params(tmp_path: Path, **slurm_cfg) -> object:
    raw = tiny_raw(tmp_path)
    raw["runtime"]["distributed"] = {"nproc_per_node": 2, "nnodes": 2, "launcher": "slurm", "slurm": slurm_cfg}
    return parse_params(raw)


def test_the_batch_script_asks_for_the_params_job_and_runs_the_same_stage_command_once_per_node(tmp_path):
    p = _slurm_params(tmp_path, partition="gpu", account="lab", time="04:00:00", gpus_per_node=8, mem="200G",
                      cpus_per_task=64, extra=["--qos=high", "--exclusive"])
    text = slurm.batch_script("rl", p, ["--params", "my params.yaml"])
    opts = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert opts == ["--job-name=posttrain-rl", "--nodes=2", "--ntasks-per-node=1", "--open-mode=append", "--requeue",
                    "--export=ALL", "--partition=gpu", "--account=lab", "--time=04:00:00", "--cpus-per-task=64",
                    "--mem=200G", "--gpus-per-node=8", "--qos=high", "--exclusive"]
    assert f"exec srun --kill-on-bad-exit=1 {sys.executable} -m stages.rl --params 'my params.yaml'" in text
    assert f"export {slurm.INSIDE}=1" in text and ":$(( 29500 + SLURM_JOB_ID % 1000 ))" in text  # the rendezvous
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in text  # srun 22.05-23.02 drops it otherwise
    where = slurm.submit_args(Path("/s/x.sbatch"), Path("/shared/my repo"), Path("/shared/my repo/.slurm/rl-%j.log"))
    assert where == ["sbatch", "--parsable", "--chdir=/shared/my repo", "--output=/shared/my repo/.slurm/rl-%j.log",
                     "/s/x.sbatch"]  # whole arguments: a space in a path is no problem


def test_inside_a_job_torchrun_meets_at_the_first_node_under_the_job_id(tmp_path, monkeypatch):
    p = _slurm_params(tmp_path, port=29511)
    monkeypatch.setenv(slurm.INSIDE, "1")
    monkeypatch.setenv(slurm.RDZV, "node-a:29511")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    cmd = runner.torchrun_argv("rl", p, ["--params", "x.yaml"])
    assert cmd[3:] == ["--nproc_per_node=2", "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29511",
                       "--rdzv_id=posttrain-rl-77", "-m", "stages.rl", "--params", "x.yaml"]


@pytest.mark.parametrize(("key", "value", "says"), [
    ("time", "4 hours", "runtime.distributed.slurm.time: Value error, '4 hours' is not a Slurm time limit"),
    ("extra", ["--qos high"], "slurm.extra: Value error, '--qos high': each extra sbatch option is one"),
    ("extra", ["--nodes=4"], "'--nodes=4': posttrain sets --nodes itself"),
    ("extra", ["--export=NONE"], "'--export=NONE': posttrain sets --export itself"),
    ("mem", "lots", "runtime.distributed.slurm.mem"),
    ("partiton", "gpu", "did you mean 'partition'"),
])
def test_a_bad_slurm_setting_is_one_line_naming_its_key(tmp_path, key, value, says):
    raw = tiny_raw(tmp_path)
    raw["runtime"]["distributed"] = {"launcher": "slurm", "slurm": {key: value}}
    with pytest.raises(ConfigError) as e:
        parse_params(raw)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_without_slurm_commands_the_stage_says_so_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    """launcher: slurm on a machine with no Slurm client: exit 1, one line; nothing ran, no MLflow run."""
    raw = tiny_raw(tmp_path)
    raw["runtime"]["distributed"] = {"launcher": "slurm"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sbatch, no scontrol
    monkeypatch.chdir(tmp_path)
    ran = []
    with pytest.raises(SystemExit) as e:
        runner.stage_main("rl", ran.append, ["--params", "params.yaml"], distributed=True)
    assert e.value.code == 1 and not ran
    assert capsys.readouterr().err.strip().splitlines() == [
        "posttrain rl: sbatch not found: runtime.distributed.launcher is slurm, but this machine has no Slurm client "
        "(run from a login node, or set launcher: local)"]


# --- a real cluster ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """munged + slurmctld + one slurmd on this host, in a temporary folder, on free ports; yields the environment
    that points Slurm's commands at it (``SLURM_CONF``)."""
    if not all(shutil.which(c) for c in ("munged", "slurmctld", "slurmd", "sbatch")):
        pytest.skip("Slurm is not installed (apt-get install slurmd slurmctld slurm-client munge; .ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's daemons run as root (SlurmUser=root)")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge" / "sock"
    subprocess.run(["munged", f"--socket={sock}", f"--key-file={key}", f"--log-file={d / 'munge' / 'log'}",
                    f"--pid-file={d / 'munge' / 'pid'}", f"--seed-file={d / 'munge' / 'seed'}", "--force"], check=True)
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=posttrain-test", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}", "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "ReturnToService=2", "MpiDefault=none", "JobRequeue=1", "MinJobAge=3600", "KillWait=10",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**ENV, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-i"], env=env, check=True)
    subprocess.run(["slurmd"], env=env, check=True)
    deadline = time.time() + 60
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
        assert time.time() < deadline, (d / "log" / "slurmctld.log").read_text()[-2000:]
        time.sleep(0.5)
    yield env
    subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
    for pid in ("slurmd.pid", "slurmctld.pid", "munge/pid"):
        try:
            os.kill(int((d / pid).read_text()), signal.SIGTERM)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass


def _stage(name: str, params: Path, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"stages.{name}", "--params", "params.yaml"], cwd=params.parent,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)


def _job_id(root: Path) -> str:
    deadline = time.time() + 60
    while not (f := root / ".slurm" / "rl.job").is_file():
        assert time.time() < deadline
        time.sleep(0.2)
    return f.read_text().split()[0]


def _release(job: str, env: dict) -> None:
    """Slurm holds a requeued job back for a while (its BeginTime, ~2 minutes): once it is pending again, let it
    start now."""
    deadline = time.time() + 120
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
        state = dict(kv.split("=", 1) for kv in out.split() if "=" in kv).get("JobState")
        if state == "RUNNING" and "Restarts=1" in out:
            return
        if state == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
        assert time.time() < deadline, out
        time.sleep(0.3)


def _wait_for(ckpt: Path, past: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 240
    while not any(int(p.name.split("_")[1]) > past for p in ckpt.glob("step_*")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
        time.sleep(0.1)


@pytest.mark.slow
def test_rl_as_a_slurm_job_at_2_ranks_requeued_then_cancelled_then_rerun_ends_as_an_uninterrupted_job(
        tmp_path, cluster):
    """rl (world size 2, gloo) through ``launcher: slurm``: once straight through; once requeued by Slurm after a
    checkpoint (``scontrol requeue``: what a pre-emption or a lost node does; the command follows the job through
    its restart), then cancelled after a later checkpoint (``scancel``: the command ends with one line, exit 1),
    then the same command again. Both end at the same weights and shards; the MLflow run records the job."""
    from safetensors.torch import load_file

    def raw(root: Path) -> dict:
        r = tiny_raw(root)
        r["rl"].update({"steps": 8, "checkpoint_every": 2})
        r["runtime"].update({"train_threads": 1, "generate_threads": 1})
        r["runtime"]["distributed"] = {"nproc_per_node": 2, "timeout_s": 60, "launcher": "slurm",
                                       "slurm": {"poll_s": 0.5}}
        r["tracking"] = {"enabled": True, "uri": f"sqlite:///{root / 'mlflow.db'}"}
        return r

    straight, broken = tmp_path / "straight", tmp_path / "broken"
    straight.mkdir()
    up = tiny_raw(straight)  # the upstream stages once, locally
    (straight / "params.yaml").write_text(yaml.safe_dump(up))
    for stage in ("model", "curate", "sft", "rollout", "reward"):
        p = _stage(stage, straight / "params.yaml", ENV)
        assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
    shutil.copytree(straight, broken)
    for root in (straight, broken):
        (root / "params.yaml").write_text(yaml.safe_dump(raw(root)))

    p = _stage("rl", straight / "params.yaml", cluster)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert "submitted slurm job" in err and "posttrain: slurm job" in err  # the job's own log, streamed

    p = _stage("rl", broken / "params.yaml", cluster)
    job = _job_id(broken)
    ckpt = broken / "checkpoints" / "rl"
    _wait_for(ckpt, 0, p)
    subprocess.run(["scontrol", "requeue", job], env=cluster, check=True)
    _release(job, cluster)
    restart = max(int(q.name.split("_")[1]) for q in ckpt.glob("step_*"))
    _wait_for(ckpt, restart, p)  # the restarted job got further
    subprocess.run(["scancel", job], env=cluster, check=True)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and f"posttrain rl: slurm job {job} was cancelled; re-run the same command" in err, err
    assert "(restart 1)" in err  # the command followed the job through Slurm's requeue
    assert not (broken / "models" / "rl").exists()

    p = _stage("rl", broken / "params.yaml", cluster)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    m = {r: read_metrics(r / "metrics" / "rl.json") for r in (straight, broken)}
    assert m[broken]["resumed_from_step"] > restart and m[broken]["world_size"] == 2
    for step in range(1, 9):
        a, b = (r / "data" / "rl" / "shards" / f"step_{step:05d}.parquet" for r in (straight, broken))
        assert a.read_bytes() == b.read_bytes() or _rows(a) == _rows(b), step
    w = {r: load_file(r / "models" / "rl" / "model.safetensors") for r in (straight, broken)}
    assert max(float((w[straight][k] - w[broken][k]).abs().max()) for k in w[straight]) == 0

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{broken / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id],
                              "tags.mlflow.runName = 'rl' and attributes.status = 'FINISHED'")
    tags = runs[0].data.tags
    assert tags["slurm.job_id"] != job and tags["slurm.nodes"] == socket.gethostname()
    assert tags["slurm.version"].startswith("22.") and tags["version.cuda"] == "none"


def _rows(path: Path) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["prompt_id", "sample", "completion", "reward"]).to_pylist()


def test_lineage_shows_the_job_a_stage_ran_as():
    """``posttrain lineage``'s tree: a stage whose MLflow run carries ``slurm.*`` tags gets a line naming the job."""
    from rich.console import Console

    from posttrain.lineage import Node, Out
    from posttrain.lineage.render import tree_view

    n = Node("rl", [Out("models/rl", "9b2c" * 8)], "3f9c00000000", {}, run_id="5e1a" * 8, commit="75b1cd9e41aa",
             ran_as={"slurm.job_id": "4", "slurm.nodes": "gpu[01-02]", "slurm.restarts": "1",
                     "slurm.version": "22.05.8", "cuda": "12.4"})
    con = Console(width=200, record=True)
    con.print(tree_view(n, verified=False))
    assert "slurm job 4 on gpu[01-02] (restarts 1; slurm 22.05.8, cuda 12.4)" in con.export_text()


class FakeSlurm:
    """A test double for Slurm's commands (``slurm._slurm``, ``slurm.job``): each submitted job walks through the
    states given for it. The real cluster test above covers requeue and cancel; timeouts and lost nodes cannot be
    caused on demand there."""

    def __init__(self, *lives: list[str]) -> None:
        self.lives, self.submitted, self.looks = list(lives), [], {}

    def command(self, *cmd: str) -> str:
        assert cmd[0] == "sbatch" and cmd[1] == "--parsable"
        self.submitted.append(str(100 + len(self.submitted)))
        return self.submitted[-1] + "\n"

    def job(self, job_id: str):
        life = self.lives[int(job_id) - 100]
        k = self.looks[job_id] = self.looks.get(job_id, -1) + 1
        state = life[min(k, len(life) - 1)]
        return slurm.Job(job_id, state, 3 if state == "FAILED" else 0, 0, "n1", "NonZeroExitCode" if state ==
                         "FAILED" else "None")


def _follow(tmp_path, monkeypatch, fake: FakeSlurm, resubmits: int = 3) -> int:
    tmp_path.mkdir(exist_ok=True)
    p = _slurm_params(tmp_path, poll_s=0.001, resubmits=resubmits)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(slurm, "_slurm", fake.command)
    monkeypatch.setattr(slurm, "job", fake.job)
    return slurm.run_job("rl", p, ["--params", "params.yaml"])


def test_a_timed_out_or_preempted_job_is_submitted_again_until_it_completes(tmp_path, monkeypatch, capsys):
    fake = FakeSlurm(["PENDING", "RUNNING", "TIMEOUT"], ["RUNNING", "PREEMPTED"], ["RUNNING", "COMPLETED"])
    assert _follow(tmp_path, monkeypatch, fake) == 0
    assert fake.submitted == ["100", "101", "102"]
    err = capsys.readouterr().err
    assert "slurm job 100 ended TIMEOUT; submitting it again (1 of 3)" in err
    assert "slurm job 101 ended PREEMPTED; submitting it again (2 of 3)" in err


def test_resubmits_are_bounded_and_a_failed_job_fails_the_command(tmp_path, monkeypatch, capsys):
    fake = FakeSlurm(["NODE_FAIL"], ["NODE_FAIL"])
    assert _follow(tmp_path, monkeypatch, fake, resubmits=1) == 1
    assert fake.submitted == ["100", "101"]
    assert "slurm job 101 ended NODE_FAIL (exit code 0); its log is above" in capsys.readouterr().err


def test_a_failed_job_fails_the_command_with_its_exit_code_and_a_forgotten_job_is_one_line(tmp_path, monkeypatch,
                                                                                           capsys):
    assert _follow(tmp_path, monkeypatch, FakeSlurm(["PENDING", "RUNNING", "FAILED"])) == 3
    err = capsys.readouterr().err
    assert "slurm job 100 ended FAILED (exit code 3, NonZeroExitCode); its log is above" in err
    assert "slurm job 100 pending (None)" in err  # a waiting job is said, once

    fake = FakeSlurm(["RUNNING"])
    monkeypatch.setattr(fake, "job", lambda job_id: None)  # slurmctld forgot it (MinJobAge)
    with pytest.raises(StageError, match="slurmctld no longer knows it"):
        _follow(tmp_path / "b", monkeypatch, fake)


def test_a_rerun_follows_the_job_an_earlier_killed_command_left_running(tmp_path, monkeypatch, capsys):
    fake = FakeSlurm(["RUNNING", "RUNNING", "COMPLETED"])
    p = _slurm_params(tmp_path, poll_s=0.001)
    (tmp_path / ".slurm").mkdir()
    digest = hashlib.sha256(slurm.batch_script("rl", p, ["--params", "params.yaml"]).encode()).hexdigest()
    (tmp_path / ".slurm" / "rl.job").write_text(f"100 {digest}")
    assert _follow(tmp_path, monkeypatch, fake) == 0
    assert fake.submitted == []  # no second job writing the same outputs
    assert "following slurm job 100 (RUNNING), submitted by an earlier run" in capsys.readouterr().err


def test_a_rerun_with_other_params_cancels_the_old_job_and_submits_its_own(tmp_path, monkeypatch, capsys):
    fake = FakeSlurm(["RUNNING", "RUNNING", "CANCELLED"], ["COMPLETED"])
    (tmp_path / ".slurm").mkdir()
    (tmp_path / ".slurm" / "rl.job").write_text("100 " + "0" * 64)  # its script differed
    cancelled = []
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: cancelled.append(cmd))
    fake.submitted.append("100")  # job 100 exists already
    assert _follow(tmp_path, monkeypatch, fake) == 0
    assert cancelled == [["scancel", "100"]] and fake.submitted == ["100", "101"]
    assert "cancelling slurm job 100 (RUNNING): submitted with other params or options" in capsys.readouterr().err


def test_ctrl_c_on_the_command_cancels_its_job_and_waits_for_it_to_end(tmp_path, monkeypatch, capsys):
    fake = FakeSlurm(["RUNNING", "COMPLETING", "CANCELLED"])
    cancelled, naps = [], []

    def nap(s: float) -> None:  # Ctrl-C during the first wait, then the cancel's own waits
        naps.append(s)
        if len(naps) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(slurm.time, "sleep", nap)
    monkeypatch.setattr(slurm.subprocess, "run", lambda cmd, **kw: cancelled.append(cmd))
    assert _follow(tmp_path, monkeypatch, fake) == 130
    assert cancelled == [["scancel", "100"]] and fake.looks["100"] == 2  # asked until it left COMPLETING
    assert "interrupted: cancelled slurm job 100; re-run the same command to resume" in capsys.readouterr().err
