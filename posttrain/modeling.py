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
import json
import os
import string
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from posttrain.config import LoraCfg, ModelCfg, PromptCfg, TinyModel
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


def build_tiny_model(cfg: TinyModel, tokenizer: PreTrainedTokenizerBase, seed: int, vocab_size: int | None = None
                     ) -> LlamaForCausalLM:
    """A freshly initialised Llama of the configured size (deterministic under ``seed``); ``vocab_size``
    defaults to the tokenizer's length (a real teacher's config may have more rows: pass its own)."""
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
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


def load_tokenizer(name: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    """Tokenizer from a local folder or hub id; left padding for generation; a pad token guaranteed."""
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_load_hint(name, e)) from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name: str, dtype: str = "float32", device: str | torch.device = "cpu", trainable: bool = False,
               revision: str | None = None, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """Causal LM from a local folder or hub id, in eval mode on ``device``.

    ``trainable``: the weights are fp32 masters whatever ``dtype`` is (the optimizer then keeps fp32 state
    too); run forward/backward under :func:`autocast` in ``dtype``. Otherwise (inference only, or the frozen
    base under LoRA) the weights are stored in ``dtype``."""
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32 if trainable else getattr(torch, dtype),
                                                     revision=revision, attn_implementation=attn_implementation)
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


def init_base(cfg: ModelCfg, seed: int, meta: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The starting policy and its tokenizer, prompt format and stops applied (:func:`apply_prompt`): built from
    ``model.tiny`` when ``model.base == 'tiny'``, else loaded (at ``model.revision``). fp32 master weights,
    or the frozen base in ``model.dtype`` when LoRA is on; not yet made trainable (:func:`make_trainable`).
    ``meta`` (``Dist.loads_on_meta``): a loaded base is built on the meta device, its weights read by rank 0
    only (see :func:`load_policy`); the tiny base is built on every rank (cheap, deterministic)."""
    if cfg.base == "tiny":
        tok = build_char_tokenizer()
        model = build_tiny_model(cfg.tiny, tok, seed)
    elif meta:
        model = empty_model(cfg.base, cfg.attn_implementation, cfg.revision)
        tok = load_tokenizer(cfg.base, cfg.revision)
    else:
        model = load_model(cfg.base, cfg.dtype, trainable=cfg.lora is None, revision=cfg.revision,
                           attn_implementation=cfg.attn_implementation)
        tok = load_tokenizer(cfg.base, cfg.revision)
    apply_prompt(model, tok, cfg.prompt, cfg.base)
    return model, tok


def load_policy(name: str, cfg: ModelCfg, device: torch.device, meta: bool = False) -> PreTrainedModel:
    """A model folder to train: fp32 masters for full fine-tuning, or the base in ``cfg.dtype`` + fresh LoRA
    adapters (:func:`make_trainable`). ``meta`` (FSDP2 ranks but rank 0: ``Dist.loads_on_meta``): built on the
    meta device from the folder's config, no weight read; ``Dist.wrap`` shards it and rank 0 broadcasts the
    weights."""
    if meta:
        model = empty_model(name, cfg.attn_implementation)
    else:
        model = load_model(name, cfg.dtype, device, trainable=cfg.lora is None,
                           attn_implementation=cfg.attn_implementation)
    return make_trainable(model, cfg.lora, cfg.gradient_checkpointing)


def empty_model(name: str, attn_implementation: str = "sdpa", revision: str | None = None) -> PreTrainedModel:
    """The fp32 model of folder ``name`` on the meta device (its config and generation config, no weights)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, revision=revision)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
        if Path(name, "generation_config.json").is_file() or not _is_local(name):
            model.generation_config = GenerationConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_load_hint(name, e)) from None
    return model.eval()


def make_trainable(model: PreTrainedModel, lora: LoraCfg | None, gradient_checkpointing: bool) -> PreTrainedModel:
    """Gradient checkpointing (non-reentrant, so a frozen base needs no input-grad hook) and, with ``lora``,
    ``peft`` LoRA adapters (the base frozen; adapters in fp32 even on a bf16 base: peft's autocast_adapter_dtype)."""
    if gradient_checkpointing:  # transformers >= 5.2x names it activation checkpointing
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is None:
        return model
    import peft

    pcfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
                           target_modules=lora.target_modules)
    return peft.get_peft_model(model, pcfg)


def is_lora(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a peft model exists only once peft was imported
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_off(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Inside: a LoRA model computes as its frozen base (the KL reference without a second copy). A no-op for a
    plain model."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def trainable_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------- prompt and stops
def _jinja_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid Jinja string literal (same escapes)


def plain_chat_template(template: str) -> str:
    """A chat template for a model without one, from ``model.prompt.template`` ('...{prompt}...'): system text
    and a blank line, the user prompt in the template, then the completion and EOS."""
    pre, post = template.split("{prompt}")
    return ("{% if bos_token %}{{ bos_token }}{% endif %}{% for m in messages %}"
            "{% if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
            f"{{% elif m['role'] == 'user' %}}{{{{ {_jinja_str(pre)} + m['content'] + {_jinja_str(post)} }}}}"
            "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")


def wrap_chat_template(template: str, system: str | None, instruction: str) -> str:
    """``template`` with the messages rewritten first: ``instruction`` appended to each user turn, ``system``
    put first when the conversation has no system message. The model's own template renders the result."""
    pre = ""
    if instruction:
        pre += ("{% set ns = namespace(m=[]) %}{% for m in messages %}{% if m['role'] == 'user' %}"
                f"{{% set ns.m = ns.m + [{{'role': 'user', 'content': m['content'] + {_jinja_str(instruction)}}}] %}}"
                "{% else %}{% set ns.m = ns.m + [m] %}{% endif %}{% endfor %}{% set messages = ns.m %}")
    if system is not None:
        pre += ("{% if messages[0]['role'] != 'system' %}"
                f"{{% set messages = [{{'role': 'system', 'content': {_jinja_str(system)}}}] + messages %}}"
                "{% endif %}")
    return pre + template


def apply_prompt(model: PreTrainedModel, tok: PreTrainedTokenizerBase, cfg: PromptCfg, name: str) -> None:
    """Write ``model.prompt`` into the tokenizer's chat template and the model's generation_config (EOS ids +
    stop strings): saved with the folder, inherited by every model trained from it. Raises ModelLoadError
    when the model has no chat template and no ``model.prompt.template`` is set, or when its template drops
    the system message."""
    if cfg.template is not None:
        tok.chat_template = plain_chat_template(cfg.template)
    elif not tok.chat_template:
        raise ModelLoadError(f"model {name!r} has no chat template: set model.prompt.template (a plain prompt "
                             "with '{prompt}', e.g. 'Question: {prompt}\\nAnswer:')")
    if cfg.system is not None or cfg.instruction:
        tok.chat_template = wrap_chat_template(tok.chat_template, cfg.system, cfg.instruction)
    if cfg.system is not None:
        probe = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                        add_generation_prompt=True)
        if cfg.system not in probe:
            raise ModelLoadError(f"model {name!r}: its chat template drops system messages; put the text in "
                                 "model.prompt.instruction instead of model.prompt.system")
    gc = model.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    ids, strings = [i for i in eos if i is not None] + [tok.eos_token_id], []
    vocab = tok.get_vocab()
    for s in cfg.stop:
        if s in vocab:
            ids.append(vocab[s])
        else:
            strings.append(s)
    ids = sorted(set(ids))
    gc.eos_token_id = ids if len(ids) > 1 else ids[0]
    gc.stop_strings = strings or None
    gc.pad_token_id = tok.pad_token_id


def stop_ids(gc: GenerationConfig, tok: PreTrainedTokenizerBase) -> list[int]:
    """Every token id that ends generation: ``gc``'s EOS ids (one or a list; a model's generation_config) and
    the tokenizer's."""
    eos = gc.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    return sorted(i for i in ids if i is not None)


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path,
                    dtype: str = "float32") -> None:
    """``save_pretrained`` model + tokenizer into ``path`` (a standard HF folder), weights in ``dtype``
    (``model.dtype``: a bf16 run's artifacts are half the size of its fp32 masters, which stay in the resumable
    checkpoint; ``config.json`` says ``dtype``). A LoRA model is saved merged (a plain folder that
    ``from_pretrained`` and vLLM load) with its adapter in ``path/adapter``; the model in memory keeps its
    adapter and dtype (the merge and the cast run on copies, tensor by tensor, tied weights cast once)."""
    if is_lora(model):
        import copy

        model.save_pretrained(path / "adapter", safe_serialization=True)
        model = copy.deepcopy(model).merge_and_unload()
    target, cast, memo = getattr(torch, dtype), {}, {}
    for k, v in model.state_dict().items():
        if v.is_floating_point() and v.dtype != target:
            key = (v.data_ptr(), v.dtype, tuple(v.shape))  # a tied weight: one cast tensor, saved once
            v = memo.setdefault(key, v.to(target))
        cast[k] = v
    model.save_pretrained(path, safe_serialization=True, state_dict=cast if memo else None)
    config = json.loads((path / "config.json").read_text())
    if config.get("dtype") != dtype:  # save_pretrained writes the in-memory model's dtype
        (path / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2, sort_keys=True) + "\n")
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

