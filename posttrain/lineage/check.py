"""``verify``: recompute the hash of every output of a lineage tree (``posttrain.lineage.trace``) and compare it
with ``dvc.lock``: a file's md5, or for a folder each file's md5 against DVC's ``.dir`` manifest in the cache, so
a mismatch names the changed, missing or extra file (without the manifest, DVC's folder hash as a whole). A tree
traced at another commit (a registered version from an experiment or an earlier state) is checked against the
bytes kept for it: DVC's local cache, or git for ``cache: false`` outputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from posttrain.digests import sha256_file, wheel_cache
from posttrain.lineage import Node, Out
from posttrain.revisions import cache_object, git_bytes


def _file_md5(p: Path) -> str:
    h = hashlib.md5()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_out(root: Path, out: Out) -> str | None:
    """None when the workspace matches dvc.lock; otherwise what differs, naming the file."""
    p = root / out.path
    if not p.exists():
        return f"{out.path}: missing from the workspace"
    if not out.md5.endswith(".dir"):
        got = _file_md5(p)
        return None if got == out.md5 else f"{out.path}: md5 {got} != {out.md5} in dvc.lock"
    manifest = cache_object(root, out.md5)
    if manifest.is_file():
        want = {e["relpath"]: e["md5"] for e in json.loads(manifest.read_text())}
        have = {str(f.relative_to(p)): f for f in sorted(p.rglob("*")) if f.is_file()}
        problems = [f"{out.path}/{rel}: changed (md5 {_file_md5(have[rel])} != {md5})"
                    for rel, md5 in want.items() if rel in have and _file_md5(have[rel]) != md5]
        problems += [f"{out.path}/{rel}: missing" for rel in want if rel not in have]
        problems += [f"{out.path}/{rel}: not in dvc.lock's manifest" for rel in have if rel not in want]
        return "; ".join(problems) or None
    from dvc.repo import Repo

    with Repo(str(root)) as repo:  # no manifest in the cache: DVC's own hash of the folder
        for st in repo.index.stages:
            for o in st.outs:
                if str(o.def_path) == out.path:
                    got = o.get_hash().value
                    return None if got == out.md5 else f"{out.path}: folder md5 {got} != {out.md5} in dvc.lock"
    return None


def verify_at(root: Path, rev: str, out: Out) -> str | None:
    """None when the bytes ``dvc.lock`` at commit ``rev`` records for ``out`` are still here: a cached output's
    objects in DVC's local cache (each file of a folder re-hashed against its manifest), a git-tracked one
    (``cache: false``) in git at ``rev``; otherwise what is missing or differs, naming the file."""
    obj = cache_object(root, out.md5)
    if not obj.is_file():
        raw = git_bytes(root, rev, out.path)
        if raw is None:
            return f"{out.path}: {out.md5} is neither in the local DVC cache nor in git at {rev[:10]} (dvc pull)"
        got = hashlib.md5(raw).hexdigest()
        return None if got == out.md5 else f"{out.path}: md5 {got} != {out.md5} in git at {rev[:10]}"
    if not out.md5.endswith(".dir"):
        got = _file_md5(obj)
        return None if got == out.md5 else f"{out.path}: cache object md5 {got} != {out.md5}"
    problems = []
    for e in json.loads(obj.read_text()):
        f = cache_object(root, e["md5"])
        if not f.is_file():
            problems.append(f"{out.path}/{e['relpath']}: not in the local DVC cache (dvc pull)")
        elif (got := _file_md5(f)) != e["md5"]:
            problems.append(f"{out.path}/{e['relpath']}: cache object changed (md5 {got} != {e['md5']})")
    return "; ".join(problems) or None


def verify_origin(src: dict[str, Any] | None) -> str | None:
    """A wheel the manifest names, re-hashed where this machine's cache holds it (``imports.cache_dir``): None when
    it matches (or is not cached here: DVC's hash of the folder still covers the manifest that names it)."""
    if not src or src.get("kind") != "wheel" or not src.get("wheel_sha256"):
        return None
    home = wheel_cache(src["wheel_sha256"]) / str(src.get("wheel"))
    if not home.is_file():
        return None
    got = sha256_file(home)
    return None if got == src["wheel_sha256"] else f"{home}: sha256 {got} != {src['wheel_sha256']} in the manifest"


def verify(root: Path, tree: Node) -> list[str]:
    """Check every output of every node (in the workspace; for a tree traced at a commit, :func:`verify_at`);
    sets ``Out.problem``; returns the problems."""
    problems, done = [], set()

    def walk(n: Node) -> None:
        if n.stage in done:
            return
        done.add(n.stage)
        for o in n.outs:
            o.problem = verify_out(root, o) if n.at is None else verify_at(root, n.at, o)
            if o.problem:
                problems.append(o.problem)
        if (bad := verify_origin(n.origin)) is not None:
            problems.append(bad)
        for p in n.parents:
            walk(p)

    walk(tree)
    return problems
