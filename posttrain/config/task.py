"""``task:``: what the problems are and how an answer is verified."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from posttrain.config.base import Refusal, Section


class ArithTask(Section):
    """The embedded synthetic task: ``a*b=`` with a multi-digit ``a`` and a one-digit ``b``.

    Its chain of thought multiplies digit by digit from the right with explicit carries and ends in
    ``answer: <n>``; the verifier is an exact integer check.
    """

    kind: Literal["arith"] = Field("arith", description="the embedded synthetic task")
    min_digits: int = Field(2, ge=1, le=12, description="fewest digits of the multi-digit factor a")
    max_digits: int = Field(4, ge=1, le=12, description="most digits of a (difficulty knob)")
    min_multiplier: int = Field(2, ge=0, le=9, description="smallest one-digit factor b")
    max_multiplier: int = Field(9, ge=0, le=9, description="largest one-digit factor b")

    @model_validator(mode="after")
    def _ranges(self) -> ArithTask:
        if self.min_digits > self.max_digits:
            raise Refusal("min_digits", "must be <= max_digits")
        if self.min_multiplier > self.max_multiplier:
            raise Refusal("min_multiplier", "must be <= max_multiplier")
        return self


class MathTask(Section):
    """Math word problems (GSM8K / MATH / AIME formats), scored with ``math-verify``."""

    kind: Literal["math"] = Field("math", description="math word problems, verified with math-verify")


TaskSpec = Annotated[ArithTask | MathTask, Field(discriminator="kind")]
