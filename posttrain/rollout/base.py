"""The rollout contract every backend implements: sampling parameters, one completion, the backend Protocol,
and chat-formatted prompt ids (so no backend adds a second BOS). The backends (``hf.py``, ``vllm.py``) import
these; the registry (``posttrain.rollout``) imports the backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 96
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings of this call, besides the model's own (the tool loop's call tags)


@dataclass(frozen=True)
class ModelFolder:
    """A model folder (or hub id) not loaded yet: what a stage that only generates (rollout, evaluate) hands
    its backend. The hf backend loads it (``modeling.load_model``) onto ``device`` in ``dtype``; the vllm engine
    loads the folder itself, so no second copy of the weights sits on the device beside the engine's."""

    path: str
    dtype: str = "float32"
    device: Any = "cpu"


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated tokens, EOS included when finish_reason == "stop"
    logprobs: list[float]  # sampler log-prob of each generated token, same length as token_ids
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_new_tokens)
    # multi-turn tool rollouts only (posttrain.tools.loop; None for a single-turn completion): 1 where token_ids
    # holds a model token, 0 an observation token (its logprobs entry is 0), and the number of tool calls
    loss_mask: list[int] | None = None
    tool_calls: int | None = None
    model_text: str | None = None  # the model's turns only, observations left out (None: single-turn, all of text)

    @property
    def scored_text(self) -> str:
        """What a reward or a verifier reads: the model's own words, never a tool's observation (which could hold
        the answer, a \\boxed{} say, that the model did not write)."""
        return self.text if self.model_text is None else self.model_text

    @property
    def model_tokens(self) -> int:
        """The tokens the model generated (observation tokens are not the model's: lengths and length rewards
        count these)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)


class RolloutBackend(Protocol):
    samples_with_module: bool  # True: samples with the trainer's model itself (hf); False: copies the weights into
    # its own engine (vllm), so under FSDP2 it takes them streamed (``Dist.for_generation``), never a full copy

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        ...

    def load_weights(self, model: Any, version: str) -> None:
        ...

    def release(self) -> None:
        ...


def cut_before(text: str, strings: list[str]) -> str:
    """``text`` up to the first of ``strings`` in it (all of it when none is): a completion's text ends before
    the model's own stop strings (as vLLM returns it)."""
    cuts = [text.find(x) for x in strings if x in text]
    return text[: min(cuts)] if cuts else text


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Token ids of each user prompt rendered with the tokenizer's chat template + generation prompt."""
    out = []
    for p in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc))
    return out
