"""``tools:``: multi-turn tool-use rollouts (:mod:`posttrain.tools`): a completion may call a tool, the tool's
output comes back as an observation, and generation continues, up to ``max_turns`` calls. Off by default: the
default pipeline samples single-turn completions, and its outputs are those of a pipeline without this section.

Where tools run: the rollout, rl, distill and evaluate stages, with the hf or the vllm backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.base import Refusal, Section, registered
from posttrain.config.names import PARALLEL_TOOL_FORMATS, TOOL_FORMATS, TOOLS


class ToolsCfg(Section):
    """Which tools a completion may call, in which call format, and how many times."""

    enabled: bool = Field(False, description="multi-turn tool-use rollouts in rollout, rl, distill and evaluate")
    names: list[str] = Field(["python", "calc"], min_length=1, max_length=len(TOOLS),
                             description=f"the tools a completion may call (of {list(TOOLS)}); a call to any "
                             "other name gets an error observation")
    format: Literal[TOOL_FORMATS] = Field(
        "tag", description="tag: <tool=NAME>ARG</tool> answered by <obs>OUT</obs> (models without a tool-calling "
        "chat template; short, for the tiny model's context); qwen: <tool_call>{json}</tool_call> answered by a "
        "<tool_response> user turn (Qwen2.5/Qwen3 chat templates)")
    max_turns: int = Field(2, ge=1, le=64, description="turns that call tools per completion at most (one call "
                           "each, or several with parallel_calls); after the last one the model generates once "
                           "more and its calls are not run")
    parallel_calls: bool = Field(False, description="several calls in one turn (qwen format): a turn ends at the "
                                 "model's end of turn instead of its first closing tag, every call in it runs, and "
                                 "the outputs come back in one tool message, as Qwen's chat template renders "
                                 "parallel calls")
    max_obs_chars: int = Field(32, ge=1, le=100_000, description="characters of a tool's output kept in the "
                               "observation (cut at the end)")

    @field_validator("names")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        for n in v:
            registered("tool", n, TOOLS)
        if len(set(v)) != len(v):
            raise ValueError(f"a tool is named twice: {v}")
        return v

    @model_validator(mode="after")
    def _rules(self) -> ToolsCfg:
        if self.parallel_calls and self.format not in PARALLEL_TOOL_FORMATS:
            raise Refusal("parallel_calls", f"true with format {self.format!r}: only {list(PARALLEL_TOOL_FORMATS)} "
                          "has an end of turn that closes several calls; set parallel_calls: false")
        return self
