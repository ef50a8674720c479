"""``reward:``: which rewards label a completion (the ``REWARDS`` registry, by name) and the audit."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from posttrain.config import names
from posttrain.config.base import Section, registered


class RewardSpec(Section):
    """One reward of the weighted sum."""

    name: str = Field(description="a key of posttrain.rewards.REWARDS")
    weight: float = Field(1.0, description="weight in the summed reward (0 = logged only)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward function")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return registered("reward", v, names.REWARDS)


class Reward(Section):
    """The reward stage (and every RL step's scoring: the same specs, the same code)."""

    rewards: list[RewardSpec] = Field(min_length=1, description="summed with their weights")
    max_unscorable_frac: float = Field(0.05, ge=0, le=1, description="fail the stage above this unscorable share")
    audit_examples: int = Field(3, ge=0, description="scored completions shown per reward bucket in the audit")
