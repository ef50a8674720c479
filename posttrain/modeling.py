"""The only place that builds, loads or saves models and tokenizers, plus log-prob helpers.

- ``model.base: tiny`` builds a small Llama-architecture model from ``model.tiny`` and a character-level
  tokenizer (built with ``tokenizers``, saved as a standard ``PreTrainedTokenizerFast`` with a chat
  template). Both are saved with ``save_pretrained`` and reload offline with ``AutoModelForCausalLM`` /
  ``AutoTokenizer`` (and vLLM) from the folder.
- Anything else is a local HF folder or a hub id, loaded with ``from_pretrained``. With
  ``HF_HUB_OFFLINE=1`` an id that is not cached fails fast with :class:`ModelLoadError`.
"""

from __future__ import annotations

import contextlib
import os
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from posttrain.config import ModelCfg, TinyModel
from posttrain.errors import ModelLoadError

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# Chat template of the character tokenizer: BOS, the user turn, a newline, then the assistant turn + EOS.
# Real models bring their own template; the pipeline only ever calls apply_chat_template.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII + newline, with pad/bos/eos/unk specials."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_model(cfg: TinyModel, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama of the configured size (deterministic under ``seed``)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def _is_local(name: str) -> bool:
    return Path(name).exists() or name.startswith((".", "/")) or os.sep + os.sep in name


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Tokenizer from a local folder or hub id; left padding for generation; a pad token guaranteed."""
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_load_hint(name, e)) from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name: str, dtype: str = "float32", device: str | torch.device = "cpu", trainable: bool = False
               ) -> PreTrainedModel:
    """Causal LM from a local folder or hub id, in eval mode on ``device``.

    ``trainable``: the weights are fp32 masters whatever ``dtype`` is (the optimizer then keeps fp32 state
    too); run forward/backward under :func:`autocast` in ``dtype``. Otherwise (inference only) the weights
    are stored in ``dtype``."""
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32 if trainable else getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise ModelLoadError(_load_hint(name, e)) from None
    return model.to(device).eval()


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Mixed precision: ops inside run in ``dtype`` where autocast allows (matmuls), reductions stay fp32.
    A no-op for float32, so the default path is bit-for-bit what it was. Gradients land in the fp32 masters."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def _load_hint(name: str, e: Exception) -> str:
    if _is_local(name) and not Path(name).exists():
        return f"model {name!r}: no such folder"
    if os.environ.get("HF_HUB_OFFLINE") == "1" and not Path(name).exists():
        return f"model {name!r}: not a local folder and HF_HUB_OFFLINE=1 (hub ids need the hub or a cache)"
    return f"model {name!r}: {str(e).splitlines()[0]}"


def init_base(cfg: ModelCfg, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The starting policy (fp32 master weights): built from ``model.tiny`` when ``model.base == 'tiny'``,
    else loaded."""
    if cfg.base == "tiny":
        tok = build_char_tokenizer()
        return build_tiny_model(cfg.tiny, tok, seed), tok
    return load_model(cfg.base, cfg.dtype, trainable=True), load_tokenizer(cfg.base)


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """``save_pretrained`` model + tokenizer into ``path`` (a standard HF folder)."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def checkpoint_digest(path: str | Path) -> str:
    """Short sha256 of a checkpoint folder's weight files (what sampled a rollout), or of a hub id's name."""
    import hashlib

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) if p.is_dir() else []
    if not files:
        return f"name:{path}"
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def resolve_device(pref: str) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def completion_logprobs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Log-prob of each token given its prefix.

    input_ids, attention_mask: [B, T]. Returns [B, T-1]: entry t is log p(input_ids[:, t+1] | <= t).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # [B, T-1, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
