"""Tool-use SFT demos (sft_data.tool_demo, tools.demos): the observation a demo shows is the tool's own output,
tokenized as the rollout loop appends it, and the SFT loss masks exactly its tokens.

Lengths under the character tokenizer (one token a character): ``4821*7=`` renders as BOS + 7 chars + "\\n" = 9
prompt tokens; ``<tool=calc>4821*7</tool>`` is 11 + 6 + 7 = 24 tokens; ``<obs>33747</obs>`` 5 + 5 + 6 = 16;
``answer: 33747`` + EOS 14. So the tool rendering is 9 + 24 + 16 + 14 = 63 tokens, the observation at [33, 49).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from posttrain import sft_data, training
from posttrain.config import ConfigError, RewardSpec, ToolsCfg, parse_params
from posttrain.modeling import build_char_tokenizer
from posttrain.tasks import arith
from posttrain.tools import FORMATS, ToolBackend, ToolContext
from posttrain.tools import TOOLS as TOOLS_OF
from posttrain.tools.demos import demo_turn
from posttrain.tools.loop import observation_ids
from tests.conftest import REPO, import_base, repo_params

IGNORE = sft_data.IGNORE
TOOLS = ToolsCfg(enabled=True, names=["calc"], max_turns=1)


def _demo(prompt: str, answer: str) -> dict:
    return {"prompt": prompt, "answer": answer, "solution": None, "task": "arith"}


def test_tool_demo_shows_the_tools_output_and_masks_exactly_the_observation(tmp_path):
    tok = build_char_tokenizer()
    data = sft_data.select(sft_data.tokenize(tok, [_demo("4821*7=", "33747")], tmp_path, tools=TOOLS), None, "drop")
    ids, labels = data.example(0, sft_data.TOOL)
    assert tok.decode(ids) == "<s>4821*7=\n<tool=calc>4821*7</tool><obs>33747</obs>answer: 33747</s>"
    assert len(ids) == 63 and tuple(data.obs[0]) == (33, 49)  # module docstring
    assert tok.decode(ids[33:49]) == "<obs>33747</obs>"
    masked = [i for i, y in enumerate(labels) if y == IGNORE]
    assert masked == list(range(9)) + list(range(33, 49))  # the prompt, then exactly the observation
    assert [y for y in labels if y != IGNORE] == ids[9:33] + ids[49:]  # the call and the answer train
    # the observation is what the calculator returns, as the rollout loop would append it after this call
    assert ids[33:49] == observation_ids(tok, FORMATS["tag"], "33747") == demo_turn(tok, TOOLS, "calc", "4821*7")[1]
    # and the other styles are unchanged by the tool one
    assert tok.decode(data.example(0, "direct")[0]) == "<s>4821*7=\n" + "answer: 33747</s>"


def test_tool_demo_fits_the_tiny_context_at_seven_digits():
    """The longest tool demo of a 7-digit factor: 9999999*9= (10 chars) -> prompt 12, call 11 + 9 + 7 = 27,
    obs 5 + 8 + 6 = 19, answer 'answer: 89999991' + EOS 17: 75 tokens, within the 128-token context."""
    tok = build_char_tokenizer()
    head = tok.apply_chat_template([{"role": "user", "content": "9999999*9="}], add_generation_prompt=True,
                                   tokenize=True)["input_ids"]
    direct = tok.apply_chat_template([{"role": "user", "content": "9999999*9="},
                                      {"role": "assistant", "content": "answer: 89999991"}], tokenize=True)["input_ids"]
    ids, (a, b) = sft_data.tool_demo(tok, TOOLS, "arith", "9999999*9=", list(head), list(direct))
    assert len(ids) == 75 and (a, b) == (39, 58)


def test_demo_observation_is_what_the_loop_appends_after_the_same_call(tmp_path):
    """A backend that writes the demo's call: the ToolBackend appends, token for token, the demo's observation."""
    tok = build_char_tokenizer()
    call_ids, obs_ids = demo_turn(tok, TOOLS, "calc", "123*4")

    class Writes:
        def generate(self, prompt_ids, n, sampling):
            from posttrain.rollout import Completion

            text = tok.decode(call_ids) if sampling.stop else "answer: 492"
            return [[Completion(text, list(tok(text, add_special_tokens=False)["input_ids"]), [0.0] * len(text),
                                "stop")] * n for _ in prompt_ids]

    from posttrain.rollout import SamplingParams

    (c,), = ToolBackend(Writes(), tok, TOOLS, ToolContext()).generate([[1, 5]], 1, SamplingParams(1.0, 1.0, 60, 0))
    assert c.token_ids[len(call_ids) : len(call_ids) + len(obs_ids)] == obs_ids
    assert c.loss_mask == [1] * len(call_ids) + [0] * len(obs_ids) + [1] * len("answer: 492")
    assert c.text == "<tool=calc>123*4</tool><obs>492</obs>answer: 492" and arith.verify("492", c.text)


def test_style_draws_without_tool_demos_are_unchanged():
    """tool_frac = 0 draws the same styles as the code before tool demos (u < cot_frac -> cot, else direct);
    tool_frac takes the band [cot_frac, cot_frac + tool_frac) of the same uniforms."""
    u = np.random.default_rng(training.seeds.sft_format(3, 7)).random(64)
    _, old = training.step_batch(3, 7, 100, 64, 0.7)
    assert list(old) == ["cot" if x < 0.7 else "direct" for x in u]
    _, new = training.step_batch(3, 7, 100, 64, 0.2, 0.5)
    assert list(new) == ["cot" if x < 0.2 else "tool" if x < 0.7 else "direct" for x in u]


@pytest.mark.parametrize(("edit", "key"), [
    (lambda r: r["sft"]["phases"][0].update(cot_frac=0.7, tool_frac=0.5),
     "sft.phases[0].tool_frac: Value error, cot_frac + tool_frac = 1.2 > 1"),
    (lambda r: (r["sft"]["phases"][0].update(cot_frac=0.7, tool_frac=0.3), r["tools"].update(names=["python"])),
     "tools.names"),
])
def test_bad_tool_demo_config_names_the_key(edit, key):
    raw = repo_params()
    edit(raw)
    with pytest.raises(ConfigError, match=re.escape(key)):
        parse_params(raw)


def test_tool_cost_is_minus_the_calls_of_a_correct_answer():
    """Weight 0.05 beside correct (1.0): a correct answer after 2 calls totals 1 - 0.05 * 2 = 0.9; a wrong one after
    2 calls 0 + 0 = 0 (only_correct) or 0 - 0.1 = -0.1 (every completion); no call costs nothing."""
    from posttrain.rewards import Sample, combine, specs_of, tool_cost

    right = Sample("<tool=calc>12*3</tool><obs>36</obs>answer: 36", "36", "arith", 40, 64, tool_calls=2)
    wrong = Sample("<tool=calc>12*3</tool><obs>36</obs>answer: 35", "36", "arith", 40, 64, tool_calls=2)
    none = Sample("answer: 36", "36", "arith", 10, 64)
    assert tool_cost([right, wrong, none]) == [-2.0, 0.0, 0.0]  # one batch: the verifier sees right and wrong only
    assert tool_cost([wrong], only_correct=False) == [-2.0]
    assert tool_cost([Sample("answer: 1", "x", "arith", 9, 64, tool_calls=1)]) == [None]  # gold unscorable
    specs = specs_of([RewardSpec(name="correct"), RewardSpec(name="tool_cost", weight=0.05)])
    totals = [t for t, _ in combine([right, wrong], specs)]
    assert totals == [pytest.approx(0.9), pytest.approx(0.0)]
    off = specs_of([RewardSpec(name="correct"), RewardSpec(name="tool_cost", weight=0.05,
                                                           kwargs={"only_correct": False})])
    assert combine([wrong], off)[0][0] == pytest.approx(-0.1)

def test_the_tools_profile_loads():
    """profiles/tools.yaml: tools on (calc), half the SFT demos tool calls, the distill stage's sampling off."""
    import yaml

    p = parse_params(yaml.safe_load((REPO / "profiles" / "tools.yaml").read_text()))
    assert p.tools.enabled and p.tools.names == ["calc"] and p.sft.phases[0].tool_frac == 0.5
    assert (p.task.min_digits, p.task.max_digits) == (5, 6)
    assert [s.name for s in p.reward.rewards] == ["correct", "tool_cost"]


@pytest.mark.slow
def test_sft_on_tool_demos_then_rollouts_call_the_calculator(tiny):
    """curate -> sft (every demo a tool demo) -> rollout with tools on: the model has learnt to call calc, the
    loop answers with the calculator's value, and the observation's tokens are the masked ones."""
    from stages import curate, rollout, sft

    tiny["task"].update(min_digits=2, max_digits=2)
    tiny["tools"].update(enabled=True, names=["calc"], max_turns=1)
    tiny["sft"].update(phases=[{"steps": 150, "cot_frac": 0.0, "tool_frac": 1.0}], batch_size=16,
                       micro_batch_size=16, lr=1e-2)
    tiny["rollout"]["sampling"]["max_new_tokens"] = 48
    tiny["rollout"]["keep_tokens"] = True  # the token ids and loss masks, read below
    for phase in ("warmup", "on_policy"):
        tiny["distill"][phase]["steps"] = 0
    tiny["distill"]["grpo_steps"] = 0
    p = parse_params(tiny)
    curate.run(p, *curate.paths(p))
    import_base(p)
    sft.run(p, *sft.paths(p))
    rollout.run(p, *rollout.paths(p))
    from posttrain.schema import read_parquet

    rows = read_parquet(rollout.paths(p)[1]["rollouts"])
    called = [r for r in rows if r["tool_calls"]]
    assert len(called) > len(rows) // 2
    tok = build_char_tokenizer()
    for r in called:
        ids, mask = r["token_ids"], r["loss_mask"]
        obs = tok.decode([t for t, k in zip(ids, mask, strict=True) if not k])
        m = re.search(r"<tool=calc>([^<]*)</tool>", r["completion"])
        full = f"<obs>{TOOLS_OF['calc'](m.group(1), ToolContext())}</obs>" if m else None
        # the calculator's own answer; cut only where the completion ran out of tokens (max_new_tokens)
        assert full is not None and (obs == full or (r["finish_reason"] == "length" and full.startswith(obs)))
    assert sum(obs_ok(r, tok) for r in called) > len(called) // 2  # most observations whole


def obs_ok(r: dict, tok) -> bool:
    return tok.decode([t for t, k in zip(r["token_ids"], r["loss_mask"], strict=True) if not k]).endswith("</obs>")
