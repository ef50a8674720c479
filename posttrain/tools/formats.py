"""How a tool call looks in a completion and how its observation is rendered: the FORMATS registry.

A :class:`Format` has one closing tag (``stop``: the stop string that ends a turn at a call), ``parse(text)`` (the
turn's text -> the :class:`Call` in it), ``render(output)`` (the observation text appended after the call) and
``call(name, arg)`` (a call as the model writes it: what a tool-use SFT demo shows, ``posttrain.sft_data``).

- ``tag``: ``<tool=NAME>ARG</tool>`` answered by ``<obs>OUTPUT</obs>``; for models without a tool-calling chat
  template (the tiny default: 28 characters of tags per call and observation in its 128-character context).
- ``qwen``: Qwen2.5/Qwen3's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, answered as their chat
  templates render a tool message: the assistant turn closed, a user turn with ``<tool_response>``, a new
  assistant turn opened. The arguments' one value is the tool's argument (``{"code": "print(1)"}``). With
  ``tools.parallel_calls`` a turn ends at the model's ``<|im_end|>`` and may hold several calls, answered by one
  user turn with a ``<tool_response>`` each (``parse_all``, ``render_all``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """A parsed call: the tool's name (None: the call could not be read) and its argument; ``error`` says why
    a call could not be read."""

    name: str | None
    arg: str
    error: str = ""


def _tag_call(name: str, arg: str) -> str:
    return f"<tool={name}>{arg}</tool>"


@dataclass(frozen=True)
class Format:
    stop: str  # the closing tag: generation stops right after it
    parse: Callable[[str], Call | None]  # None: the text holds no complete call
    render: Callable[[str], str]  # tool output -> observation text
    call: Callable[[str, str], str] = _tag_call  # (tool name, argument) -> the call's text, closing tag included
    # tools.parallel_calls: every call of a turn that ended at the model's end of turn, and the one observation
    # answering them all (appended after that end-of-turn token); None: the format has no such turn
    parse_all: Callable[[str], list[Call]] | None = None
    render_all: Callable[[list[str]], str] | None = None
    turn_end: str = ""  # the text that closes a turn (qwen: <|im_end|>), put before render_all's when missing


TAG_RE = re.compile(r"<tool=([^>\s]*)>([\s\S]*?)</tool>")


def _parse_tag(text: str) -> Call | None:
    if "</tool>" not in text:
        return None
    m = next(reversed(list(TAG_RE.finditer(text))), None)  # the last call (a turn stops at its first close)
    return Call(m.group(1), m.group(2)) if m else Call(None, "", "no <tool=NAME> before </tool>")


QWEN_RE = re.compile(r"<tool_call>([\s\S]*?)</tool_call>")


def _parse_qwen(text: str) -> Call | None:
    if "</tool_call>" not in text:
        return None
    m = next(reversed(list(QWEN_RE.finditer(text))), None)
    return _qwen_body(m.group(1)) if m else Call(None, "", "no <tool_call> before </tool_call>")


def _parse_qwen_all(text: str) -> list[Call]:
    """Every ``<tool_call>`` of a turn, in order ([]: none, the turn is an answer)."""
    if "</tool_call>" not in text:
        return []
    return [_qwen_body(m.group(1)) for m in QWEN_RE.finditer(text)] or [
        Call(None, "", "no <tool_call> before </tool_call>")]


def _qwen_body(body: str) -> Call:
    try:
        obj = json.loads(body)
    except ValueError:
        return Call(None, "", "the call is not JSON")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, "", 'the call has no "name"')
    args = obj.get("arguments", "")
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip().startswith("{") else args
        except ValueError:
            pass
    if isinstance(args, dict):
        if len(args) != 1 or not isinstance(next(iter(args.values())), str):
            return Call(obj["name"], "", "arguments must hold one string")
        args = next(iter(args.values()))
    return Call(obj["name"], str(args))


ARG_KEYS = {"python": "code", "calc": "expression"}  # the JSON key a qwen call's argument is written under


def _qwen_call(name: str, arg: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {ARG_KEYS.get(name, "input"): arg}}) + "</tool_call>"


def _qwen_responses(outs: list[str]) -> str:
    """Qwen2.5's template for consecutive tool messages, after the assistant turn's ``<|im_end|>``: one user turn
    holding a ``<tool_response>`` per call, in the calls' order, then the assistant's turn opened."""
    return ("\n<|im_start|>user" + "".join(f"\n<tool_response>\n{o}\n</tool_response>" for o in outs)
            + "<|im_end|>\n<|im_start|>assistant\n")


FORMATS: dict[str, Format] = {
    "tag": Format("</tool>", _parse_tag, lambda out: f"<obs>{out}</obs>", _tag_call),
    "qwen": Format("</tool_call>", _parse_qwen, lambda out: "<|im_end|>" + _qwen_responses([out]), _qwen_call,
                   _parse_qwen_all, _qwen_responses, "<|im_end|>"),
}
