"""Put back what ``dvc repro`` removed before a stage that then refused to start.

DVC deletes a stage's outputs before it runs the stage's command (``Stage.run`` -> ``remove_outs``). A stage that
then refuses before any work (a misspelled key, an input an upstream stage has not written, a wrong pinned hash:
exit 2 or 1) would leave the workspace without the outputs ``dvc.lock`` still records: ``models/rl`` gone and
the git-tracked ``metrics/rl.json`` deleted, for a typo. ``restore_outputs`` checks them out again through DVC's
own API (``Output.checkout``: from the cache, as ``dvc checkout`` would; the parent ``dvc repro`` holds the
repository's lock, so ``dvc checkout`` itself cannot run), and the uncached ones (the metrics files git tracks)
from git's HEAD when its bytes are the ones ``dvc.lock`` records. It acts only inside ``dvc repro``
(``DVC_STAGE`` set), in the workspace the stage runs in, only on outputs that are missing, and never raises: the
refusal stays the one line it was.
Not after a stage failed mid-work: the outputs it replaces as a set may then be half new (``outputs.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from pathlib import Path

from posttrain.outputs import atomic_path

log = logging.getLogger(__name__)


def _from_git(root: Path, path: Path, md5: str) -> bool:
    """``path`` (under ``root``) from git's HEAD, when those bytes have the md5 ``dvc.lock`` records."""
    rel = path.resolve().relative_to(root.resolve()).as_posix()  # (./: relative to root, wherever git's top is)
    r = subprocess.run(["git", "-C", str(root), "show", f"HEAD:./{rel}"], capture_output=True)
    if r.returncode or hashlib.md5(r.stdout).hexdigest() != md5:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_bytes(r.stdout)
    return True


def restore_outputs() -> list[str]:
    """Inside ``dvc repro``: this stage's locked outputs that are missing, put back; returns their paths."""
    stage = os.environ.get("DVC_STAGE")
    if not stage or not os.environ.get("DVC_ROOT"):
        return []
    done: list[str] = []
    try:
        from dvc.repo import Repo

        # the workspace the stage runs in (its working directory): DVC_ROOT names the parent repository's for a
        # `dvc exp run --temp` or queued experiment, whose outputs must not be checked out there
        root = Path(Repo.find_root(os.getcwd()))
        with Repo(str(root)) as repo:
            outs = [o for s in repo.stage.collect(stage) for o in s.outs if not o.exists and o.hash_info]
    except Exception as e:  # a refusal must stay one line: what could not be put back is only logged
        log.warning("could not restore %s's outputs that dvc repro removed (%s: %s): `dvc checkout %s` does",
                    stage, type(e).__name__, e, stage)
        return done
    for out in outs:  # each on its own: one missing from the cache does not keep the others out
        try:
            if out.use_cache:
                out.checkout()
            elif not _from_git(root, Path(out.fs_path), out.hash_info.value):
                continue
        except Exception as e:
            log.warning("could not restore %s (%s: %s): `dvc checkout %s` does", out, type(e).__name__, e, stage)
        if out.exists:
            done.append(str(out))
    return done
