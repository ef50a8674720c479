"""Tool-use SFT demonstrations: the token ids of one tool call and of its observation, as a rollout would hold them.

A task that can show a tool call (``posttrain.tasks.Task.tool_call``: the arithmetic task's ``4821*7=`` ->
``calc`` of ``4821*7``) gets a third demo style, ``tool`` (``sft.phases[*].tool_frac``)::

    <tool=calc>4821*7</tool><obs>33747</obs>answer: 33747

:func:`demo_turn` returns the call's ids (as the model would write them, a target of the loss) and the
observation's ids: the tool actually run on the argument (``loop.observe``, the same cut to ``max_obs_chars``)
and tokenized by ``loop.observation_ids``, the function the rollout loop appends observations with. So the
observation a demo shows is, token for token, what the loop would append after that call; the SFT loss masks it
out (the model never learns to write observations, only to call and to use them)."""

from __future__ import annotations

from typing import Any

from posttrain.config import ToolsCfg
from posttrain.tools.builtin import ToolContext
from posttrain.tools.formats import FORMATS, Call
from posttrain.tools.loop import observation_ids, observe


def demo_turn(tok: Any, cfg: ToolsCfg, name: str, arg: str, ctx: ToolContext | None = None
              ) -> tuple[list[int], list[int]]:
    """``(call ids, observation ids)`` of calling tool ``name`` on ``arg`` in ``cfg.format``: the call tokenized as
    text (``add_special_tokens=False``), the observation the tool's real output as the loop appends it."""
    fmt = FORMATS[cfg.format]
    out = observe(Call(name, arg), cfg.names, ctx or ToolContext(), cfg.max_obs_chars)
    call = list(tok(fmt.call(name, arg), add_special_tokens=False)["input_ids"])
    return call, observation_ids(tok, fmt, out)
