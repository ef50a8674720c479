"""Files of a git revision or a DVC experiment, read without a checkout: what ``posttrain compare`` compares and
what ``posttrain lineage models:/...`` traces when a registered version came from a pipeline state the
workspace no longer holds (an earlier commit, or a ``dvc exp run`` experiment, whose commit lives under
``refs/exps``).

git-tracked files come from ``git show``; files inside a DVC-cached folder from the local cache, through the
folder's ``.dir`` manifest (the cache is content-addressed: a revision's outputs are there for as long as
nobody ran ``dvc gc``).
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from posttrain.errors import StageError


def git(root: Path, *args: str) -> str | None:
    """``git args`` in ``root``: its stdout, or None when git fails."""
    r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def commit_of(root: Path, name: str) -> str:
    """The commit of a git revision or of a DVC experiment named ``name``; a ``StageError`` naming it if neither."""
    sha = git(root, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")
    if sha:
        return sha.strip()
    refs = git(root, "for-each-ref", "--format=%(refname) %(objectname)", "refs/exps") or ""
    hits = [line.split()[1] for line in refs.splitlines() if line.split()[0].rsplit("/", 1)[-1] == name]
    if len(hits) == 1:
        return hits[0]
    raise StageError(f"{name!r} is neither a git revision nor a DVC experiment of {root}"
                     + (f" ({len(hits)} experiments have that name)" if hits else ""))


def describe(root: Path, sha: str) -> str:
    """``experiment <name> (<sha10>)`` when a DVC experiment's ref points at ``sha``, else ``commit <sha10>``."""
    refs = git(root, "for-each-ref", "--points-at", sha, "--format=%(refname)", "refs/exps") or ""
    names = [r.rsplit("/", 1)[-1] for r in refs.split()]
    return f"experiment {names[0]} ({sha[:10]})" if names else f"commit {sha[:10]}"


def git_file(root: Path, rev: str, path: str) -> str | None:
    """A git-tracked file's text at ``rev`` (None where it is not tracked there)."""
    return git(root, "show", f"{rev}:{path}")


def git_bytes(root: Path, rev: str, path: str) -> bytes | None:
    """A git-tracked file's bytes at ``rev`` (None where it is not tracked there)."""
    r = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True)
    return r.stdout if r.returncode == 0 else None


def dvc_file(root: Path, rev: str, path: str) -> str | None:
    """A DVC-tracked file's text at ``rev`` (DVC's own API; None where it is not tracked or not cached)."""
    import dvc.api

    try:
        return dvc.api.read(path, repo=str(root), rev=rev)
    except Exception:  # noqa: BLE001 - not tracked at that revision, or not in the local cache: no such file
        return None


def lock_at(root: Path, rev: str) -> dict[str, Any]:
    """The ``stages`` of ``dvc.lock`` at ``rev`` ({} where it has none)."""
    return (yaml.safe_load(git_file(root, rev, "dvc.lock") or "{}") or {}).get("stages", {})


def out_md5(entry: dict[str, Any]) -> str:
    """An output's (or dep's) hash as ``dvc.lock`` records it (``md5``; DVC 3 may write ``hash``)."""
    return entry.get("md5") or entry.get("hash") or ""


def lock_holding(root: Path, md5: str) -> str | None:
    """The newest commit of any ref (branches, tags, ``refs/exps``) whose ``dvc.lock`` has an *output* with hash
    ``md5`` (a downstream stage's dep with the same hash does not count); None if none has."""
    commits = (git(root, "rev-list", "--all", "--", "dvc.lock") or "").split()
    for i in range(0, len(commits), 256):  # git grep the candidates, then parse the hits in rev-list order
        chunk = commits[i:i + 256]
        hits = {line.split(":", 1)[0] for line in (git(root, "grep", "-l", "-F", "-e", md5, *chunk, "--", "dvc.lock")
                                                   or "").splitlines()}
        for sha in (c for c in chunk if c in hits):
            if any(out_md5(o) == md5 for e in lock_at(root, sha).values() for o in e.get("outs", [])):
                return sha
    return None


@functools.cache
def _cache_root(root: Path) -> Path:
    """DVC's local cache for md5 objects, as the repository's config sets it (``cache.dir``)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return Path(repo.cache.local.path)


def cache_object(root: Path, md5: str) -> Path:
    """Where DVC's local cache keeps the object with hash ``md5`` (a file, or a folder's ``.dir`` manifest)."""
    return _cache_root(root.resolve()) / md5[:2] / md5[2:]


def cached_file(root: Path, out_hash: str, rel: str) -> str | None:
    """The text of file ``rel`` inside the DVC-cached folder whose hash is ``out_hash`` (``....dir``), read from
    the local cache; None when the folder, the file or its object is not there."""
    manifest = cache_object(root, out_hash)
    if not out_hash.endswith(".dir") or not manifest.is_file():
        return None
    md5 = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}.get(rel)
    obj = cache_object(root, md5) if md5 else None
    return obj.read_text() if obj is not None and obj.is_file() else None


class Files:
    """Reads the files of one pipeline state: the workspace (``rev`` None), or commit ``rev`` without a checkout:
    git-tracked files from git, files inside a DVC-cached output from the local cache (``out_hash``)."""

    def __init__(self, root: Path, rev: str | None) -> None:
        self.root, self.rev = root, rev

    def text(self, path: str, out_hash: str = "", rel: str = "") -> str | None:
        """``path`` (git-tracked), or ``rel`` inside the output ``path`` whose hash is ``out_hash``."""
        if self.rev is None:
            f = self.root / path / rel if rel else self.root / path
            return f.read_text() if f.is_file() else None
        if rel:
            return cached_file(self.root, out_hash, rel)
        return git_file(self.root, self.rev, path)
