"""The real-model path on a Qwen2-architecture model + byte-level BPE tokenizer built offline (tests/realmodel.py):
LoRA, the adapter-off reference, merged saves, prompt formats and stops, distillation with a pretrained student."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain import logprobs, modeling
from posttrain.config import LoraCfg, ModelCfg, PromptCfg, Rl, parse_params
from posttrain.errors import ModelLoadError, StageError
from posttrain.rl import update
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids
from tests.realmodel import bpe_tokenizer, qwen2, save_folder

LORA = LoraCfg(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(300)


def _rl_batch(tok, model):
    ids = chat_prompt_ids(tok, ["What is 12 times 3?"])
    comps = BACKENDS["hf"](model.eval(), tok, 8).generate(ids, 2, SamplingParams(1.0, 1.0, 6, 0))[0]
    return [logprobs.Seq(ids[0], c.token_ids, c.logprobs, a) for c, a in zip(comps, [1.0, -1.0], strict=True)]


def test_lora_trains_adapters_only_and_the_reference_is_the_base(tok, tmp_path):
    base = qwen2(tok, hidden=32, layers=2)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = modeling.make_trainable(qwen2(tok, hidden=32, layers=2), LORA, gradient_checkpointing=True)
    n_train = sum(p.numel() for p in modeling.trainable_params(model))
    assert 0 < n_train < 0.05 * modeling.num_params(model)  # 2 layers x (q, v) x r (32 + 32 or 16): 1,024
    seqs = _rl_batch(tok, model)
    cfg = Rl(lr=1e-2, micro_batch_size=1, kl_coef=0.1)
    opt = torch.optim.AdamW(modeling.trainable_params(model), lr=cfg.lr)
    model.train()
    m = update.policy_update(model, opt, seqs, cfg, tok.pad_token_id, ref_model=model)  # ref: the adapter-off policy
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts at B = 0: policy == reference
    base_now = model.get_base_model().state_dict()
    for k, v in before.items():  # every base weight untouched
        k2 = next(n for n in base_now if n.replace(".base_layer", "") == k)
        assert torch.equal(base_now[k2], v), k
    # the reference (adapter off) is exactly the base model; the policy moved
    t = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        with modeling.adapter_off(model):
            ref_lp, _ = logprobs.token_logp_entropy(model, t)
        base_lp, _ = logprobs.token_logp_entropy(base, t)
        pol_lp, _ = logprobs.token_logp_entropy(model, t)
    assert torch.allclose(ref_lp, base_lp, atol=1e-6)
    assert (pol_lp - base_lp).abs().max() > 1e-3
    # saved merged: a plain folder from_pretrained loads, computing what the adapted policy computes
    modeling.save_checkpoint(model.eval(), tok, tmp_path / "m")
    assert (tmp_path / "m" / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        merged_lp, _ = logprobs.token_logp_entropy(merged, t)
    assert torch.allclose(merged_lp, pol_lp, atol=1e-5)
    assert modeling.is_lora(model)  # the merge ran on a copy


def test_chatml_instruction_and_system_are_in_the_prompt_and_sft_encoding(tok):
    model = qwen2(tok, hidden=32, layers=1)
    cfg = PromptCfg(system="Be brief.", instruction="\nPut the final answer in \\boxed{}.", stop=["<|im_end|>"])
    modeling.apply_prompt(model, tok, cfg, "qwen2-test")
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?\nPut the final answer in "
                    "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert sorted(model.generation_config.eos_token_id) == sorted(
        [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")])
    from posttrain.sft_data import encode_sft
    ids, labels = encode_sft(tok, "2+2?", "4")
    assert tok.decode([y for y in labels if y != -100]) == "4<|im_end|>\n"


def test_plain_template_and_missing_template(tok):
    bare = bpe_tokenizer(300, chat_template=None)
    with pytest.raises(ModelLoadError, match="no chat template: set model.prompt.template"):
        modeling.apply_prompt(qwen2(bare, hidden=32, layers=1), bare, PromptCfg(), "bare")
    modeling.apply_prompt(qwen2(bare, hidden=32, layers=1), bare, PromptCfg(template="Question: {prompt}\nAnswer:",
                                                                               system="S"), "bare")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"}]
    assert bare.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=True) == \
        "S\n\nQuestion: 2+2?\nAnswer:"
    char = modeling.build_char_tokenizer()  # the tiny template has no system role
    with pytest.raises(ModelLoadError, match="drops system messages"):
        modeling.apply_prompt(modeling.build_tiny_model(ModelCfg().tiny, char, 0), char, PromptCfg(system="S"),
                              "tiny")


def test_generation_stops_at_every_eos_id_and_at_stop_strings(tok):
    model = qwen2(tok, hidden=32, layers=1, seed=3)
    modeling.apply_prompt(model, tok, PromptCfg(stop=["<|im_end|>"]), "q")
    stops = set(modeling.stop_ids(model.generation_config, tok))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in stops and tok.eos_token_id in stops
    ids = chat_prompt_ids(tok, ["Natalia sold 48 clips.", "What is 7 times 8?"])
    sp = SamplingParams(1.0, 1.0, 30, 0)
    groups = BACKENDS["hf"](model.eval(), tok, 64).generate(ids, 32, sp)
    comps = [c for g in groups for c in g]
    for c in comps:  # a stop id ends a completion, and only at its end
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in stops)
        assert not stops & set(c.token_ids[:-1])
    assert any(c.token_ids[-1] == im_end for c in comps)  # <|im_end|> (not the tokenizer's eos) stopped some
    # a stop string: pick two characters from inside a long completion, sample again with the same seed
    long = max((c for c in comps if c.finish_reason == "length"), key=lambda c: len(c.text))
    stop = long.text[len(long.text) // 2 : len(long.text) // 2 + 2]
    model.generation_config.stop_strings = [stop]
    again = BACKENDS["hf"](model.eval(), tok, 64).generate(ids, 32, sp)
    c2 = [c for g in again for c in g][comps.index(long)]
    assert c2.finish_reason == "stop" and stop not in c2.text
    assert long.text.startswith(c2.text) and long.token_ids[: len(c2.token_ids)] == c2.token_ids


def test_distill_student_must_share_the_teachers_tokenizer(tmp_path, tiny):
    from stages import distill

    teacher = save_folder(tmp_path / "teacher", hidden=32, layers=1, vocab_size=300)
    other = save_folder(tmp_path / "other", hidden=32, layers=1, vocab_size=280)
    p = parse_params({**tiny, "distill": {**tiny["distill"], "student": str(other)}})
    t_tok = modeling.load_tokenizer(str(teacher))
    with pytest.raises(StageError, match="tokenizer differs from the teacher's"):
        distill._student(p, t_tok, modeling.load_model(str(teacher)), torch.device("cpu"))
    # same family: loads, its vocabulary size from its config, the teacher's stops
    p = parse_params({**tiny, "distill": {**tiny["distill"], "student": str(teacher)}})
    s = distill._student(p, t_tok, modeling.load_model(str(teacher)), torch.device("cpu"))
    assert s.config.vocab_size == 320  # the padded head of the checkpoint, not len(tokenizer) = 300
    assert s.generation_config.eos_token_id == modeling.load_model(str(teacher)).generation_config.eos_token_id


def test_a_student_cut_from_the_teacher_keeps_its_first_and_last_layers_and_computes_as_they_do(tmp_path, tiny):
    """distill.student: {layers: 2} of a 4-layer teacher: layers 0 and 3 (round(i * 3 / 1) for i = 0, 1), the
    embeddings, norm and head; its logits equal the teacher's with layers 1 and 2 taken out."""
    import copy

    from stages import distill

    teacher = qwen2(bpe_tokenizer(300), hidden=32, layers=4, seed=5).eval()
    p = parse_params({**tiny, "distill": {**tiny["distill"], "student": {"layers": 2}}})
    s = distill._student(p, bpe_tokenizer(300), teacher, torch.device("cpu")).eval()
    assert s.config.num_hidden_layers == 2 and modeling.num_params(s) < modeling.num_params(teacher)
    assert torch.equal(s.model.layers[1].mlp.up_proj.weight, teacher.model.layers[3].mlp.up_proj.weight)
    assert s.model.layers[1].mlp.up_proj.weight.data_ptr() != teacher.model.layers[3].mlp.up_proj.weight.data_ptr()
    ref = copy.deepcopy(teacher)
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[0], ref.model.layers[3]])
    ref.config.num_hidden_layers = 2
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        assert torch.allclose(s(ids, use_cache=False).logits, ref(ids, use_cache=False).logits, atol=1e-6)
    assert [round(i * 29 / 14) for i in range(15)][::7] == [0, 14, 29]  # SmolLM2-135M's 30 -> 15: ends kept
    too_many = parse_params({**tiny, "distill": {**tiny["distill"], "student": {"layers": 4}}})
    with pytest.raises(StageError, match="distill.student.layers: keep 4 of 4 layers"):
        distill._student(too_many, bpe_tokenizer(300), teacher, torch.device("cpu"))
