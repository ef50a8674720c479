"""A stage run, tracked from its start: :func:`stage_run` wraps every stage (``runner.stage_main``).

At the start it opens the stage's MLflow run (a child of ``POSTTRAIN_MLFLOW_PARENT`` when a pipeline set one)
and listens to every ``posttrain.trainlog.TrainLog`` row: each is logged to the run as it is made (one
``log_batch`` per row), so a user watches the curves during a multi-hour run and a killed run keeps them (its
MLflow run stays ``RUNNING`` with every row logged before the kill). The run is opened before the stage's first
step (a run opened later, in a thread, lost a killed run's early rows: tests/test_slow.py); a worker thread then
sends each row (``log_batch``, queued rows batched), so a step never waits on the store
(``benchmarks/tracking_overhead.py`` measures what tracking costs a stage). At the end the record
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
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain import trainlog
from posttrain.config import ConfigError, Params
from posttrain.tracking import records
from posttrain.tracking.outbox import outbox_dir, to_outbox
from posttrain.tracking.store import metric_key, mlflow_client, open_run, send, store_uri

log = logging.getLogger("tracking")
BATCH_METRICS = 1000  # metrics per log_batch at most (MLflow's own limit)
CLOSE_TIMEOUT_S = 60.0  # the most a stage's end waits for rows still queued for a slow store


class LiveRun:
    """The stage's MLflow run while it runs: opened at once, then fed by one worker thread so the stage never
    waits on the store: it logs each train-log row it is handed (``row``, a ``TrainLog`` listener: a queue
    put). ``close`` waits for it: ``run_id`` (None when no
    run could be opened), every per-step metric heard (``metrics``) and which of them reached the run
    (``sent``)."""

    def __init__(self, uri: str, experiment: str, stage: str, start_ms: int, parent: str | None,
                 root: Path) -> None:
        self.uri, self.run_id = uri, None
        self.metrics: list[tuple[str, float, int]] = []  # every per-step metric heard, sent or not
        self.sent: list[tuple[str, int]] = []
        self._rows: queue.Queue[list[tuple[str, float, int]] | None] = queue.Queue()
        self._stop = False  # set when close() gave up waiting: the worker logs nothing more
        client = None
        try:  # before the stage's first step, so a run killed early still has its rows (only the one in flight)
            self.run_id = open_run(uri, experiment, stage, start_ms, parent, root)
            client = mlflow_client(uri)
        except ConfigError:  # the store refuses this checkout (moved): one line, exit 2, before any work
            raise
        except Exception as e:
            log.warning("tracking store %s unreachable at the start of %s (%s: %s): no live metrics; the run's "
                        "record is sent at the end, or kept in the outbox", uri, stage, type(e).__name__,
                        str(e)[:200])
        self._thread = threading.Thread(target=self._work, args=(client,), name="mlflow-live", daemon=True)
        self._thread.start()

    def row(self, name: str, row: dict[str, Any]) -> None:
        """The row's numbers as metrics at its step (keys prefixed ``<name>/``); what is not a number (text, a
        missing value) is no metric. Never raises: tracking must not fail a training step."""
        try:
            step = int(float(row.get("step") or 0))
            new = [(f"{name}/{k}" if name else k, float(v), step) for k, v in row.items()
                   if k != "step" and isinstance(v, int | float)]
        except (TypeError, ValueError) as e:
            log.warning("tracking: a train-log row with no numeric step is not logged (%s)", e)
            return
        if new:
            self.metrics += new
            self._rows.put(new)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Wait until every row handed in was logged (or could not be), at most ``timeout_s``: rows still queued
        then go with the run's record (they are in ``metrics``, not in ``sent``)."""
        self._rows.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("tracking store %s still busy after %.0fs: the rows not yet logged go with the run's "
                        "record", self.uri, timeout_s)
            self._stop = True

    def _work(self, client: Any) -> None:
        if client is not None:
            from mlflow.entities import Metric
        done = False
        while not done:
            new = self._rows.get()
            batch, done = ([] if new is None else new), new is None
            while not done and len(batch) < BATCH_METRICS:  # rows that queued while the store was busy: one call
                try:
                    more = self._rows.get_nowait()
                except queue.Empty:
                    break
                batch, done = (batch if more is None else batch + more), more is None
            if client is None or not batch or self._stop:
                continue
            try:
                now = int(time.time() * 1000)
                client.log_batch(self.run_id, metrics=[Metric(metric_key(k), v, now, s) for k, v, s in batch])
            except Exception as e:  # the store went away: stop trying; the end-of-stage record carries every row
                log.warning("tracking store %s unreachable mid-stage (%s: %s): live metrics stop here, the rest "
                            "go with the run's record at the end", self.uri, type(e).__name__, str(e)[:200])
                client = None
                continue
            self.sent += [(k, s) for k, _, s in batch]


@contextmanager
def stage_run(stage: str, params: Params, root: Path = Path(".")) -> Iterator[None]:
    """Track the stage run in the ``with`` body (see module docstring). Tracking never fails the stage."""
    if not params.tracking.enabled:
        yield
        return
    start = int(time.time() * 1000)
    if not os.environ.get(records.PARENT_ENV) and os.environ.get("DVC_EXP_NAME"):  # a stage of `dvc exp run`
        from posttrain.tracking.store import exp_parent

        parent = exp_parent(params, root, os.environ["DVC_EXP_NAME"], os.environ.get("DVC_EXP_BASELINE_REV", ""))
        if parent:  # (the record built at the end reads it too)
            os.environ[records.PARENT_ENV] = parent
    live = LiveRun(store_uri(params, root), params.tracking.experiment, stage, start,
                   os.environ.get(records.PARENT_ENV) or None, root)
    trainlog.LISTENERS.append(live.row)
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    except KeyboardInterrupt:  # Ctrl-C, or SIGINT forwarded by posttrain repro
        status = "KILLED"
        raise
    finally:
        trainlog.LISTENERS.remove(live.row)
        live.close()
        _finish(stage, params, root, start, status, live)


def _finish(stage: str, params: Params, root: Path, start: int, status: str, live: LiveRun) -> None:
    t0 = time.time()
    try:
        rec = records.build_record(stage, params, root, start, status, live.metrics)
    except Exception as e:
        log.warning("tracking: could not collect the %s run: %s", stage, e)
        return
    rec.run_id, rec.sent = live.run_id, list(live.sent)
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
