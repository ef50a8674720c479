"""The multi-turn tool loop: a :class:`ToolBackend` wraps any rollout backend (the Protocol of
:mod:`posttrain.rollout.base`) and generates a turn at a time.

Turn 0 is the backend's own call with the format's closing tag added to the stop strings (``SamplingParams.stop``):
a row that closes a call stops there while the rest of its batch keeps decoding. For each row that called, the tool
runs (:func:`observe`), its observation text is tokenized once (``add_special_tokens=False``) and appended as token
ids, and every such row continues in one call of the backend from prompt ids + every token so far (turn ``k`` seeded
``seeds.tool_turn(seed, k)``), n=1. The conversation is never re-tokenized: the ids a turn generated are the ids the
next turn is conditioned on and the ids the trainer scores (re-tokenizing decoded text can merge or split tokens at
turn boundaries, the drift of verl#6501 and NeMo-RL#2821). After ``max_turns`` calling turns the model generates once
more without the call tag as a stop string.

With ``tools.parallel_calls`` (formats with an end of turn: ``qwen``) no closing tag is a stop string: a turn ends
at the model's end-of-turn token, every call in it runs (``Format.parse_all``), and one observation answers them
all (``Format.render_all``: Qwen's rendering of consecutive tool messages); a turn without a call is the answer.

A row's tokens, model and observation together, stay within ``max_new_tokens`` (so the context check of the config
holds): a turn is cut at the row's remaining budget, an observation too (finish ``length``).

The completion: ``token_ids`` every token in order, ``logprobs`` the sampler's for model tokens and 0 for observation
tokens, ``loss_mask`` 1 / 0 for them, ``tool_calls`` the calls run, ``text`` the whole transcript,
``model_text`` the model's turns alone (what rewards and verifiers score: an observation's text is never taken
for the model's answer), ``finish_reason`` that of the last turn. Same seed, same transcripts.

Why by hand: the libraries that run such loops (verl's agent loop, ``verifiers``, SkyRL-gym) come with their own
trainers, servers or async engines; this is the loop alone, ~100 lines, over the backends the pipeline has. The
prefill is redone at each turn (no KV cache kept across tool calls): cheap at these lengths.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from posttrain import seeds
from posttrain.config import ToolsCfg
from posttrain.rollout.base import Completion, RolloutBackend, SamplingParams
from posttrain.tools.builtin import TOOLS, ToolContext
from posttrain.tools.formats import FORMATS, Call, Format


def observe(call: Call, names: list[str], ctx: ToolContext, max_chars: int) -> str:
    """The observation's output text for ``call``: the tool's (``TOOLS``), an error for a call that could not be
    read or names a tool not in ``names``; stripped and cut to ``max_chars``."""
    if call.name is None:
        out = f"error: {call.error}"
    elif call.name not in names:
        out = f"error: unknown tool {call.name!r}"
    elif call.error:
        out = f"error: {call.error}"
    else:
        out = TOOLS[call.name](call.arg, ctx)
    return out.strip()[:max_chars]


def observation_ids(tok: Any, fmt: Format, out: str) -> list[int]:
    """The token ids of the observation of tool output ``out``, exactly as the loop appends them (the format's
    rendering tokenized once, ``add_special_tokens=False``); a tool-use SFT demo shows these same ids."""
    return text_ids(tok, fmt.render(out))


def text_ids(tok: Any, text: str) -> list[int]:
    """An observation's text as the ids appended: tokenized once, no special tokens added."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


@dataclasses.dataclass
class _Row:
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    calls: int = 0
    head: str = ""  # the transcript before the current turn
    text: str = ""
    said_head: str = ""  # the model's turns before the current one (no observation)
    said: str = ""
    finish: str = "length"
    pending: list[Call] = dataclasses.field(default_factory=list)  # the last turn's calls, not run yet

    def add_turn(self, c: Completion, budget: int, tok: Any, parse: Any) -> None:
        """Append one generated turn, cut to ``budget`` tokens (then finish ``length``, no call)."""
        ids, lps, finish = list(c.token_ids), list(c.logprobs), c.finish_reason
        if len(ids) > budget:
            ids, lps, finish = ids[:budget], lps[:budget], "length"
        self.tokens += ids
        self.logprobs += lps
        self.mask += [1] * len(ids)
        self.finish = finish
        self.pending = parse(tok.decode(ids)) if finish == "stop" else []
        turn = c.text if len(ids) == len(c.token_ids) else tok.decode(ids, skip_special_tokens=True)
        self.text, self.said = self.head + turn, self.said_head + turn

    def add_obs(self, ids: list[int], text: str) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.calls += len(self.pending)
        self.head = self.text = self.text + text
        self.said_head = self.said
        self.pending = []


class ToolBackend:
    """A rollout backend whose completions may call tools (module docstring). ``ctx``: what the tools use
    (default: the stage's sandbox); ``workers``: tool calls run at once."""

    def __init__(self, inner: RolloutBackend, tokenizer: Any, cfg: ToolsCfg, ctx: ToolContext | None = None,
                 workers: int = 4) -> None:
        self.inner, self.tok, self.cfg = inner, tokenizer, cfg
        self.ctx, self.workers = ctx or ToolContext(), workers
        self.fmt = fmt = FORMATS[cfg.format]
        if cfg.parallel_calls:  # a turn ends at the model's end of turn; all its calls, one observation
            self.parse, self.render, self.stop = fmt.parse_all, fmt.render_all, ()
        else:  # a turn ends at its first call's closing tag
            self.parse = lambda text: [c] if (c := fmt.parse(text)) is not None else []
            self.render, self.stop = lambda outs: fmt.render(outs[0]), (fmt.stop,)

    @property
    def samples_with_module(self) -> bool:
        return getattr(self.inner, "samples_with_module", True)

    def load_weights(self, model: Any, version: str) -> None:
        self.inner.load_weights(model, version)

    def release(self) -> None:
        self.inner.release()

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        cap = sampling.max_new_tokens
        with_stop = dataclasses.replace(sampling, stop=(*sampling.stop, *self.stop))
        rows = [_Row(list(p)) for p in prompt_ids for _ in range(n)]
        first = [c for group in self.inner.generate(prompt_ids, n, with_stop) for c in group]
        for r, c in zip(rows, first, strict=True):
            r.add_turn(c, cap, self.tok, self.parse)
        for turn in range(1, self.cfg.max_turns + 1):
            live = [r for r in rows if r.pending]
            if not live:
                break
            self._run_tools(live, cap)
            live = [r for r in live if r.finish == "stop" and len(r.tokens) < cap]
            if not live:
                break
            budget = max(cap - len(r.tokens) for r in live)
            sp = dataclasses.replace(with_stop if turn < self.cfg.max_turns else sampling, max_new_tokens=budget,
                                     seed=seeds.tool_turn(sampling.seed, turn))
            outs = self.inner.generate([r.prompt + r.tokens for r in live], 1, sp)
            for r, group in zip(live, outs, strict=True):
                r.add_turn(group[0], cap - len(r.tokens), self.tok, self.parse)
        done = [Completion(r.text, r.tokens, r.logprobs, r.finish, r.mask, r.calls, r.said) for r in rows]
        return [done[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _run_tools(self, live: list[_Row], cap: int) -> None:
        """Run every live row's calls (``workers`` at a time, across rows), append each row's observation ids (one
        observation answering all its calls; cut to the row's budget: then finish ``length``)."""
        calls = [c for r in live for c in r.pending]
        with ThreadPoolExecutor(self.workers, thread_name_prefix="tool") as ex:
            outs = iter(ex.map(lambda c: observe(c, self.cfg.names, self.ctx, self.cfg.max_obs_chars), calls))
        for r in live:
            text = self.render([next(outs) for _ in r.pending])
            end = self.fmt.turn_end if self.cfg.parallel_calls else ""
            if end and not self.tok.decode(r.tokens[-4 * len(end):]).endswith(end):  # stopped on another EOS
                text = end + text  # (Qwen's <|endoftext|>): the turn is closed as the template closes it
            ids = text_ids(self.tok, text)  # tokenized once; kept as ids
            room = cap - len(r.tokens)
            if len(ids) >= room:
                ids, r.finish = ids[:room], "length"
            r.add_obs(ids, self.tok.decode(ids, skip_special_tokens=True))
