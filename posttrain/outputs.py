"""Outputs replaced whole or not at all: one output (``atomic_path``), or a stage's outputs as one set
(``output_set``).

``atomic_path(path)`` yields a temp twin beside ``path`` (``.<name>.tmp-<random>/<name>``); when the block ends
without error the twin is fsynced and renamed over ``path``, so a reader sees the old output or the new one.

A stage writes several outputs (a model folder, a data folder, its metrics, its report) one after another: a
kill between two of them used to leave a mix, the new model beside the old metrics. Inside ``output_set(paths,
journal_dir)`` every ``atomic_path`` whose path is one of ``paths`` (or inside one) keeps its twin instead of
renaming it; when the set's block ends, the set commits: it writes a journal naming every (twin, output)
pair, renames the twins over their outputs, then removes the journal. A kill before the journal leaves the
old set (the twins are removed by the next run that writes those outputs); a kill during the renames leaves
the journal, and ``finish_commits`` -- called by every stage's runner before it starts -- completes them: the
new set. Paths outside the set (resumable checkpoints, rollout shards read back during the run) are written
at once, as before.

Why by hand: no library of this stack commits several files and folders as one set (DVC records outputs
after a stage exits; it does not write them), and the journal is the standard write-ahead way to make a
group of renames atomic across a kill.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("posttrain.outputs")

TMP_TAG = ".tmp-"  # temp folders are ``.<name>.tmp-<random>`` beside the output they will become
JOURNAL = ".commit-{name}.json"  # in the set's journal folder while its renames run


@dataclass
class _Set:
    paths: list[Path]
    journal: Path
    twins: list[tuple[Path, Path, Path]] = field(default_factory=list)  # (temp folder, twin, output)

    def holds(self, path: Path) -> bool:
        return any(path == p or p in path.parents for p in self.paths)


_ACTIVE: contextvars.ContextVar[_Set | None] = contextvars.ContextVar("output_set", default=None)


@contextmanager
def atomic_path(path: str | Path, now: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it (every file, then the folders) and rename
    it over ``path`` (a file, or a folder: the old folder is renamed aside first, then the new one in, so a
    reader never sees a half-written output). The parent folder is fsynced after the rename. Inside an
    ``output_set`` holding ``path`` the rename waits for the set's commit, unless ``now``.

    ``tmp.parent`` is a folder of this write's own, removed with it: room for scratch files the writer needs
    until the end (curate's pool). Temp folders a killed run left beside ``path`` (``.<name>.tmp-*``,
    model-sized for a checkpoint) are removed when the next run writes ``path``, with a warning naming each.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    try:
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}{TMP_TAG}", dir=path.parent))
    except OSError as e:  # an unwritable folder: the error names the output, not the temp name it tried
        raise OSError(e.errno, e.strerror, str(path)) from None
    tmp = tmp_dir / path.name
    deferred = None if now else _ACTIVE.get()
    kept = False
    try:
        try:
            yield tmp
        except OSError as e:  # e.g. a full disk while writing: name the output the file belongs to
            if e.errno is None or not str(e.filename or "").startswith(str(tmp)):
                raise
            raise OSError(e.errno, e.strerror, str(path) + str(e.filename)[len(str(tmp)):]) from None
        _fsync_tree(tmp)
        if deferred is not None and deferred.holds(path.absolute()):
            deferred.twins.append((tmp_dir, tmp, path))
            kept = True
            return
        _swap(tmp_dir, tmp, path)
    finally:
        if not kept:
            shutil.rmtree(tmp_dir, ignore_errors=True)


@contextmanager
def output_set(paths: Sequence[str | Path], journal_dir: str | Path, name: str) -> Iterator[None]:
    """Replace the outputs under ``paths`` together when the block ends (see the module docstring); on an
    error inside the block none of them is replaced. ``name``: the stage (names the journal)."""
    s = _Set([Path(p).absolute() for p in paths], Path(journal_dir) / JOURNAL.format(name=name))
    token = _ACTIVE.set(s)
    try:
        yield
    except BaseException:
        for tmp_dir, _, _ in s.twins:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    finally:
        _ACTIVE.reset(token)
    _commit(s)


def link_tree(src: str | Path, dst: str | Path) -> None:
    """``dst`` made a copy of the folder ``src`` whose files are hard links to ``src``'s (no second copy of the
    bytes, not even for a moment: rl's shards, checkpoints, registered models), each file copied where a link
    cannot be made (another file system). For files that are replaced, never written in place."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


def _commit(s: _Set) -> None:
    if not s.twins:
        return
    s.journal.parent.mkdir(parents=True, exist_ok=True)
    pairs = [[str(x.absolute()) for x in twin] for twin in s.twins]  # a recovery may run from another folder
    tmp = s.journal.with_name(s.journal.name + ".tmp")
    tmp.write_text(json.dumps(pairs))
    _fsync(tmp)
    os.replace(tmp, s.journal)  # from here on the new set is the one that will stand
    _fsync(s.journal.parent)
    _replay(pairs)
    s.journal.unlink()


def _replay(pairs: list[list[str]]) -> None:
    for tmp_dir, twin, path in map(lambda x: [Path(y) for y in x], pairs):
        if twin.exists():  # not yet renamed
            _swap(tmp_dir, twin, path)
        shutil.rmtree(tmp_dir, ignore_errors=True)


def finish_commits(journal_dir: str | Path) -> list[str]:
    """Complete every set commit a killed stage left half-done in ``journal_dir`` or a folder below it (evaluate's
    journals are beside its metrics, in ``<metrics_dir>/evaluate``); returns their names."""
    done = []
    for journal in sorted(Path(journal_dir).rglob(JOURNAL.format(name="*"))):
        _replay(json.loads(journal.read_text()))
        journal.unlink()
        name = journal.name.removeprefix(".commit-").removesuffix(".json")
        log.warning("completed the outputs of %s: its run was killed while replacing them", name)
        done.append(name)
    return done


def _swap(tmp_dir: Path, tmp: Path, path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        os.replace(path, tmp_dir / f"{path.name}.old")  # removed with tmp_dir
    os.replace(tmp, path)
    _fsync(path.parent)


def _remove_stale(path: Path) -> None:
    for stale in path.parent.glob(f".{path.name}{TMP_TAG}*"):
        log.warning("removing %s: a temporary output left by a run that was killed while writing %s", stale, path)
        shutil.rmtree(stale, ignore_errors=True)


def _fsync(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(p: Path) -> None:
    """fsync a file, or every file of a folder and then each folder (bottom-up)."""
    if not p.exists():
        return
    if p.is_file():
        _fsync(p)
        return
    for root, _dirs, files in os.walk(p, topdown=False):
        for f in files:
            _fsync(Path(root) / f)
        _fsync(Path(root))


def run_facts_path(metrics: str | Path) -> Path:
    """Where a stage's run facts (its timings, world size, resume point: ``schema.write_metrics``) go beside its
    metrics file: ``metrics/rl.json`` -> ``metrics/rl.run.json``."""
    metrics = Path(metrics)
    return metrics.with_name(f"{metrics.stem}.run.json")


def as_one_set(out: dict[str, Path], name: str, at_once: Sequence[str] = ("checkpoints",)
               ) -> contextlib.AbstractContextManager[None]:
    """``output_set`` over a stage's ``out`` paths (with its metrics file's run facts) but those under
    ``at_once`` keys, journaled beside its metrics file. Written at once: resumable checkpoints (a resume reads
    them) and the report of a stage that can stop on a threshold (reward: the report says why it stopped)."""
    paths = [p for k, p in out.items() if k not in at_once]
    return output_set([*paths, run_facts_path(out["metrics"])], Path(out["metrics"]).parent, name)
