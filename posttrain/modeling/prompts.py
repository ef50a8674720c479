"""Tokenizers and the prompt format: the character tokenizer of the tiny model, loading a model's tokenizer,
and ``model.prompt`` (chat template, system text, instruction, stops) written into the tokenizer and the model's
generation config (:func:`apply_prompt`), so that every folder trained from the base carries it.

The character tokenizer is built with ``tokenizers`` and saved as a standard ``PreTrainedTokenizerFast`` with a
chat template: it reloads offline with ``AutoTokenizer`` (and vLLM) from the folder.
"""

from __future__ import annotations

import json
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from posttrain.config import PromptCfg
from posttrain.errors import ModelLoadError
from posttrain.modeling.models import load_hint

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


def load_tokenizer(name: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    """Tokenizer from a local folder or hub id; left padding for generation; a pad token guaranteed."""
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(load_hint(name, e)) from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


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
