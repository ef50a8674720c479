"""A stage as a Slurm job: ``runtime.distributed.launcher: slurm`` (docs/clusters.md).

The stage command (``python -m stages.rl``, as ``dvc repro``, ``dvc exp run`` and the Prefect gpu worker run it)
writes a batch script, submits it with ``sbatch``, streams the job's log into its own stderr, and exits with the
job's status; inside the job ``srun`` starts the same command once per node, which becomes torchrun there
(``runner.torchrun_argv``: the node count, the first node as rendezvous, the job id as rendezvous id, from
Slurm's environment). A job that timed out, was pre-empted or lost a node is submitted again, up to
``slurm.resubmits`` times, and resumes from the stage's checkpoint; one that Slurm itself requeues (``--requeue``)
is followed through its restarts. A cancelled job ends the command with one line (re-run to resume); Ctrl-C or
SIGTERM on the command cancels its job and waits for it to end. A command killed outright leaves the job
running: the next run of the stage follows that job if it was submitted with the same script (params, options,
command), and cancels it first otherwise.

Why sbatch and not ``submitit``: a stage is already a command with its own resume, so there is nothing to pickle;
submitit's value (running a Python callable, its own checkpoint protocol) would sit beside ours, and a generated
batch script is one a cluster's admin can read and run by hand. Slurm's commands are the whole interface here:
no daemon of ours, no scheduler of ours.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from posttrain.config import Params
from posttrain.errors import StageError

INSIDE = "POSTTRAIN_SLURM_JOB"  # set in the batch script: the stage runs as the job, it does not submit again
RDZV = "POSTTRAIN_RDZV"  # host:port of the job's first node, set in the batch script
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD", "STOPPED"}
AGAIN = {"TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL"}  # not the job's fault: submit it again


def inside() -> bool:
    """True in the job's processes (the batch script sets ``INSIDE``)."""
    return os.environ.get(INSIDE) == "1"


def batch_script(name: str, params: Params, argv: list[str]) -> str:
    """The sbatch script of stage ``name``: options from ``runtime.distributed.slurm``, one task per node, each
    running ``python -m stages.<name> <argv>`` with this interpreter (the checkout and its environment sit on
    the cluster's shared file system). Where it runs and logs is on sbatch's command line (``submit_args``)."""
    d = params.runtime.distributed
    s = d.slurm
    opts = [f"--job-name=posttrain-{name.replace('@', '-')}", f"--nodes={d.nnodes}", "--ntasks-per-node=1",
            "--open-mode=append", "--requeue", "--export=ALL"]
    opts += [f"--{k}={v}" for k, v in (("partition", s.partition), ("account", s.account), ("time", s.time),
                                       ("cpus-per-task", s.cpus_per_task), ("mem", s.mem)) if v is not None]
    opts += [f"--gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else []
    stage = " ".join(shlex.quote(a) for a in [sys.executable, "-m", f"stages.{name.split('@')[0]}", *argv])
    return "\n".join([
        "#!/bin/bash", f"# posttrain stage {name}: written by posttrain.slurm, submitted with "
        "`sbatch --parsable --chdir=<checkout> --output=<log> <this file>`",
        *[f"#SBATCH {o}" for o in [*opts, *s.extra]],
        f"export {INSIDE}=1",
        # the port from the job id: two jobs sharing a node do not meet at one port
        f'export {RDZV}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):'
        f'$(( {s.port} + SLURM_JOB_ID % 1000 ))"',
        # srun of Slurm 22.05-23.02 does not inherit --cpus-per-task: each node's torchrun would get one CPU
        '[ -n "${SLURM_CPUS_PER_TASK:-}" ] && export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        'echo "posttrain: slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0})"',
        f"exec srun --kill-on-bad-exit=1 {stage}", ""])


def submit_args(script: Path, cwd: Path, log: Path) -> list[str]:
    """sbatch's command line for ``script``: the working directory and the log (``%j``: the job id) as whole
    arguments, so a path with spaces stays one."""
    return ["sbatch", "--parsable", f"--chdir={cwd}", f"--output={log}", str(script)]


@dataclass(frozen=True)
class Job:
    """What ``scontrol show job`` says of a job."""

    id: str
    state: str  # JobState, e.g. RUNNING, COMPLETED, CANCELLED
    exit_code: int  # the batch script's exit code (ExitCode=N:signal)
    restarts: int
    nodes: str
    reason: str


def _slurm(*cmd: str) -> str:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise StageError(f"{cmd[0]} not found: runtime.distributed.launcher is slurm, but this machine has no "
                         "Slurm client (run from a login node, or set launcher: local)") from None
    except subprocess.TimeoutExpired:
        raise StageError(f"{' '.join(cmd[:2])}: no answer from slurmctld in 120 s") from None
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise StageError(f"{' '.join(cmd[:2])}: {lines[-1] if lines else 'failed'}")
    return r.stdout


def job(job_id: str) -> Job | None:
    """The job's state from slurmctld (None once it has forgotten the job: ``MinJobAge`` after its end). A
    slurmctld that does not answer is asked again (3 times, 5 s apart) before the stage fails."""
    for attempt in range(3):
        try:
            out = _slurm("scontrol", "show", "job", "-o", job_id)
            break
        except StageError as e:
            if "Invalid job id" in str(e):
                return None
            if attempt == 2:
                raise
            time.sleep(5)
    f = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return Job(job_id, f.get("JobState", "UNKNOWN"), int(f.get("ExitCode", "0:0").split(":")[0] or 0),
               int(f.get("Restarts", "0")), f.get("NodeList", ""), f.get("Reason", ""))


def version() -> str:
    """``slurm-wlm 22.05.8`` -> ``22.05.8`` (empty without a Slurm client)."""
    try:
        return subprocess.run(["scontrol", "--version"], capture_output=True, text=True, timeout=30).stdout.split()[-1]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return ""


def tags() -> dict[str, str]:
    """Where a stage inside a job ran, for its MLflow record (``tracking.records``): job id, nodes, restarts,
    Slurm's version. Empty outside a Slurm job."""
    if "SLURM_JOB_ID" not in os.environ:
        return {}
    return {"slurm.job_id": os.environ["SLURM_JOB_ID"], "slurm.nodes": os.environ.get("SLURM_JOB_NODELIST", ""),
            "slurm.restarts": os.environ.get("SLURM_RESTART_COUNT", "0"), "slurm.version": version()}


class _Tail:
    """Copies what the job appends to its log into ``to`` (the stage command's stderr)."""

    def __init__(self, path: Path, to: TextIO) -> None:
        self.path, self.to, self.pos = path, to, 0

    def __call__(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        self.pos += len(data)
        if data:
            self.to.write(data.decode(errors="replace"))
            self.to.flush()


def _cancel(job_id: str, poll_s: float) -> None:
    """scancel, then wait (at most 2 minutes) until the job's processes are gone: a re-run right after does not
    find it still COMPLETING and writing."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    deadline = time.monotonic() + 120
    while (j := job(job_id)) is not None and j.state in ACTIVE and time.monotonic() < deadline:
        time.sleep(min(poll_s, 2.0))


def run_job(name: str, params: Params, argv: list[str]) -> int:
    """Submit stage ``name`` (or follow its job already running), stream its log, resubmit a job that timed
    out, was pre-empted or lost a node; return the exit status for the stage command. The job runs in this
    process's working directory (``argv`` and ``paths.*`` may be relative to it), as ``slurm.log_dir`` is."""
    s = params.runtime.distributed.slurm
    root = Path.cwd()
    logs = (root / s.log_dir).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    tag = name.replace("@", "-")
    pointer = logs / f"{tag}.job"  # "<job id> <sha256 of its script>": the job last submitted for this stage
    text = batch_script(name, params, argv)
    digest = hashlib.sha256(text.encode()).hexdigest()
    say = lambda msg: print(f"posttrain {name}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    job_id, tries, seen = None, 0, ""
    try:
        if pointer.is_file() and (old := job((pointer.read_text().split() or [""])[0])) is not None \
                and old.state in ACTIVE:
            if pointer.read_text().split()[1:] == [digest]:  # the same command, params and options: follow it
                job_id = old.id
                say(f"following slurm job {job_id} ({old.state}), submitted by an earlier run of this command")
            else:  # submitted with other params: its outputs would not be this run's
                say(f"cancelling slurm job {old.id} ({old.state}): submitted with other params or options")
                _cancel(old.id, s.poll_s)
        while True:
            if job_id is None:
                script = logs / f"{tag}.sbatch"
                script.write_text(text)
                out = _slurm(*submit_args(script, root, logs / f"{tag}-%j.log")).strip()
                job_id = out.split(";")[0]
                if ";" in out:
                    raise StageError(f"sbatch submitted job {out} to another cluster; posttrain follows jobs of "
                                     "the local cluster only (drop --clusters)")
                pointer.write_text(f"{job_id} {digest}")
                say(f"submitted slurm job {job_id} ({params.runtime.distributed.nnodes} node(s)); log "
                    f"{logs / f'{tag}-{job_id}.log'}")
            tail, j = _Tail(logs / f"{tag}-{job_id}.log", sys.stderr), None
            while (j := job(job_id)) is not None and j.state in ACTIVE:
                if j.state != "RUNNING" and f"{j.state} {j.reason}" != seen:  # waiting: say why, once a change
                    seen = f"{j.state} {j.reason}"
                    say(f"slurm job {job_id} {j.state.lower()} ({j.reason})")
                tail()
                time.sleep(s.poll_s)
            tail()
            if j is None:
                raise StageError(f"slurm job {job_id}: slurmctld no longer knows it (MinJobAge); see its log")
            if j.state == "COMPLETED":
                return 0
            if j.state in AGAIN and tries < s.resubmits:
                tries += 1
                say(f"slurm job {job_id} ended {j.state}; submitting it again ({tries} of {s.resubmits}): it "
                    "resumes from its last checkpoint")
                job_id = None
                continue
            if j.state == "CANCELLED":
                say(f"slurm job {job_id} was cancelled; re-run the same command to resume from its last checkpoint")
                return 1
            why = f", {j.reason}" if j.reason not in ("", "None") else ""
            say(f"slurm job {job_id} ended {j.state} (exit code {j.exit_code}{why}); its log is above")
            return j.exit_code or 1
    except KeyboardInterrupt as e:  # the command stopped (Ctrl-C, SIGTERM: runner._terminated): its job stops too
        if job_id is not None:
            _cancel(job_id, s.poll_s)
        say(f"interrupted{f': cancelled slurm job {job_id}' if job_id else ''}; re-run the same command to resume")
        return 143 if str(e) == "SIGTERM" else 130
