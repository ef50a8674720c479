"""``sft:``: the cold-start supervised fine-tuning (phases, batch, optimizer, checkpoints)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.base import MAX_BATCH, MAX_COUNT, MAX_LR, NOT_RESULT, Refusal, Section, token_budget

MAX_SEQ_LEN = 1_048_576  # tokens of one demo (prompt + completion): beyond today's longest contexts


class SftPhase(Section):
    """One phase of the cold start. The default mixed-format cold start is two phases: full chain-of-thought
    demos, then a short phase whose demos are mostly bare answers (``4738*7=`` -> ``answer: 33166``).
    The model then answers directly by default (often wrong) but can still reason when it samples a CoT:
    exactly what RL can reinforce (an SFT model merely stopped early gives GRPO nothing to work with)."""

    steps: int = Field(ge=1, le=MAX_COUNT, description="optimizer steps in this phase")
    cot_frac: float = Field(1.0, ge=0, le=1, description="share of demos shown with their full solution; "
                            "the rest show the bare final answer")
    tool_frac: float = Field(0.0, ge=0, le=1, description="share of demos shown calling a tool, then answering "
                             "from its observation (the arith task's calc call, in tools.format; the observation "
                             "is masked out of the loss; docs/tools.md); cot_frac + tool_frac <= 1, the rest "
                             "bare answers")

    @model_validator(mode="after")
    def _shares(self) -> SftPhase:
        if self.cot_frac + self.tool_frac > 1 + 1e-9:
            raise Refusal("tool_frac", f"cot_frac + tool_frac = {self.cot_frac + self.tool_frac:g} > 1")
        return self


class Sft(Section):
    """The sft stage (and the distillation student's cold start, which uses the same recipe)."""

    phases: list[SftPhase] = Field(min_length=1, description="run in order; the LR schedule spans all phases")
    batch_size: int = Field(64, ge=1, le=MAX_BATCH,
                            description="sequences per optimizer step (micro_batch * accumulation)")
    micro_batch_size: int = Field(64, ge=1, le=MAX_BATCH,
                                  description="sequences per forward pass (gradient accumulation "
                                  "up to batch_size; exact token-mean either way)", json_schema_extra=NOT_RESULT)
    max_tokens_per_micro_batch: int | None = token_budget()
    lr: float = Field(2e-3, gt=0, le=MAX_LR, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    warmup_steps: int = Field(20, ge=0, le=MAX_COUNT, description="linear warmup, then cosine decay to 0")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="clip the global gradient norm to this")
    checkpoint_every: int = Field(100, ge=1, le=MAX_COUNT, description="save a resumable checkpoint every N steps",
                                  json_schema_extra=NOT_RESULT)
    log_every: int = Field(10, ge=1, le=MAX_COUNT, description="write a training-log row every N steps")
    max_seq_len: int | None = Field(None, ge=2, le=MAX_SEQ_LEN,
                                    description="longest demo (prompt + completion tokens) that trains; "
                                    "null = no limit. What happens to longer ones: sft.overlong")
    overlong: Literal["drop", "truncate"] = Field(
        "drop", description="a demo longer than max_seq_len: drop it, or truncate (keep the prompt, cut the "
        "completion's tail). A demo whose prompt leaves no completion token within the limit is dropped either "
        "way; every case is counted in metrics/sft.json")
    batching: Literal["padded", "grouped", "packed"] = Field(
        "padded", description="micro-batch layout: padded (in sampling order, padded to the longest), grouped "
        "(the step's demos sorted by length first, so a micro-batch pads less), packed (each micro-batch's "
        "demos packed into block-diagonal rows of up to 2x its longest, capped at max_seq_len). The loss is "
        "the same token-mean either way", json_schema_extra=NOT_RESULT)

    @property
    def tool_demos(self) -> bool:
        """Whether any phase shows tool-use demos (then the demos are also tokenized in the ``tool`` style)."""
        return any(p.tool_frac > 0 for p in self.phases)

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)
