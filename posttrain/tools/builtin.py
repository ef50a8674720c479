"""The TOOLS registry: one signature, ``fn(call: str, ctx: ToolContext) -> str``: the call's argument (the text
between the call tags, or the JSON call's one argument) in, the observation's text out (never raises for what
the call says: a bad call gets an ``error: ...`` observation). Adding a tool is one function here, its name in
``config.names.TOOLS``, and one test.

- ``python``: the argument is a program, run in the sandbox (:mod:`posttrain.sandbox`, the stage's ``sandbox:``
  limits); the observation is its stdout, or the error's last line. Where the sandbox cannot run, the
  ``SandboxUnavailable`` refusal propagates (a stage error): code is never run unsandboxed, and a rollout whose
  tool silently answered "unavailable" would train on a broken environment.
- ``calc``: an arithmetic expression (numbers, + - * / // % **, parentheses), evaluated by walking its ``ast``:
  nothing else parses, so no name, call or attribute is ever evaluated (no ``eval``)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _stage_sandbox() -> Any:
    from posttrain.tasks.codeexec import sandbox

    return sandbox()


@dataclass(frozen=True)
class ToolContext:
    """What a tool may use: the sandbox (built once per process, under the stage's ``sandbox:`` section)."""

    sandbox: Callable[[], Any] = field(default=_stage_sandbox)


def python(call: str, ctx: ToolContext) -> str:
    """Run ``call`` as a Python program in the sandbox: its stdout, or ``error: <last line>`` (the exception's
    line, or the limit it hit)."""
    r = ctx.sandbox().run(call)
    if r.ok:
        return r.stdout
    return f"error: {r.detail or r.status}"


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # x ** 10**9 would hold the process for minutes: an exponent past this is refused
MAX_DIGITS = 1000  # operands past this many digits are refused (repeated ** or * would grow without bound)


class NotArithmetic(ValueError):
    """The expression holds something other than numbers and arithmetic operators."""


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise NotArithmetic(f"exponent {b} past {MAX_EXPONENT}")
        out = _BINARY[type(node.op)](a, b)
        if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
            raise NotArithmetic(f"a result past {MAX_DIGITS} digits")
        return out
    raise NotArithmetic(type(node).__name__)


def calc(call: str, ctx: ToolContext) -> str:
    """Evaluate an arithmetic expression: ``12*(3+4)`` -> ``84``; ``7/2`` -> ``3.5``; anything else ->
    ``error: not arithmetic (<what>)``."""
    try:
        value = _eval(ast.parse(call.strip(), mode="eval"))
    except NotArithmetic as e:
        return f"error: not arithmetic ({e})"
    except SyntaxError:
        return "error: not arithmetic (syntax)"
    except (ArithmeticError, ValueError) as e:  # 1/0, 0 ** -1, a float past its range
        return f"error: {type(e).__name__}"
    return str(value) if isinstance(value, int) else f"{value:.12g}"


TOOLS: dict[str, Callable[[str, ToolContext], str]] = {"python": python, "calc": calc}
