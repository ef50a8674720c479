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


def sync(box: Path, uri: str, root: Path | None) -> tuple[int, int]:
    """Replay every outbox record to ``uri``; a sent record is removed. Returns (sent, left)."""
    sent = left = 0
    for rec_file in sorted(box.glob("*/record.json")):
        data = json.loads(rec_file.read_text())
        data["metrics"] = [tuple(m) for m in data["metrics"]]
        try:
            send(StageRecord(**data), uri, root)
        except Exception as e:
            log.warning("outbox %s not sent: %s", rec_file.parent.name, e)
            left += 1
            continue
        shutil.rmtree(rec_file.parent)
        sent += 1
    return sent, left
