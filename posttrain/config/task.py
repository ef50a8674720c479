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

    def max_prompt_chars(self) -> int:
        """The longest prompt the generator writes (``a*b=``): the context check."""
        return self.max_digits + 3


class CodeTask(Section):
    """Write a Python function; the reward runs its tests in the sandbox (``posttrain.tasks.code``).

    The synthetic generator's problems are list pipelines: ``def f(a): # odd, add 3, sum``, a few filter/map
    steps then a reduction, checked by ``num_tests`` asserts. HumanEval (a ``format: humaneval`` benchmark) is
    scored the same way."""

    kind: Literal["code"] = Field("code", description="Python functions checked by running their tests")
    min_steps: int = Field(1, ge=0, le=6, description="fewest filter/map steps before the reduction")
    max_steps: int = Field(2, ge=0, le=6, description="most steps (difficulty knob)")
    max_const: int = Field(19, ge=2, le=99, description="largest constant of a step (add K, over K, ...); test "
                           "lists hold integers in [-max_const-1, max_const+1]")
    num_tests: int = Field(4, ge=1, le=50, description="asserts per problem, on seeded random lists")
    max_list: int = Field(5, ge=1, le=50, description="longest input list of a test (1 to max_list elements)")

    @model_validator(mode="after")
    def _ranges(self) -> CodeTask:
        if self.min_steps > self.max_steps:
            raise Refusal("min_steps", "must be <= max_steps")
        return self

    def max_prompt_chars(self) -> int:
        """The longest prompt the generator writes (``def f(a): # `` + steps + reduction): the context check."""
        k = len(str(self.max_const))
        return len("def f(a): # ") + self.max_steps * (len("times ") + k + 2) + len("count")


class MathTask(Section):
    """Math word problems (GSM8K / MATH / AIME formats), scored with ``math-verify``."""

    kind: Literal["math"] = Field("math", description="math word problems, verified with math-verify")


TaskSpec = Annotated[ArithTask | CodeTask | MathTask, Field(discriminator="kind")]
