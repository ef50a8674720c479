"""Multi-turn tool use: a completion may call a tool, the tool's output comes back as an observation, and the
model goes on from there (docs/tools.md).

- :mod:`.builtin`: the ``TOOLS`` registry (``fn(call, ctx) -> observation``): ``python`` (the sandbox), ``calc``.
- :mod:`.formats`: the ``FORMATS`` registry: how a call is written and its observation rendered (``tag``, ``qwen``).
- :mod:`.loop`: ``ToolBackend``, any rollout backend made multi-turn (token ids kept as generated, a per-token
  ``loss_mask`` that keeps observation tokens out of the RL loss).

:func:`with_tools` is what a stage calls on the backend it built: the backend itself when ``tools.enabled`` is
false (single-turn, as before), else the tool loop around it.
"""

from __future__ import annotations

from typing import Any

from posttrain.config import SandboxCfg, ToolsCfg
from posttrain.rollout.base import RolloutBackend
from posttrain.tools.builtin import TOOLS, ToolContext
from posttrain.tools.formats import FORMATS, Call, Format
from posttrain.tools.loop import ToolBackend, observe

__all__ = ["FORMATS", "TOOLS", "Call", "Format", "ToolBackend", "ToolContext", "observe", "with_tools"]


def with_tools(backend: RolloutBackend, tokenizer: Any, cfg: ToolsCfg, sandbox: SandboxCfg | None = None
               ) -> RolloutBackend:
    """``backend`` unchanged when tools are off; else a :class:`ToolBackend` around it, its tool calls run
    ``sandbox.workers`` at a time."""
    if not cfg.enabled:
        return backend
    return ToolBackend(backend, tokenizer, cfg, workers=(sandbox or SandboxCfg()).workers)
