"""``reward_model:``: the optional Bradley-Terry reward-model stage (one ``reward_model@<name>`` DVC stage per
entry of ``models``; ``models: {}``, the default, means no such stage exists and ``dvc repro`` never runs it)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from posttrain.config import names
from posttrain.config.base import MAX_BATCH, MAX_COUNT, MAX_LR, MAX_ROWS, NOT_RESULT, Refusal, Section, registered

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a DVC stage key, a folder name and an MLflow run-name part
MAX_MEMBERS = 64


class RewardModel(Section):
    """Bradley-Terry reward models (loss -log sigmoid(r(chosen) - r(rejected))), each an ensemble of
    ``members`` copies of the SFT policy with a scalar head, trained on preference pairs."""

    models: dict[str, Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict,
        description="name -> pairs source, one DVC stage reward_model@<name> each (the source is its dep): the "
        "reward stage's folder (paths.reward_dir: a correct and an incorrect completion of one prompt make a "
        "pair) or a preference JSONL file (prompt/chosen/rejected strings, or HF chat-message lists). "
        "{} = no reward-model stage (the default pipeline)")
    members: int = Field(1, ge=1, le=MAX_MEMBERS, description="K: ensemble members, each with its own seed (head "
                         "init, batch order) and, with bootstrap, its own resample of the training pairs")
    bootstrap: bool = Field(True, description="members > 1: each member trains on a resample with replacement "
                            "of the training pairs (one member trains on all of them)")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed offset of the members (with the pipeline seed): "
                      "the seeds of an RM arm on the same pairs")
    steps: int = Field(200, ge=1, le=MAX_COUNT, description="optimizer steps per member")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="pairs per optimizer step")
    micro_batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="pairs per forward (2x sequences: "
                                  "chosen and rejected); gradient accumulation up to batch_size",
                                  json_schema_extra=NOT_RESULT)
    lr: float = Field(1e-4, gt=0, le=MAX_LR, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    warmup_steps: int = Field(10, ge=0, le=MAX_COUNT, description="linear warmup, then cosine decay to 0")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="clip the global gradient norm to this")
    heldout_frac: float = Field(0.1, gt=0, lt=1, description="share of prompts (all their pairs) held out for "
                                "the pairwise accuracy; split by a hash of the prompt, so a prompt never "
                                "straddles train and held-out")
    max_pairs: int | None = Field(None, ge=2, le=MAX_ROWS, description="at most this many pairs (after dedup "
                                  "and decontamination, drawn by seed) enter the split: the N of a data-size "
                                  "arm; null = all")
    pairs_per_prompt: int = Field(4, ge=1, le=MAX_BATCH, description="pairs built from rollouts: at most this "
                                  "many (correct, incorrect) pairs per prompt, drawn by seed from all c x w")
    verifier: str = Field("correct", description="pairs built from rollouts: the reward component (a REWARDS "
                          "name in reward.rewards) whose 1 marks a correct completion and 0 an incorrect one")
    max_len: int | None = Field(None, ge=2, le=1_048_576, description="longest prompt + completion in tokens; "
                                "a pair with a longer side is dropped (counted). null: the model's context")
    max_quarantined_frac: float = Field(0.5, ge=0, le=1, description="a preference file with more malformed "
                                        "rows than this share fails the stage (a wrong file or format)")
    eval_batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="sequences per forward when scoring the "
                                 "held-out pairs", json_schema_extra=NOT_RESULT)
    checkpoint_every: int = Field(50, ge=1, le=MAX_COUNT, description="save a resumable checkpoint every N "
                                  "steps (and at each member's end)", json_schema_extra=NOT_RESULT)
    log_every: int = Field(10, ge=1, le=MAX_COUNT, description="write a training-log row every N steps")

    @field_validator("models")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not NAME.fullmatch(name):
                raise ValueError(f"reward model name {name!r}: letters, digits, '_' and '-' only (a DVC stage key "
                                 "and a folder name)")
        return v

    @field_validator("verifier")
    @classmethod
    def _verifier(cls, v: str) -> str:
        return registered("reward", v, names.REWARDS)

    @model_validator(mode="after")
    def _rules(self) -> RewardModel:
        if self.micro_batch_size > self.batch_size:
            raise Refusal("micro_batch_size", f"{self.micro_batch_size} > batch_size {self.batch_size}")
        return self
