"""Helpers around a DVC repository that DVC itself does not offer.

``clear_stale_locks``: a ``dvc repro`` killed with SIGKILL (OOM killer, a pre-empted worker) leaves its
entries in ``.dvc/tmp/rwlock``. DVC drops an entry by itself once the process is gone, but while the killed
process is a zombie (its parent has not reaped it yet; measured here: about a second after SIGKILL, and for
as long as a supervising process never waits on it) DVC counts it as alive and refuses to run ("is busy,
it is being blocked by ..."). This removes the entries of processes that are gone or zombies, so a lock
held by a live ``dvc`` is never broken.

``workspace_lock``: one pipeline invocation at a time per workspace. A flow run puts its params (overrides
applied) in ``params.yaml`` for as long as it runs; a second run in the same checkout meanwhile would run the
first one's stages with its own params (or they would collide on DVC's lock). The lock is an ``flock`` on
``.dvc/tmp/posttrain-workspace.lock``: the kernel releases it when its holder dies (a killed run never
leaves it stuck), and the file says who holds it. A second run waits up to ``wait_s`` for it, then refuses
in one line naming the holder.

``use_params``: ``params.yaml`` reads a given text for the ``with`` body (DVC and the stages read their params
from that file) and the checkout's own text again after, also when the body fails, so the next run does not
inherit an experiment's overrides. The own text waits in ``.dvc/tmp/posttrain-params.json`` meanwhile: a run
killed before it could restore it (SIGKILL, SIGTERM) is undone by the next ``workspace_lock`` holder. dvc.lock
keeps what each stage ran with, so after a run with overrides ``dvc status`` shows those stages changed.

``stage_order``: the stages of dvc.yaml in DAG order (all, or a target and its upstream).

``plan``: what ``dvc repro --single-item <stage>`` is going to do (skip it, restore its outputs from the
cache, or run it), asked of DVC's API before it runs, not read from its printed output.

``git_head``: the commit a checkout is at (a worker's must be the pipeline's).

``stage_env``: the environment that makes DVC run stage commands (``python -m stages.X``, through the shell)
with a given interpreter, e.g. the gpu environment's (``prefect.gpu_python``): a ``python`` shim first on PATH.

``lock_entries`` / ``handoff_of`` / ``receive`` / ``handoff_text`` / ``parse_handoff``: a stage run in another
checkout (a gpu worker on another machine, sharing only a DVC remote) hands back its ``dvc.lock`` entries and
its uncached outputs (the metrics files, which DVC does not push), as a fenced YAML block; the receiving
checkout merges them and ``dvc pull``s the outputs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import chdir, contextmanager
from pathlib import Path
from typing import Any, Literal

import psutil
import yaml

from posttrain.config import parse_params, read_yaml
from posttrain.errors import StageError
from posttrain.outputs import atomic_path
from posttrain.schema import write_text

log = logging.getLogger(__name__)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def clear_stale_locks(repo: str | Path = ".") -> list[str]:
    """Drop rwlock entries of dead processes; return the paths that were unlocked."""
    path = Path(repo) / ".dvc" / "tmp" / "rwlock"
    if not path.is_file():
        return []
    info = json.loads(path.read_text() or "{}")
    freed: list[str] = []
    writes = info.get("write", {})
    for p, holder in list(writes.items()):
        if not _alive(int(holder["pid"])):
            freed.append(p)
            del writes[p]
    for p, holders in list(info.get("read", {}).items()):
        live = [h for h in holders if _alive(int(h["pid"]))]
        if len(live) < len(holders):
            freed.append(p)
        if live:
            info["read"][p] = live
        else:
            del info["read"][p]
    if freed:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(info))
    return sorted(set(freed))


@contextmanager
def workspace_lock(repo: str | Path, owner: str, wait_s: float) -> Iterator[None]:
    """Hold the workspace for one pipeline invocation (see module docstring); ``owner`` says who, in the file."""
    path = Path(repo) / ".dvc" / "tmp" / "posttrain-workspace.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
                    raise StageError(f"workspace {Path(repo).resolve()} is in use by another pipeline run "
                                     f"({holder}); waited {wait_s:.0f}s (prefect.workspace_wait_s). Run the "
                                     "other one in its own clone, or wait for it") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        _undo_killed_params(Path(repo))
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _params_backup(repo: Path) -> Path:
    return repo / ".dvc" / "tmp" / "posttrain-params.json"


def _undo_killed_params(repo: Path) -> None:
    """Put back the own params.yaml a killed run left overridden (the workspace's holder calls this: no live
    run is using the file). Only if nobody edited the file since: an edit is kept, with a warning."""
    backup, path = _params_backup(repo), repo / "params.yaml"
    if not backup.is_file():
        return
    saved = json.loads(backup.read_text())
    if path.read_text() == saved["written"]:
        write_text(path, saved["own"])
        log.warning("%s: put back the checkout's own params.yaml, which a killed run left with its params", repo)
    else:
        log.warning("%s: a killed run left params.yaml with its params, edited since: kept as it is", repo)
    backup.unlink()


@contextmanager
def use_params(repo: str | Path, text: str | None) -> Iterator[None]:
    """``repo``'s params.yaml reads ``text`` for the ``with`` body, its own text again after (see module
    docstring). A no-op when ``text`` is None or what the file reads (a worker sharing the pipeline's checkout).
    Params that do not validate are refused (:class:`ConfigError`) before anything is written."""
    root = Path(repo)
    path, backup = root / "params.yaml", _params_backup(root)
    own = path.read_text()
    if text is None or text == own:
        yield
        return
    parse_params(read_yaml(text), f"params for {path}")
    write_text(backup, json.dumps({"own": own, "written": text}))
    write_text(path, text)
    try:
        yield
    finally:
        write_text(path, own)
        backup.unlink(missing_ok=True)


def _address(root: Path, stage: Any) -> str:
    """A stage's name as ``dvc`` run in ``root`` takes it (``rl``, ``evaluate@sft``, ``sub/dvc.yaml:x``):
    DVC's own ``addressing`` is relative to this process's working directory, which need not be ``root``."""
    rel = os.path.relpath(stage.path, root)
    return stage.name if rel == "dvc.yaml" else f"{rel}:{stage.name}"


def stage_order(repo: str | Path, target: str | None) -> list[str]:
    """Stages of ``repo``'s dvc.yaml in DAG order: ``target`` and everything upstream of it, or all."""
    import networkx as nx
    from dvc.repo import Repo

    root = Path(repo).resolve()
    with Repo(str(root)) as r:
        g = r.index.graph  # edges: stage -> a stage it depends on
        by_name = {_address(root, s): s for s in r.index.stages}
        if target is not None and target not in by_name:
            raise ValueError(f"target: unknown stage {target!r}; stages are {sorted(by_name)}")
        order = [_address(root, s) for s in reversed(list(nx.topological_sort(g))) if s in by_name.values()]
        if target is None:
            return order
        keep = {target} | {_address(root, s) for s in nx.descendants(g, by_name[target])}
    return [s for s in order if s in keep]


Plan = Literal["skipped", "restored", "ran"]


def plan(repo: str | Path, stage: str) -> Plan:
    """What ``dvc repro --single-item <stage>`` will do, decided as DVC 3 decides it (``Stage.reproduce``, then
    ``stage.run.run_stage`` and ``StageCache.restore``), without running or checking out anything:

    - ``skipped``: the stage is up to date (``Stage.changed()`` is false);
    - ``restored``: DVC will check its outputs out of the cache instead of running its command: its command and
      deps are as dvc.lock has them and only its outputs changed (the locked outputs are in the cache), or its
      current deps and params have a run-cache entry whose outputs are in the cache (a value tried before);
    - ``ran``: anything else (a new value, a stage the run-cache cannot hold, a missing dep: repro says why).
    """
    from dvc.dependency.base import DependencyDoesNotExistError
    from dvc.repo import Repo, lock_repo
    from dvc.stage.cache import RunCacheNotFoundError, _can_hash

    root = Path(repo).resolve()
    # chdir: DVC resolves the run-cache's stage paths ("dvc.yaml") against the working directory, as its CLI does
    with chdir(root), Repo(str(root)) as r, lock_repo(r):
        (st,) = (s for s in r.index.stages if _address(root, s) == stage)
        if not st.changed():
            return "skipped"
        try:
            if not st.changed_stage() and st.deps_cached() and all(o.hash_info for o in st.outs):
                r.stage_cache.restore(st, dry=True)  # only outputs changed: the locked ones, if cached
                return "restored"
            # restore() saves the deps, then looks the run-cache up by their hashes. Its dry mode skips that
            # save (and after saving them first, it would take the branch above and check the locked outputs
            # instead), so the same two steps here.
            st.save_deps()
            entry = r.stage_cache._load(st) if _can_hash(st) else None
        except (RunCacheNotFoundError, DependencyDoesNotExistError):
            return "ran"
        cached = entry and r.stage_cache._create_stage(entry, wdir=st.wdir).outs_cached()
        return "restored" if cached else "ran"


def stage_env(base: Mapping[str, str], python: str | None = None) -> dict[str, str]:
    """``base`` with ``python`` (None: this process's interpreter) first on PATH, through a ``python`` shim that
    execs it (a venv's interpreter keeps its venv): DVC runs a stage's ``cmd`` (``python -m stages.X``) through
    the shell, so PATH picks the interpreter the stage runs with."""
    folder = _python_shim(python) if python else Path(sys.executable).parent
    return {**base, "PATH": str(folder) + os.pathsep + base.get("PATH", "")}


def _python_shim(interpreter: str) -> Path:
    """A folder whose ``python`` execs ``interpreter`` (one per interpreter, in the temp folder)."""
    digest = hashlib.sha256(interpreter.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"posttrain-python-{digest}"
    shim, text = folder / "python", f'#!/bin/sh\nexec "{interpreter}" "$@"\n'
    if not shim.is_file() or shim.read_text() != text:
        with atomic_path(shim) as tmp:  # made executable before it is in place
            tmp.write_text(text)
            tmp.chmod(0o755)
    return folder


def git_head(repo: str | Path) -> str:
    """The commit ``repo`` is at ("" outside git)."""
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def lock_entries(repo: str | Path, stages: list[str] | None) -> dict[str, Any]:
    """``dvc.lock``'s entries of ``stages`` (those it has; None: all)."""
    path = Path(repo) / "dvc.lock"
    recorded = (yaml.safe_load(path.read_text()) or {}).get("stages", {}) if path.is_file() else {}
    return {s: e for s, e in recorded.items() if stages is None or s in stages}


def handoff_of(repo: str | Path, stages: list[str]) -> dict[str, Any]:
    """What another checkout needs of ``stages`` besides the DVC remote: their dvc.lock entries and their
    uncached outputs (``cache: false``: the metrics files, which DVC does not push)."""
    from dvc.repo import Repo

    root = Path(repo).resolve()
    with Repo(str(root)) as r:
        uncached = [str(o.def_path) for st in r.index.stages if _address(root, st) in stages for o in st.outs
                    if not o.use_cache]
    return {"stages": lock_entries(root, stages),
            "files": {p: (root / p).read_text() for p in uncached if (root / p).is_file()}}


def receive(repo: str | Path, handoff: dict[str, Any]) -> None:
    """Merge a :func:`handoff_of` from another checkout into ``repo``: its lock entries, its uncached outputs."""
    root = Path(repo)
    path = root / "dvc.lock"
    lock = (yaml.safe_load(path.read_text()) if path.is_file() else None) or {"schema": "2.0", "stages": {}}
    lock.setdefault("stages", {}).update(handoff.get("stages", {}))
    write_text(path, yaml.safe_dump(lock, sort_keys=False))
    for rel, text in handoff.get("files", {}).items():
        write_text(root / rel, text)


def handoff_text(handoff: dict[str, Any]) -> str:
    """A handoff as text to send (a Prefect Markdown artifact): a fenced YAML block."""
    return "```yaml\n" + yaml.safe_dump(handoff, sort_keys=False) + "```"


def parse_handoff(text: str) -> dict[str, Any]:
    """The handoff in :func:`handoff_text`'s text."""
    if "```yaml\n" not in text:
        raise StageError(f"not a DVC handoff (no fenced YAML block): {text[:80]!r}")
    return yaml.safe_load(text.split("```yaml\n", 1)[1].rsplit("```", 1)[0]) or {}
