"""``distill:``: teacher -> student through the sparse-to-dense bridge (cold start, forward-KL warmup,
on-policy distillation, optional student GRPO)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.config import names
from posttrain.config.base import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_LR,
    MAX_NEW_TOKENS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_TEMPERATURE,
    NOT_RESULT,
    Section,
    token_budget,
)
from posttrain.config.model import TinyModel


class DistillPhase(Section):
    """Shared knobs of the warmup (A) and on-policy (B) phases."""

    steps: int = Field(0, ge=0, le=MAX_COUNT, description="optimizer steps in this phase (0 = skip the phase)")
    prompts_per_step: int = Field(16, ge=1, le=MAX_BATCH, description="training prompts per step")
    samples_per_prompt: int = Field(4, ge=1, le=MAX_SAMPLES, description="completions per prompt")
    lr: float = Field(1e-4, gt=0, le=MAX_LR, description="AdamW learning rate (constant)")


class DistillWarmup(DistillPhase):
    """Phase A: the student learns from the teacher's own samples (forward KL)."""

    targets: Literal["soft", "hard"] = Field(
        "soft", description="soft: token-level forward KL to the teacher's distributions; hard: SFT on the samples")
    filter_correct: bool = Field(False, description="keep only teacher samples the task verifier accepts "
                                 "(rejection sampling)")


class DistillOnPolicy(DistillPhase):
    """Phase B: on-policy distillation: the student samples, the teacher scores the same tokens."""

    divergence: Literal[names.DIVERGENCES] = Field(
        "reverse_kl", description="per-token divergence (posttrain.divergences.DIVERGENCES)")
    beta: float = Field(0.5, ge=0, le=1, description="generalized JSD interpolation (0 = forward, 1 = reverse KL)")
    student_frac: float = Field(1.0, ge=0, le=1, description="share of prompts sampled by the student; the rest "
                                "are sampled by the teacher")


class TeacherLayers(Section):
    """A student cut from the teacher: ``layers`` of its decoder layers, evenly spaced with the first and the last
    kept, and its embeddings, final norm and head (DistilBERT's initialisation, Sanh et al. 2019, took one layer
    in two; Gromov et al. 2024 and Minitron, Muralidharan et al. 2024, find that depth-pruned models keep
    more of the teacher when the first and last layers stay). Same tokenizer and width as the teacher."""

    layers: int = Field(ge=1, le=1024, description="decoder layers the student keeps (fewer than the teacher's)")


class Distill(Section):
    """The distill stage: a teacher checkpoint into a smaller student through its own cold start, then phases
    A (warmup), B (on-policy distillation) and optionally C (student GRPO with the rl section)."""

    teacher: str = Field(min_length=1,
                         description="teacher checkpoint (a paths.* alias); must share the student's tokenizer")
    student: TinyModel | TeacherLayers | str = Field(
        default_factory=lambda: TinyModel(num_layers=2),
        description="a size (a fresh Llama built like model.tiny, with the teacher's tokenizer and vocabulary "
        "size); {layers: N}: the teacher cut to N of its decoder layers (evenly spaced, first and last kept: "
        "TeacherLayers); or a pretrained model: a local HF folder or hub id (e.g. a smaller model of the "
        "teacher's family). Either way the student first gets its own cold start (the sft recipe); model.lora "
        "applies to it too")
    student_revision: str | None = Field(None, description="hub revision of a pretrained student")
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="added to the pipeline seed for phases A-C's sampling and prompt order "
                      "(not the student's init or cold start): seeds of a distillation arm on one teacher")
    warmup: DistillWarmup = Field(default_factory=DistillWarmup)
    on_policy: DistillOnPolicy = Field(default_factory=DistillOnPolicy)
    grpo_steps: int = Field(0, ge=0, le=MAX_COUNT,
                            description="phase C: student GRPO after the bridge, with the rl section's "
                            "algorithm settings (0 = off)")
    temperature: float = Field(1.0, gt=0, le=MAX_TEMPERATURE,
                               description="sampling temperature of phases A and B; the divergences "
                               "compare student and teacher distributions of logits / temperature")
    max_new_tokens: int = Field(80, ge=1, le=MAX_NEW_TOKENS,
                                description="longest completion sampled in phases A and B, in tokens")
    micro_batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="sequences per forward/backward",
                                  json_schema_extra=NOT_RESULT)
    max_tokens_per_micro_batch: int | None = token_budget()
    checkpoint_every: int = Field(10, ge=1, le=MAX_COUNT,
                                  description="resumable checkpoint every N steps of phases A-C",
                                  json_schema_extra=NOT_RESULT)
