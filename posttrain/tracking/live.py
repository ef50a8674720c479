"""A stage run, tracked from its start: :func:`stage_run` wraps every stage (``runner.stage_main``).

At the start it opens the stage's MLflow run (a child of ``POSTTRAIN_MLFLOW_PARENT`` when a pipeline set one)
and listens to every ``posttrain.trainlog.TrainLog`` row: each is logged to the run as it is made (one
``log_batch`` per row), so a user watches the curves during a multi-hour run and a killed run keeps them (its
MLflow run stays ``RUNNING`` with every row logged before the kill). At the end the record
(``records.build_record``) fills the same run: params, tags, final metrics, artifacts, registered models, and
any row the live logging could not send.

When the store cannot be reached, nothing waits on it: a failed live ``log_batch`` stops live logging for the
rest of the stage (one warning), and the end-of-stage record, which holds every row, goes to the outbox when
it cannot be sent either (``posttrain tracking sync`` replays it into the same run). Tracking never fails or
slows a stage down for more than one request timeout. ``tracking.enabled: false`` logs nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain import trainlog
from posttrain.config import Params
from posttrain.tracking import records
from posttrain.tracking.outbox import outbox_dir, to_outbox
from posttrain.tracking.store import _client, metric_key, open_run, send, store_uri

log = logging.getLogger("tracking")


class LiveRun:
    """The stage's MLflow run while it runs: every train-log row it hears of, and which of them reached it."""

    def __init__(self, uri: str, run_id: str | None) -> None:
        self.uri, self.run_id = uri, run_id
        self._client: Any = None
        self.metrics: list[tuple[str, float, int]] = []  # every per-step metric heard, sent or not
        self.sent: list[tuple[str, int]] = []

    def row(self, name: str, row: dict[str, Any]) -> None:
        """A ``TrainLog`` listener: the row's numbers as metrics at its step (keys prefixed ``<name>/``)."""
        step = int(float(row.get("step") or 0))
        new = []
        for k, v in row.items():
            if k == "step" or v in ("", None) or isinstance(v, str):
                continue
            new.append((f"{name}/{k}" if name else k, float(v), step))
        self.metrics += new
        if self.run_id is None or not new:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        try:
            self._client = self._client or _client(self.uri)
            self._client.log_batch(self.run_id, metrics=[Metric(metric_key(k), v, now, s) for k, v, s in new])
        except Exception as e:  # the store went away: stop trying; the end-of-stage record carries every row
            log.warning("tracking store %s unreachable mid-stage (%s: %s): live metrics stop here, the rest go "
                        "with the run's record at the end", self.uri, type(e).__name__, str(e)[:200])
            self.run_id = None
            return
        self.sent += [(k, s) for k, _, s in new]


def _open(params: Params, root: Path, stage: str, start_ms: int) -> LiveRun:
    uri = store_uri(params, root)
    try:
        return LiveRun(uri, open_run(uri, params.tracking.experiment, stage, start_ms,
                                     os.environ.get(records.PARENT_ENV) or None, root))
    except Exception as e:
        log.warning("tracking store %s unreachable at the start of %s (%s: %s): no live metrics; the run's record "
                    "is sent at the end, or kept in the outbox", uri, stage, type(e).__name__, str(e)[:200])
        return LiveRun(uri, None)


@contextmanager
def stage_run(stage: str, params: Params, root: Path = Path(".")) -> Iterator[None]:
    """Track the stage run in the ``with`` body (see module docstring). Tracking never fails the stage."""
    if not params.tracking.enabled:
        yield
        return
    start = int(time.time() * 1000)
    live = _open(params, root, stage, start)
    live_id = live.run_id
    trainlog.LISTENERS.append(live.row)
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    finally:
        trainlog.LISTENERS.remove(live.row)
        _finish(stage, params, root, start, status, live, live_id)


def _finish(stage: str, params: Params, root: Path, start: int, status: str, live: LiveRun,
            live_id: str | None) -> None:
    t0 = time.time()
    try:
        rec = records.build_record(stage, params, root, start, status, live.metrics)
    except Exception as e:
        log.warning("tracking: could not collect the %s run: %s", stage, e)
        return
    rec.run_id, rec.sent = live_id, list(live.sent)
    uri = live.uri
    try:
        rid = send(rec, uri, root)
        log.info("tracked as MLflow run %s (%s) in %.2fs", rid, uri, time.time() - t0)
    except Exception as e:
        try:
            folder = to_outbox(rec, outbox_dir(params, root))
        except Exception as box_err:  # never hide the stage's own outcome (or exception) behind this
            log.error("tracking store %s unreachable (%s: %s) and the outbox %s is not writable (%s: %s): "
                      "this %s run is not tracked", uri, type(e).__name__, str(e)[:200],
                      outbox_dir(params, root), type(box_err).__name__, box_err, stage)
        else:
            log.warning("tracking store %s unreachable or refused the run (%s: %s): run kept in %s; "
                        "`posttrain tracking sync` sends it", uri, type(e).__name__, str(e)[:200], folder)
