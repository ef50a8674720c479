"""MLflow tracking of every stage run, live, with a local outbox so nothing is lost when the server is down.

Split by job: ``records`` (what a stage run logs, collected after it ran), ``store`` (MLflow I/O: the run opened
at the stage's start, the record's fill, the pipeline's parent run), ``champion`` (registered model versions
and the ``champion`` alias), ``outbox`` (records waiting for a store that was down) and ``live`` (the stage run
from start to end; per-step metrics logged as they are made).

Nesting: ``POSTTRAIN_MLFLOW_PARENT`` (a run id) in the environment makes each stage run a child of that run;
``posttrain repro`` and the Prefect flow create one parent per pipeline invocation and set it.
"""

from posttrain.tracking.champion import find_version_by_md5, promote, register
from posttrain.tracking.live import LiveRun, stage_run
from posttrain.tracking.outbox import outbox_dir, sync, to_outbox
from posttrain.tracking.records import MODEL_OUTS, PARENT_ENV, StageRecord, build_record, dvc_hashes, flatten
from posttrain.tracking.store import end_parent, metric_key, mlflow_client, open_run, send, start_parent, store_uri

__all__ = ["LiveRun", "MODEL_OUTS", "PARENT_ENV", "StageRecord", "build_record", "dvc_hashes", "end_parent",
           "find_version_by_md5", "flatten", "metric_key", "mlflow_client", "open_run", "outbox_dir", "promote",
           "register", "send", "stage_run", "start_parent", "store_uri", "sync", "to_outbox"]
