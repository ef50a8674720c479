"""``tracking:``: MLflow tracking of every stage run. No stage's outputs depend on it (no dvc.yaml param)."""

from __future__ import annotations

from pydantic import Field

from posttrain.config.base import Section


class TrackingCfg(Section):
    """MLflow tracking of every stage run (posttrain/tracking/); read by no stage's code: no dvc.yaml param."""

    enabled: bool = Field(True, description="log every stage run to MLflow (false: log nothing)")
    uri: str | None = Field(None, min_length=1, description="tracking/registry URI, e.g. http://127.0.0.1:5000; None: "
                            "sqlite:///<absolute repo path>/mlflow.db with artifacts in <repo>/mlartifacts")
    experiment: str = Field("posttrain", min_length=1, description="MLflow experiment of the stage runs")
    outbox: str = Field(".mlflow-outbox", min_length=1, description="where runs wait when the store is unreachable "
                        "(`posttrain tracking sync` sends them)")
    model_prefix: str = Field("posttrain-", description="registered model names: <prefix>sft, <prefix>rl, ...")
    champion: str | None = Field("eval.greedy", pattern=r"^[^.\s]+\.\S+$",
                                 description="evaluate moves the `champion` alias of a model "
                                 "to the evaluated version when this metric (<split>.<metric> of metrics/"
                                 "evaluate.json) beats the current champion's; None: never")
