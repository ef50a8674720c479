"""The outbox: a record the store could not take waits here (one folder per run: ``record.json`` and a copy
of its artifacts, which may change before the replay); ``posttrain tracking sync`` replays it."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

from posttrain.config import Params
from posttrain.tracking.records import StageRecord
from posttrain.tracking.store import send

log = logging.getLogger("tracking")


def outbox_dir(params: Params, root: Path) -> Path:
    return root / params.tracking.outbox


def to_outbox(rec: StageRecord, box: Path) -> Path:
    """Write the record and a copy of its artifacts (they may change before the replay)."""
    rid = f"{rec.start_ms}-{rec.stage}-{uuid.uuid4().hex[:8]}"
    folder = box / rid
    files = folder / "artifacts"
    files.mkdir(parents=True)
    copied = []
    for a in rec.artifacts:
        p = Path(a)
        dst = files / p.name if p.is_dir() else files / p.parent.name / p.name  # same artifact paths on replay
        dst.parent.mkdir(parents=True, exist_ok=True)
        if p.is_dir():
            shutil.copytree(p, dst)
        elif p.is_file():
            shutil.copy2(p, dst)
        copied.append(str(dst))
    data = asdict(rec) | {"artifacts": copied}
    tmp = folder / "record.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(folder / "record.json")
    return folder


# MLflow's answers that mean "this record will never be taken" (as opposed to a store that is down or busy)
REFUSALS = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS",
                      "MALFORMED_REQUEST"})
REFUSED = "refused"  # the outbox's subfolder of records the store refused, each with reason.txt


def refused(e: BaseException) -> bool:
    """Whether ``e`` is the store refusing a record (retrying cannot help), not the store being unreachable."""
    return getattr(e, "error_code", None) in REFUSALS


def sync(box: Path, uri: str, root: Path | None) -> tuple[int, int, int]:
    """Replay every outbox record to ``uri``; a sent record is removed, a record the store refuses is moved to
    ``<box>/refused/`` with its reason (kept for a person to look at, never retried). Returns (sent, left to
    retry, refused now)."""
    sent = left = refused_now = 0
    for rec_file in sorted(box.glob("*/record.json")):
        folder = rec_file.parent
        if folder.parent.name == REFUSED:
            continue
        data = json.loads(rec_file.read_text())
        data["metrics"] = [tuple(m) for m in data["metrics"]]
        try:
            send(StageRecord(**data), uri, root)
        except Exception as e:
            if refused(e):
                dest = box / REFUSED / folder.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                folder.rename(dest)
                (dest / "reason.txt").write_text(f"{type(e).__name__}: {e}\n")
                log.warning("outbox %s refused by %s, kept in %s: %s", folder.name, uri, dest, str(e)[:300])
                refused_now += 1
            else:
                log.warning("outbox %s not sent: %s", folder.name, e)
                left += 1
            continue
        shutil.rmtree(folder)
        sent += 1
    return sent, left, refused_now
