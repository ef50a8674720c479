"""What every stage's ``main()`` shares: load params (exit 2 on a bad config), set threads and seeds, track
the run in MLflow (``posttrain.tracking``; the store lives beside the params file).

A stage module looks like::

    def run(params, inputs, out) -> dict: ...      # pure of params.yaml, argv and path choices
    def main() -> None:
        stage_main("curate", lambda p: run(p, inputs_from(p), outs_from(p)))
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from posttrain import allocator, seeds, slurm
from posttrain.config import EXIT_CONFIG_ERROR, ConfigError, Params, load_params, repo_root
from posttrain.config.sandbox import ENV as SANDBOX_ENV
from posttrain.dvcrestore import restore_outputs
from posttrain.errors import StageError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if "torch" in sys.modules:  # stages that never import torch (curate) do not pay for it
        sys.modules["torch"].manual_seed(seed)


def setup(params: Params) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ[SANDBOX_ENV] = params.sandbox.model_dump_json()  # every process of the stage runs code alike
    if params.runtime.keep_freed_memory:
        allocator.keep_freed_memory()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(params.runtime.train_threads)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    seed_everything(params.seed)


# errno -> what to do: faults of the machine or of the paths in params.yaml, not bugs
_IO_FAULTS = {
    errno.ENOSPC: "no space left on the device: free space (old checkpoints, `dvc gc`) and re-run (a stage resumes "
                  "from its last checkpoint)",
    errno.EDQUOT: "disk quota exceeded: free space and re-run",
    errno.EACCES: "permission denied: make it writable (or readable), or point paths.* elsewhere",
    errno.EPERM: "operation not permitted: make it writable, or point paths.* elsewhere",
    errno.EROFS: "read-only file system: point paths.* at a writable place",
}
# A path of the wrong kind: a fault of params.yaml when it is at or under a configured path, else maybe a bug
_PATH_SHAPE = {
    errno.ENOTDIR: "a file stands where a folder is needed: check paths.*",
    errno.EEXIST: "a file stands where a folder is needed: check paths.*",  # mkdir(exist_ok=True) on a file
    errno.EISDIR: "a folder stands where a file is needed: check paths.*",
}


def expected_failure(stage: str, e: BaseException, paths: Sequence[str] = ()) -> str | None:
    """One line for a failure a user can fix (out of memory, a missing file, a full disk, a path that cannot be
    written, a file where ``paths`` (params.yaml's) want a folder), None for a bug."""
    torch = sys.modules.get("torch")
    host_oom = isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e)
    if isinstance(e, MemoryError) or host_oom or (torch is not None and isinstance(e, torch.OutOfMemoryError)):
        where = "GPU" if torch is not None and isinstance(e, torch.OutOfMemoryError) else "host"
        return (f"out of {where} memory. Lower {stage}.micro_batch_size (or the generate batch size, or "
                "max_new_tokens) and re-run: a changed micro-batch size resumes from the last checkpoint")
    if isinstance(e, FileNotFoundError):
        return f"file not found: {e.filename or e}"
    if isinstance(e, OSError) and e.errno in _IO_FAULTS:
        return f"{e.filename or 'an output'}: {_IO_FAULTS[e.errno]}"
    if isinstance(e, OSError) and e.errno in _PATH_SHAPE and e.filename:
        where = Path(str(e.filename)).resolve()
        if any(where == (p := Path(x).resolve()) or p in where.parents for x in paths):
            return f"{e.filename}: {_PATH_SHAPE[e.errno]}"
    return None


def torchrun_argv(name: str, params: Params, argv: list[str]) -> list[str]:
    """The command that runs ``python -m stages.<name> <argv>`` as ``runtime.distributed`` asks: one torchrun
    on this machine with ``nproc_per_node`` workers; with ``nnodes`` > 1 every machine runs the same command
    and torchrun's c10d rendezvous at ``rdzv_endpoint`` assigns node ranks."""
    d = params.runtime.distributed
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.nproc_per_node}"]
    if d.nnodes == 1:
        cmd += ["--standalone"]
    elif slurm.inside():  # one task per node of the job: the first node is the rendezvous, the job id its id
        cmd += [f"--nnodes={d.nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={os.environ[slurm.RDZV]}",
                f"--rdzv_id=posttrain-{name}-{os.environ.get('SLURM_JOB_ID', '')}"]
    else:
        cmd += [f"--nnodes={d.nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={d.rdzv_endpoint}",
                f"--rdzv_id=posttrain-{name}"]
    return cmd + ["-m", f"stages.{name}", *argv]


def _torchrun(name: str, cmd: list[str]) -> int:
    """Run ``cmd`` (``torchrun_argv``) with torch's own launcher in this process; a failed rank is one line
    (its own message is above it), not the launcher's traceback. The launcher stops the other ranks."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    print(f"posttrain {name}: torchrun {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the launcher's stacks too (the ranks': dist.init)
    try:
        run(parse_args(cmd[3:]))
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        how = f"killed by signal {-first.exitcode}" if first.exitcode < 0 else f"exit code {first.exitcode}"
        print(f"posttrain {name}: rank {rank} failed ({how}); the other ranks were stopped", file=sys.stderr)
        return 1
    return 0


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (a scheduler stopping the job, ``kill``) ends a stage as Ctrl-C does, not in mid-write."""
    raise KeyboardInterrupt("SIGTERM")


def resume_hint(name: str, params: Params) -> str:
    """What a re-run of an interrupted stage does, from what is on disk in its checkpoint folder
    (``paths.<stage>_checkpoints``; ``reward_model@<name>``: its ``<name>`` subfolder): the step of the newest
    complete checkpoint (sft, reward_model, rl, distill), the finished chunks (rollout), or a start from
    scratch."""
    stage, _, member = name.partition("@")
    folder = getattr(params.paths, f"{stage}_checkpoints", None)
    if folder is None:
        return "re-run the same command (this stage has no checkpoints: it starts over)"
    folder = str(Path(folder) / member) if member else folder
    steps = [int(p.name.split("_")[1]) for p in Path(folder).glob("step_*")  # complete: has checkpoint.META
             if p.is_dir() and p.name.split("_")[1].isdigit() and (p / "meta.json").is_file()]
    if steps:
        return f"re-run the same command to resume from step {max(steps)} (its checkpoint in {folder})"
    if any(Path(folder).glob("part-*.parquet")):
        return f"re-run the same command to resume after the finished chunks kept in {folder}"
    return f"re-run the same command (no checkpoint was written yet in {folder}: it starts over)"


def model_arg(argv: list[str]) -> tuple[str, list[str]]:
    """``--model NAME`` of a per-model stage (evaluate@<name>) and the remaining arguments; missing -> exit 2."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--model")
    args, rest = ap.parse_known_args(argv)
    if not args.model:
        print("posttrain: --model NAME (a key of evaluate.models) is required", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    return args.model, rest


def refuse(code: int, line: str) -> NoReturn:
    """A refusal before any work: ``line`` on stderr and exit ``code``, with the outputs ``dvc repro`` removed
    before starting this stage put back (``dvcrestore``; rank 0 only: every rank shares the workspace)."""
    if int(os.environ.get("RANK", "0")) == 0:
        restore_outputs()
    print(line, file=sys.stderr)
    sys.exit(code)


def params_arg(stage: str, argv: list[str]) -> str:
    """The ``--params`` file of ``python -m stages.<stage> argv`` (default ``params.yaml``; argparse's usage
    line and exit 2 for anything else)."""
    ap = argparse.ArgumentParser(prog=f"python -m stages.{stage}")
    ap.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return ap.parse_args(argv).params


def preflight(name: str, params_file: str, needs: Callable[[Params], Iterable[Path]] | None) -> Params:
    """The stage's params, validated (exit 2), and its ``needs`` (the inputs an upstream stage writes) looked for
    (one missing: exit 1): both refusals before any work (``refuse``)."""
    try:
        params = load_params(params_file)
    except ConfigError as e:
        refuse(EXIT_CONFIG_ERROR, f"posttrain: {e}")
    try:
        missing = [str(x) for x in (needs(params) if needs is not None else ()) if not Path(x).exists()]
    except ConfigError as e:  # e.g. --model naming no evaluate.models key
        refuse(EXIT_CONFIG_ERROR, f"posttrain: {e}")
    if missing:
        refuse(1, f"posttrain {name}: {missing[0]} does not exist: run the stages upstream of {name} first "
                  f"(`dvc repro {name}` or `posttrain repro`)")
    return params


def stage_main(name: str, body: Callable[[Params], dict[str, Any]], argv: list[str] | None = None,
               distributed: bool = False, precheck: Callable[[Params], None] | None = None,
               needs: Callable[[Params], Iterable[Path]] | None = None) -> None:
    """Parse ``--params``, validate, run ``body``; one-line errors: config -> exit 2, stage -> exit 1.

    ``precheck``: a check only the stage can make (a pinned hash, say) that must refuse before any work, the
    MLflow run included: its ConfigError is the stage's only output. ``needs``: the inputs an upstream stage
    writes; one missing is one line (exit 1) before any work, no MLflow run and no output touched.

    ``distributed``: the stage can run on several processes. With ``runtime.distributed.launcher: slurm`` the
    command submits itself as a Slurm job and follows it (``posttrain.slurm``). When ``runtime.distributed``
    asks for more than one process and this one is not a torchrun worker, it becomes torch's launcher running
    the same command under torchrun (so ``dvc.yaml`` and the Prefect workers run one command whatever the world
    size and the cluster); inside a worker it joins the process group, and only rank 0 logs at INFO, shows
    progress and records the MLflow run (the other ranks write nothing)."""
    argv = sys.argv[1:] if argv is None else argv
    params_file = params_arg(name.split("@")[0], argv)
    params = preflight(name, params_file, needs)
    rank = 0
    if distributed and params.runtime.distributed.launcher == "slurm" and not slurm.inside():
        signal.signal(signal.SIGTERM, _terminated)  # the command stopped: its job is cancelled
        try:
            sys.exit(slurm.run_job(name, params, argv))
        except StageError as e:
            print(f"posttrain {name}: {e}", file=sys.stderr)
            sys.exit(1)
    if distributed:  # (imports torch: stages that cannot run distributed, like curate, do not pay for it)
        from posttrain import distributed as dist

        d = params.runtime.distributed
        if d.world_size > 1 and not dist.launched():
            sys.exit(_torchrun(name, torchrun_argv(name, params, argv)))
        rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {name}{f'[{rank}]' if rank else ''} %(message)s", datefmt="%H:%M:%S")
    if distributed and dist.launched():
        dist.init(d.backend, d.strategy, d.timeout_for(name))
        if rank:
            params = params.model_copy(update={"runtime": params.runtime.model_copy(update={"progress": False})})
            params = params.model_copy(update={"tracking": params.tracking.model_copy(update={"enabled": False})})
    setup(params)
    if rank == 0:  # a stage killed while replacing its outputs as a set: finish the replacement first
        from posttrain.outputs import finish_commits

        finish_commits(params.paths.metrics_dir)
    if rank:
        seed_everything(seeds.process(params.seed, rank))  # dropout and other torch randomness differ per rank
    if precheck is not None:
        try:
            precheck(params)
        except ConfigError as e:
            refuse(EXIT_CONFIG_ERROR, f"posttrain: {e}")
        except StageError as e:  # e.g. pip could not reach an index
            refuse(1, f"posttrain {name}: {e}")
    t0 = time.time()
    from posttrain.tracking import stage_run

    signal.signal(signal.SIGTERM, _terminated)  # as Ctrl-C: outputs stay whole, the MLflow run ends KILLED
    try:
        with stage_run(name, params, repo_root(params_file)):  # profiles/x.yaml: the repository above it
            body(params)
            if rank == 0:  # before the MLflow run reads the metrics; rank 0's process (the others write nothing)
                from posttrain.config import stage_metrics
                from posttrain.runfacts import add_peak_rss

                try:
                    add_peak_rss(stage_metrics(params.paths.metrics_dir, name))
                except (OSError, ValueError) as e:  # the stage's outputs are whole: a fact missing fails nothing
                    logging.getLogger(name).warning("peak RSS not recorded: %s", e)
    except KeyboardInterrupt as e:
        print(f"posttrain {name}: interrupted; {resume_hint(name, params)}", file=sys.stderr)
        sys.exit(143 if str(e) == "SIGTERM" else 130)  # the shell's codes for a process ended by the signal
    except ConfigError as e:  # a config problem only the stage can see (e.g. an unknown --model name)
        print(f"posttrain: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    except StageError as e:
        print(f"posttrain {name}: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # expected failures get one line too; anything else is a bug: its traceback stays
        line = expected_failure(name, e, list(params.paths.model_dump().values()))
        if line is None:
            raise
        print(f"posttrain {name}: {line}", file=sys.stderr)
        sys.exit(1)
    finally:  # a failed stage too: a colocated vLLM engine's groups go before torch's (no exit traceback)
        if distributed:
            dist.shutdown()
    logging.getLogger(name).info("done in %.1fs", time.time() - t0)
