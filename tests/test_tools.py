"""Tools and the multi-turn loop: the TOOLS registry (python in the sandbox, calc), the call formats, the config
section, per-call stop strings of the hf backend, and ``ToolBackend`` (token ids kept as generated, observation
tokens masked, seeded)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import repo_params

from posttrain import seeds
from posttrain.config import ConfigError, SandboxCfg, TinyModel, ToolsCfg, parse_params
from posttrain.modeling import build_char_tokenizer, build_tiny_model
from posttrain.rollout import BACKENDS, Completion, SamplingParams, chat_prompt_ids, sample_rows
from posttrain.sandbox import Sandbox, SandboxUnavailable
from posttrain.schema import ROLLOUT_SCHEMA, with_tool_fields
from posttrain.tools import FORMATS, TOOLS, Call, Format, ToolBackend, ToolContext, observe, with_tools
from posttrain.tools import formats as formats_mod

FAST = SandboxCfg(cpu_s=2, wall_s=5, memory_mb=128, workers=2)


@pytest.fixture(scope="module")
def sandbox_ctx() -> ToolContext:
    try:
        sb = Sandbox(FAST)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")
    return ToolContext(sandbox=lambda: sb)


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    return model.eval(), tok


# ------------------------------------------------------------------------------------------------ the tools
@pytest.mark.slow  # over 2 s: out of the fast suite
def test_python_runs_in_the_sandbox(sandbox_ctx):
    assert TOOLS["python"]("print(6 * 7)", sandbox_ctx) == "42\n"
    assert TOOLS["python"]("1 / 0", sandbox_ctx) == "error: ZeroDivisionError: division by zero"
    # the sandbox's view: no repo, no environment (what docs/sandbox.md promises, seen through the tool)
    out = TOOLS["python"]("import os; print(os.path.exists('/work'), sorted(os.environ))", sandbox_ctx)
    assert out.startswith("False")
    assert TOOLS["python"]("while True: pass", sandbox_ctx) == "error: CPU-time limit (SIGXCPU)"  # cpu_s 2


def test_calc_evaluates_arithmetic_and_refuses_everything_else():
    calc, ctx = TOOLS["calc"], ToolContext(sandbox=lambda: pytest.fail("calc never touches the sandbox"))
    assert calc("12*(3+4)", ctx) == "84"  # 12 * 7
    assert calc(" 7/2 ", ctx) == "3.5"
    assert calc("-2**3 + 17//5 - 17%5", ctx) == "-7"  # -8 + 3 - 2
    assert calc("1/0", ctx) == "error: ZeroDivisionError"
    for bad in ("__import__('os').system('id')", "x + 1", "(1).__class__", "[1, 2]", "'a' * 3", "len('ab')",
                "lambda: 1", "True + 1"):
        assert calc(bad, ctx).startswith("error: not arithmetic"), bad
    assert calc("2 ** 10 ** 9", ctx).startswith("error: not arithmetic (exponent")  # would hold the process
    assert calc("9 ** 64 ** 1 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 "
                "* 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64 * 9 ** 64",
                ctx).startswith("error: not arithmetic (a result past")  # 18 x 61 digits > 1000 digits


def test_observe_bounds_and_names_errors():
    ctx = ToolContext(sandbox=lambda: None)
    assert observe(Call("calc", "2+3"), ["calc"], ctx, 32) == "5"
    assert observe(Call("calc", "11**20"), ["calc"], ctx, 8) == "67274999"  # 672749994932560009201, cut to 8
    assert observe(Call("python", "print(1)"), ["calc"], ctx, 32) == "error: unknown tool 'python'"  # not enabled
    assert observe(Call(None, "", "the call is not JSON"), ["calc"], ctx, 32) == "error: the call is not JSON"


def test_tools_and_formats_are_the_config_names():
    from posttrain.config import names

    assert names.TOOLS == tuple(TOOLS)
    assert names.TOOL_FORMATS == tuple(FORMATS)
    assert names.PARALLEL_TOOL_FORMATS == tuple(k for k, f in FORMATS.items() if f.parse_all is not None)


# ---------------------------------------------------------------------------------------------- the formats
def test_tag_format():
    f = FORMATS["tag"]
    assert f.parse("12*7=<tool=calc>12*7</tool>") == Call("calc", "12*7")
    assert f.parse("so <tool=python>print('</b>')\n</tool>x") == Call("python", "print('</b>')\n")
    assert f.parse("no call here") is None
    assert f.parse("a stray </tool>").name is None
    assert f.render("84") == "<obs>84</obs>"


def test_qwen_format_parses_and_renders_as_its_chat_template_does():
    f = FORMATS["qwen"]
    call = 'I will compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2**10)"}}\n</tool_call>'
    assert f.parse(call) == Call("python", "print(2**10)")
    assert f.parse('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call>') == \
        Call("calc", "1+2")  # arguments written as a JSON string
    assert f.parse('<tool_call>{"name": "calc", "arguments": "1+2"}</tool_call>') == Call("calc", "1+2")
    assert f.parse("<tool_call>{name: calc}</tool_call>") == Call(None, "", "the call is not JSON")
    assert f.parse('<tool_call>{"arguments": {}}</tool_call>').name is None
    assert f.parse('<tool_call>{"name": "calc", "arguments": {"a": "1", "b": "2"}}</tool_call>').error
    assert f.parse("<tool_call>{") is None  # not closed: no call yet
    # Qwen2.5's template renders a tool message as a user turn holding <tool_response>, then opens the assistant
    assert f.render("1024") == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n1024\n</tool_response><|im_end|>\n"
                                "<|im_start|>assistant\n")


def test_qwen_parallel_calls_parse_every_call_and_answer_them_in_one_user_turn():
    f = FORMATS["qwen"]
    turn = ('<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "python", "arguments": {"code": "print(3)"}}\n</tool_call><|im_end|>')
    assert f.parse_all(turn) == [Call("calc", "1+2"), Call("python", "print(3)")]
    assert f.parse_all("the answer is 3<|im_end|>") == []  # no call: the turn is the answer
    assert f.parse_all("a stray </tool_call>") == [Call(None, "", "no <tool_call> before </tool_call>")]
    # Qwen2.5's template for two consecutive tool messages, after the assistant turn's <|im_end|>
    assert f.render_all(["3", "3"]) == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n"
                                        "<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert f.render("3") == "<|im_end|>" + f.render_all(["3"])  # one call: the turn closed by the observation
    assert FORMATS["tag"].parse_all is None


# ------------------------------------------------------------------------------------------------ the config
def test_tools_are_off_by_default_and_the_default_schema_is_unchanged():
    p = parse_params(repo_params())
    assert p.tools.enabled is False
    assert with_tool_fields(ROLLOUT_SCHEMA, False) is ROLLOUT_SCHEMA
    tool_fields = ["loss_mask", "tool_calls", "model_text", "model_tokens"]
    assert with_tool_fields(ROLLOUT_SCHEMA, True).names[-4:] == tool_fields


def _tools_on(raw: dict) -> dict:
    raw["tools"]["enabled"] = True
    for phase in ("warmup", "on_policy"):
        raw["distill"][phase]["steps"] = 0
    return raw


@pytest.mark.parametrize("edit, expected", [
    (lambda r: r["tools"].update(max_turn=3), "tools.max_turn: unknown key"),
    (lambda r: r["tools"].update(max_turns=0), "tools.max_turns: Input should be greater than or equal to 1"),
    (lambda r: r["tools"].update(names=["python", "shell"]), "tools.names: Value error, unknown tool 'shell'"),
    (lambda r: r["tools"].update(format="json"), "tools.format: Input should be 'tag' or 'qwen'"),
    (lambda r: r["tools"].update(parallel_calls=True), "tools.parallel_calls: Value error, true with format 'tag'"),
])
def test_bad_tools_config_names_the_key(edit, expected):
    raw = repo_params()
    edit(raw)
    with pytest.raises(ConfigError) as e:
        parse_params(raw)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_tools_enabled_loads_with_either_backend_and_the_distill_stage_sampling():
    raw = repo_params()
    raw["tools"]["enabled"] = True
    assert parse_params(raw).distill.warmup.steps > 0  # the distill stage samples through the tool loop too
    raw["rollout"]["backend"] = raw["evaluate"]["backend"] = "vllm"  # the engine's tool turns: test_vllm_engine.py
    assert parse_params(raw).tools.enabled


# ---------------------------------------------------------------------------- per-call stop strings (hf)
def test_hf_stops_a_row_at_a_call_stop_string_and_the_batch_keeps_going(tiny):
    """A row stops right after the first stop string of the call it samples; the other rows of its batch keep
    decoding (to EOS or max_new_tokens) without it in their text."""
    model, tok = tiny
    ids = chat_prompt_ids(tok, ["12*3=", "4738*7=", "5*5="])
    sp = SamplingParams(1.0, 1.0, 16, 5)
    hf = BACKENDS["hf"](model, tok, 16)
    texts = [tok.decode(c.token_ids) for g in hf.generate(ids, 4, sp) for c in g]
    chars = set("".join(texts)) - set("".join(tok.all_special_tokens))  # not a letter of <unk>, </s>, ...
    stop = min(sorted(chars), key=lambda ch: abs(sum(ch in t for t in texts) - len(texts) / 2))
    cut = [c for g in hf.generate(ids, 4, dataclasses.replace(sp, stop=(stop,))) for c in g]
    stopped = [c for c in cut if stop in tok.decode(c.token_ids)]
    assert 0 < len(stopped) < len(cut)
    for c in stopped:  # one character a token: the stop string is the last token, and the first one
        assert stop not in tok.decode(c.token_ids[:-1]) and tok.decode(c.token_ids[-1:]) == stop
        assert c.finish_reason == "stop"
    shortest = min(len(c.token_ids) for c in stopped)
    assert any(len(c.token_ids) > shortest for c in cut if c not in stopped)  # the batch went on without them


# ------------------------------------------------------------------------------------------- the turn loop
class Scripted:
    """A backend that answers each generate() row from a script of token-id turns, recording every call."""

    def __init__(self, turns: list[list[int]], tok) -> None:
        self.turns, self.tok, self.eos, self.calls = turns, tok, tok.eos_token_id, []

    def generate(self, prompt_ids, n, sampling):
        self.calls.append(([list(p) for p in prompt_ids], n, sampling))
        k = len(self.calls) - 1
        ids = self.turns[k][: sampling.max_new_tokens]
        lps = [-0.5 - 0.01 * i for i in range(len(ids))]
        out = Completion(self.tok.decode(ids, skip_special_tokens=True), ids, lps,
                         "stop" if ids[-1] == self.eos or k < len(self.turns) - 1 else "length")
        return [[out for _ in range(n)] for _ in prompt_ids]

    def load_weights(self, model, version):
        pass

    def release(self):
        pass


def _enc(tok, s: str) -> list[int]:
    return tok(s, add_special_tokens=False)["input_ids"]


def test_token_ids_survive_turns_unchanged_and_observations_are_masked(tiny):
    """Turn 1 samples the <unk> id (which decodes to the text '<unk>': re-tokenizing the conversation would turn it
    into five characters) and a calc call; turn 2 must be conditioned on exactly prompt + turn 1 ids + the
    observation's ids, and the completion must hold those same ids, the observation masked and with log-prob 0."""
    _, tok = tiny
    prompt = chat_prompt_ids(tok, ["12*7="])[0]
    turn1 = [tok.unk_token_id, *_enc(tok, "<tool=calc>12*7</tool>")]
    turn2 = [*_enc(tok, "answer: 84"), tok.eos_token_id]
    inner = Scripted([turn1, turn2], tok)
    cfg = ToolsCfg(enabled=True, names=["calc"], max_turns=1)
    loop = ToolBackend(inner, tok, cfg, ToolContext(sandbox=lambda: None))
    c = loop.generate([prompt], 1, SamplingParams(1.0, 1.0, 60, 9))[0][0]
    obs = _enc(tok, "<obs>84</obs>")  # the observation, tokenized once
    assert c.token_ids == turn1 + obs + turn2
    assert inner.calls[1][0] == [prompt + turn1 + obs]  # turn 2 continues from the ids, not re-tokenized text
    assert _enc(tok, tok.decode(turn1, skip_special_tokens=True)) != turn1  # what re-tokenizing text would do
    assert c.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert c.logprobs[len(turn1) : len(turn1) + len(obs)] == [0.0] * len(obs)
    assert c.logprobs[: len(turn1)] == pytest.approx([-0.5 - 0.01 * i for i in range(len(turn1))])
    assert c.tool_calls == 1 and c.finish_reason == "stop"
    assert c.text == "<tool=calc>12*7</tool><obs>84</obs>answer: 84"  # the transcript (special tokens skipped)
    # issue 49 #4: what rewards score and lengths count, the model's turns alone (turn 1 decodes its <unk> to '')
    assert c.model_text == "<tool=calc>12*7</tool>answer: 84" == c.scored_text
    assert c.model_tokens == len(turn1) + len(turn2)
    assert inner.calls[0][2].stop == ("</tool>",) and inner.calls[1][2].stop == ()  # the last turn: no call tag
    assert inner.calls[1][2].seed == seeds.tool_turn(9, 1)
    assert inner.calls[1][2].max_new_tokens == 60 - len(turn1) - len(obs)  # the budget counts every token


def test_turns_stop_at_max_turns_and_the_budget(tiny):
    _, tok = tiny
    prompt = chat_prompt_ids(tok, ["1+1="])[0]
    call = _enc(tok, "<tool=calc>1+1</tool>")  # 21 ids; its observation <obs>2</obs> 12
    cfg = ToolsCfg(enabled=True, names=["calc"], max_turns=2)
    inner = Scripted([call, call, call], tok)
    c = ToolBackend(inner, tok, cfg, ToolContext(sandbox=lambda: None)).generate([prompt], 2, SamplingParams(
        1.0, 1.0, 100, 0))[0][1]
    assert c.tool_calls == 2 and len(inner.calls) == 3  # two calls run; the third turn's call is not
    assert len(c.token_ids) == 3 * 21 + 2 * 12 and c.loss_mask.count(0) == 24
    # a budget of 26: turn 1 (21) + 5 of the observation's 12 ids, then no turn: finish length
    inner = Scripted([call, call], tok)
    c = ToolBackend(inner, tok, cfg, ToolContext(sandbox=lambda: None)).generate([prompt], 1, SamplingParams(
        1.0, 1.0, 26, 0))[0][0]
    assert len(c.token_ids) == 26 and c.loss_mask == [1] * 21 + [0] * 5 and c.finish_reason == "length"
    assert len(inner.calls) == 1


@pytest.mark.parametrize("turn_end", ["<|im_end|>", "</s>"])
def test_parallel_calls_run_every_call_of_a_turn_and_answer_them_in_one_masked_observation(tiny, turn_end):
    """tools.parallel_calls (qwen): the turn is not stopped at its first closing tag but at the model's end of turn
    (here written as text, or the tiny tokenizer's EOS standing in for a Qwen model's other EOS, <|endoftext|>);
    both calls run and one observation, Qwen's rendering of two tool messages (preceded by <|im_end|> when the
    turn did not end with it), is appended as ids and masked; the next turn continues from exactly those ids."""
    _, tok = tiny
    prompt = chat_prompt_ids(tok, ["1+2 and 3*4?"])[0]
    calls = ('<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>\n'
             '<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>')
    end = _enc(tok, turn_end) if turn_end == "<|im_end|>" else [tok.eos_token_id]
    turn1, turn2 = [*_enc(tok, calls), *end], [*_enc(tok, "3 and 12"), tok.eos_token_id]
    inner = Scripted([turn1, turn2], tok)
    cfg = ToolsCfg(enabled=True, names=["calc"], format="qwen", parallel_calls=True, max_turns=1)
    c = ToolBackend(inner, tok, cfg, ToolContext(sandbox=lambda: None)).generate([prompt], 1, SamplingParams(
        1.0, 1.0, 400, 3))[0][0]
    obs = _enc(tok, ("" if turn_end == "<|im_end|>" else "<|im_end|>")
               + "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n12\n"
               "</tool_response><|im_end|>\n<|im_start|>assistant\n")  # 1+2 = 3, 3*4 = 12, in call order
    assert c.token_ids == turn1 + obs + turn2 and inner.calls[1][0] == [prompt + turn1 + obs]
    assert c.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert c.logprobs[len(turn1) : len(turn1) + len(obs)] == [0.0] * len(obs)
    assert c.tool_calls == 2
    assert inner.calls[0][2].stop == () == inner.calls[1][2].stop  # no closing tag ends a turn


@pytest.fixture
def char_format(monkeypatch):
    """The tag format with a one-character closing tag, so the untrained tiny model calls often: each turn that
    samples 'a' calls calc on 2+3."""
    fmt = Format("a", lambda text: Call("calc", "2+3") if "a" in text else None, FORMATS["tag"].render)
    monkeypatch.setitem(formats_mod.FORMATS, "tag", fmt)
    return fmt


def test_multi_turn_hf_rollouts_are_seeded_and_score_as_one_sequence(tiny, char_format):
    """With the real hf backend: the same seed gives the same transcripts; the sampler log-prob of every model
    token is the model's log-prob of that token given prompt + every earlier token (observations included), so
    the trainer scores exactly the sequence that was sampled."""
    model, tok = tiny
    loop = ToolBackend(BACKENDS["hf"](model, tok, 8), tok, ToolsCfg(enabled=True, names=["calc"], max_turns=3))
    ids = chat_prompt_ids(tok, ["12*3=", "4738*7="])
    sp = SamplingParams(1.0, 1.0, 40, 11)
    out = loop.generate(ids, 3, sp)
    again = loop.generate(ids, 3, sp)
    flat = [c for g in out for c in g]
    assert [c.token_ids for c in flat] == [c.token_ids for g in again for c in g]
    assert [c.text for c in flat] == [c.text for g in again for c in g]
    assert sum(c.tool_calls for c in flat) >= 3  # the loop ran
    for p, g in zip(ids, out, strict=True):
        for c in g:
            assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask) <= 40
            seq = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logits = model(input_ids=seq).logits[0, len(p) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, seq[0, len(p):, None]).squeeze(1)
            m = torch.tensor(c.loss_mask, dtype=torch.bool)
            assert torch.allclose(lp[m], torch.tensor(c.logprobs)[m], atol=1e-4)
            assert all(x == 0.0 for x, k in zip(c.logprobs, c.loss_mask, strict=True) if not k)
            assert c.loss_mask.count(0) == len(_enc(tok, "<obs>5</obs>")) * c.tool_calls or c.finish_reason == "length"


def test_rewards_score_the_models_turns_never_a_tools_observation():
    """Issue 49 #4: the reward scored the whole transcript, so a tool's output holding the answer (a program that
    prints \\boxed{84}) made a completion that never answered correct, and ``overlong`` counted observation tokens as
    the model's. Hand-computed: math_verify finds no answer in the model's turns -> 0.0 (1.0 on the transcript);
    overlong(buffer 4) over 8 model tokens of a budget of 12 -> 0 (the transcript's 12 tokens: -1.0)."""
    from posttrain.rewards import Spec, score_rows

    row = {"prompt_id": "p", "prompt": "12*7?", "answer": "84", "task": "math", "max_new_tokens": 12,
           "finish_reason": "stop", "token_ids": list(range(12)),
           "completion": "<tool=python>show()</tool><obs>\\boxed{84}</obs>done",
           "loss_mask": [1] * 6 + [0] * 4 + [1] * 2, "tool_calls": 1,
           "model_text": "<tool=python>show()</tool>done", "model_tokens": 8}
    specs = [Spec("math_verify", 1.0, {}), Spec("overlong", 1.0, {"buffer": 4})]
    (scored,) = score_rows([row], specs)
    assert json.loads(scored["rewards"]) == {"math_verify": 0.0, "overlong": 0.0}
    single = {k: v for k, v in row.items() if k not in ("loss_mask", "tool_calls", "model_text", "model_tokens")}
    (plain,) = score_rows([single], specs)  # a single-turn row: every token and the whole text are the model's
    assert json.loads(plain["rewards"]) == {"math_verify": 1.0, "overlong": -1.0}


def test_sample_rows_carry_the_mask_only_for_tool_rollouts(tiny, char_format):
    model, tok = tiny
    probs = [{"id": "p0", "prompt": "12*3=", "answer": "36", "task": "arith"}]
    hf = BACKENDS["hf"](model, tok, 8)
    plain, _ = sample_rows(hf, tok, probs, 2, SamplingParams(1.0, 1.0, 20, 0), "pol")
    assert "loss_mask" not in plain[0] and "tool_calls" not in plain[0]
    assert with_tools(hf, tok, ToolsCfg()) is hf  # tools off: the backend itself
    rows, _ = sample_rows(with_tools(hf, tok, ToolsCfg(enabled=True, names=["calc"])), tok, probs, 2,
                          SamplingParams(1.0, 1.0, 20, 0), "pol")
    assert all(len(r["loss_mask"]) == len(r["token_ids"]) and r["tool_calls"] >= 0 for r in rows)
    assert all(r["model_tokens"] == sum(r["loss_mask"]) and len(r["model_text"]) <= len(r["completion"])
               for r in rows)
