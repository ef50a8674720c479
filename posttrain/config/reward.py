"""``reward:``: which rewards label a completion (the ``REWARDS`` registry by name, or a plug-in function by
``package.module:function``), how they are run (in-process, or a process pool with a per-sample timeout) and the
audit."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.config import names, plugins
from posttrain.config.base import MAX_BATCH, MAX_NEW_TOKENS, MAX_THREADS, NOT_RESULT, Refusal, Section, registered
from posttrain.config.judge import LlmJudgeKwargs


class NoKwargs(Section):
    """A reward that takes no keyword arguments."""


class OverlongKwargs(Section):
    """``overlong``: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13)."""

    model_config = ConfigDict(strict=True)  # "16" is not 16: the function would get a string
    buffer: int = Field(16, ge=1, le=MAX_NEW_TOKENS,
                        description="L_cache: the last tokens before max_new_tokens in which the "
                        "punishment ramps from 0 to -1")


class CodeTestsKwargs(Section):
    """``code_tests``: run the completion against the problem's tests in the sandbox."""

    model_config = ConfigDict(strict=True)
    mode: str = Field("all", description="all: 1.0 when every test passes, else 0.0; fraction: the share passed")

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if v not in ("all", "fraction"):
            raise ValueError(f"{v!r} is not one of 'all', 'fraction'")
        return v


class RewardModelKwargs(Section):
    """``reward_model``: a trained reward model (the reward_model stage's artifact) scores each completion."""

    model_config = ConfigDict(strict=True)
    path: str = Field(min_length=1, description="the reward model's folder (paths.reward_model_dir/<name>: "
                      "manifest.json and its members); must exist at load unless this pipeline builds it")
    combine: str = Field("mean", description="the members' scores as one (Coste et al. 2024): mean; wco = the "
                         "minimum; uwo = mean - lam x variance; uwo_std = mean - lam x std")
    lam: float = Field(0.5, ge=0, le=1e6, description="uwo / uwo_std: the weight of the members' disagreement")
    steps: str = Field("off", description="off: score the whole completion; raw / clip / delta: score each "
                       "prefix ending at a step (step_sep) and sum the step rewards, raw or bounded as in Gao et "
                       "al. 2024: clip min(s - eta, 0), delta s_t - s_{t+1}")
    step_sep: str = Field("\n", min_length=1, description="what ends a step (arith's steps end in ';')")
    eta: float = Field(0.0, ge=-1e6, le=1e6, description="clip: the score a step must reach to cost nothing")
    batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="texts a forward")
    device: str = Field("cpu", description="where the reward model runs (cpu, cuda, cuda:1, ...); plain cuda is "
                        "each rank's own GPU under torchrun (cuda:<LOCAL_RANK>), not GPU 0 for all")
    dtype: str = Field("float32", description="the members' weights when scoring: float32, bfloat16 (half the "
                       "memory of each copy; scores differ from float32's by bf16 rounding) or float16")

    @field_validator("combine")
    @classmethod
    def _combine(cls, v: str) -> str:
        return registered("combine", v, names.RM_COMBINES)

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: str) -> str:
        return registered("steps", v, names.RM_STEPS)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return registered("dtype", v, ("float32", "bfloat16", "float16"))


class ToolCostKwargs(Section):
    """``tool_cost``: minus the number of tool calls (the weight is the cost per call; OTC)."""

    model_config = ConfigDict(strict=True)
    only_correct: bool = Field(True, description="charge the calls of correct answers only (OTC: a model is never "
                               "pushed to skip a call it needs and fail); false: of every completion")


# Each reward's keyword arguments, as the function declares them (tests/test_config.py compares them with the
# signatures in posttrain.rewards): a misspelt or mistyped kwarg is refused at load, not after generation.
REWARD_KWARGS: dict[str, type[Section]] = {"correct": NoKwargs, "math_verify": NoKwargs, "format": NoKwargs,
                                           "overlong": OverlongKwargs, "code_tests": CodeTestsKwargs,
                                           "reward_model": RewardModelKwargs, "llm_judge": LlmJudgeKwargs,
                                           "tool_cost": ToolCostKwargs}


class RewardSpec(Section):
    """One reward of the weighted sum."""

    name: str = Field(description="a key of posttrain.rewards.REWARDS, or a plug-in 'package.module:function' "
                      "(imported and checked at load: fn(samples, **kwargs) -> one float | None per sample)")
    weight: float = Field(1.0, ge=-1e6, le=1e6, description="weight in the summed reward (0 = logged only; "
                          "negative: a penalty)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward function")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if plugins.is_plugin(v):
            plugins.load_reward(v)
            return v
        return registered("reward", v, names.REWARDS)

    @model_validator(mode="after")
    def _kwargs(self) -> RewardSpec:
        if plugins.is_plugin(self.name):  # its own signature declares its kwargs
            try:
                plugins.check_kwargs(self.name, plugins.load_reward(self.name), self.kwargs)
            except ValueError as e:
                raise Refusal("kwargs", str(e)) from None
            return self
        try:
            REWARD_KWARGS[self.name].model_validate(self.kwargs)
        except ValidationError as e:
            err = e.errors()[0]
            if isinstance(ref := err.get("ctx", {}).get("error"), Refusal):  # a kwargs class's own cross-field rule
                raise Refusal(f"kwargs.{ref.key}", str(ref)) from None
            key = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            takes = sorted(REWARD_KWARGS[self.name].model_fields) or "no kwargs"
            raise Refusal(f"kwargs.{key}", f"{msg} ({self.name} takes {takes})") from None
        return self


class Reward(Section):
    """The reward stage (and every RL step's scoring: the same specs, the same code)."""

    rewards: list[RewardSpec] = Field(min_length=1, description="summed with their weights")
    max_unscorable_frac: float = Field(0.05, ge=0, le=1, description="fail the stage above this unscorable share")
    workers: int = Field(0, ge=0, le=MAX_THREADS, json_schema_extra=NOT_RESULT,
                         description="scoring processes (per machine: under torchrun each rank starts workers // "
                         "its ranks on the machine, at least 2; under rl.overlap each generator process starts its "
                         "own): 0 or 1 = in this process, each reward once over the "
                         "batch (no timeout beyond math-verify's own); >= 2 = a process pool of batches of up to 16 "
                         "samples (results equal to in-process unless a sample times out; a learned reward's may "
                         "differ in the last bits, its batches padded differently). Learned rewards (reward_model, "
                         "llm_judge) are scored in this process either way: one model copy per rank")
    timeout_s: float = Field(30.0, gt=0, le=3600, json_schema_extra=NOT_RESULT,
                             description="with workers >= 2: seconds one sample may take; a sample past it (or "
                             "whose worker dies) is unscorable, its worker killed and replaced")
    audit_examples: int = Field(3, ge=0, le=1000, description="scored completions shown per reward bucket in the audit")
