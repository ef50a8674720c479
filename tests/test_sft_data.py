"""sft_data.py: demos tokenized once, the max_seq_len policy (counted), and packed batches that keep every token.

Lengths under the character tokenizer (hand-counted): a prompt renders as BOS + its characters + "\\n"
(len(prompt) + 2 tokens); a completion adds its characters + EOS (len(completion) + 1).
"""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain import distributed, sft_data, training
from posttrain.config import ConfigError, Sft, TinyModel, parse_params
from posttrain.modeling import build_char_tokenizer, build_tiny_model
from tests.conftest import repo_params


def _demo(prompt: str, answer: str, solution: str | None) -> dict:
    return {"prompt": prompt, "answer": answer, "solution": solution, "task": "arith"}


# max_seq_len 20:                      prompt  cot (prompt + solution + EOS)   direct (prompt + "answer: A" + EOS)
DEMOS = [_demo("1*2=", "2", "ab"),        # 6     6 + 2 + 1 = 9                  6 + 9 + 1 = 16     fits
         _demo("12*3=", "36", "s" * 20),  # 7     7 + 20 + 1 = 28 (8 over)       7 + 10 + 1 = 18    overlong
         _demo("1" * 18 + "=", "1", "x"),  # 21 >= 20: no completion token left                     prompt overlong
         _demo("9*9=", "81", "t" * 13),   # 6     6 + 13 + 1 = 20 (the limit)   6 + 10 + 1 = 17    fits
         _demo("1" * 16 + "=", "1", "uu")]  # 19  19 + 2 + 1 = 22 (2 over)      19 + 9 + 1 = 29 (9 over)  overlong


class CountingTok:
    """The char tokenizer, counting the conversations it renders through the chat template."""

    def __init__(self) -> None:
        self.tok, self.rendered = build_char_tokenizer(), 0

    def apply_chat_template(self, conv, **kw):
        self.rendered += len(conv) if conv and isinstance(conv[0], list) else 1
        return self.tok.apply_chat_template(conv, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_tokenized_rows_are_todays_encoding(tmp_path):
    """The batched map gives, for every demo and style, the ids of one-conversation-at-a-time rendering (the
    code before this module): the default run trains on the same tokens."""
    tok = build_char_tokenizer()
    data = sft_data.select(sft_data.tokenize(tok, DEMOS, tmp_path), None, "drop")
    for i, x in enumerate(DEMOS):
        for style in sft_data.STYLES:
            msgs = [{"role": "user", "content": x["prompt"]}]
            p = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
            completion = x["solution"] if style == "cot" else "answer: " + x["answer"]
            full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": completion}],
                                           tokenize=True)["input_ids"]
            assert data.example(i, style) == (full, [sft_data.IGNORE] * len(p) + full[len(p):])


def test_drop_counts_and_keeps_what_fits(tmp_path):
    data = sft_data.select(sft_data.tokenize(build_char_tokenizer(), DEMOS, tmp_path), 20, "drop")
    assert data.counts == {"demos_tokenized": 5, "dropped_overlong": 2, "dropped_prompt_overlong": 1,
                           "truncated": 0, "truncated_tokens": 0, "demos_trained": 2}
    assert [len(data.example(i, "cot")[0]) for i in range(len(data))] == [9, 20]  # demos 0 and 3


def test_truncate_keeps_the_prompt_and_cuts_the_completion(tmp_path):
    data = sft_data.select(sft_data.tokenize(build_char_tokenizer(), DEMOS, tmp_path), 20, "truncate")
    # truncated: demo 1 (cot 8 over) and demo 4 (cot 2 + direct 9 over): 8 + 2 + 9 = 19 tokens cut
    assert data.counts == {"demos_tokenized": 5, "dropped_overlong": 0, "dropped_prompt_overlong": 1,
                           "truncated": 2, "truncated_tokens": 19, "demos_trained": 4}
    ids, labels = data.example(1, "cot")  # demo 1: 7 prompt tokens kept whole, 13 of 21 completion tokens
    assert len(ids) == 20 and labels[:7] == [sft_data.IGNORE] * 7 and labels[7:] == ids[7:]
    assert ids[:7] == sft_data.encode_sft(build_char_tokenizer(), "12*3=", "s")[0][:7]
    ids, labels = data.example(3, "direct")  # demo 4: 19 prompt tokens, 1 completion token left
    assert len(ids) == 20 and sum(y != sft_data.IGNORE for y in labels) == 1


def test_packing_keeps_every_token_once_and_the_loss(tmp_path):
    """Packed rows hold every token of every demo exactly once at its own position ids; the gathered
    predictions are the padded ones', so the summed NLL and its token count equal the padded batch's."""
    tok = build_char_tokenizer()
    data = sft_data.select(sft_data.tokenize(tok, DEMOS, tmp_path), 20, "truncate")
    examples = [data.example(i, s) for i in range(len(data)) for s in sft_data.STYLES]  # 8 demos, 16..20 tokens
    t = sft_data.collate_packed(examples, tok.pad_token_id, 20)
    assert t["ids"].shape[1] == 20  # 2 x longest = 40, capped at max_seq_len
    w = t["ids"].shape[1]
    for i, (x, y) in enumerate(examples):
        g = t["gather"][i, : len(x) - 1]
        r, c = g // (w - 1), g % (w - 1)
        assert t["ids"][r, c].tolist() == x[:-1] and t["ids"][r, c + 1].tolist() == x[1:]  # input and target
        assert t["pos"][r, c].tolist() == list(range(len(x) - 1))
        assert t["mask"][i, : len(x) - 1].tolist() == [v != sft_data.IGNORE for v in y[1:]]
    real = sum(len(x) for x, _ in examples)
    assert int((t["pos"] == 0).sum()) >= len(examples) and real <= t["ids"].numel()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    with torch.no_grad():
        s_pack, n_pack = training.sum_token_nll(model, t)
        s_pad, n_pad = training.sum_token_nll(model, training.collate(examples, tok.pad_token_id))
    assert n_pack == n_pad == sum(sum(v != sft_data.IGNORE for v in y[1:]) for _, y in examples)
    torch.testing.assert_close(s_pack, s_pad, rtol=1e-5, atol=1e-4)


def _model():
    tok = build_char_tokenizer()
    return build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0), tok


def _cfg(**kw) -> Sft:
    return Sft(**{"phases": [{"steps": 2, "cot_frac": 0.5}], "batch_size": 4, "micro_batch_size": 2,
                  "warmup_steps": 0, "log_every": 1, "checkpoint_every": 100, "lr": 1e-2, **kw})


def test_demos_are_tokenized_once_per_run_and_never_again_on_resume(tmp_path):
    """Each demo's prompt and its two renderings go through the chat template once (3 conversations per demo;
    the code before rendered 4: both styles, prompt and full each), and a second call on the same checkpoint
    folder (a resumed run) renders none. A rank other than 0 renders none either: it reads rank 0's file."""
    demos = [_demo(f"{a}*{b}=", str(a * b), None) for a in range(10, 20) for b in (2, 3)]  # 20 demos
    model, _ = _model()
    tok = CountingTok()
    training.sft_train(model, tok, demos, _cfg(), 0, tmp_path / "ck", "fp", progress=False)
    assert tok.rendered == 3 * len(demos)
    tok.rendered = 0
    training.sft_train(model, tok, demos, _cfg(), 0, tmp_path / "ck", "fp", progress=False)
    assert tok.rendered == 0


def test_each_rank_tokenizes_its_shard_and_reads_all(tmp_path, monkeypatch):
    """Two ranks, run one after the other here (each stopped at the barrier): each renders only its contiguous
    shard of the 5 demos (3 and 2 demos, 3 conversations each); past the barrier a rank renders nothing and
    reads all 5 rows in order, equal to one process's result."""

    class AtBarrier(Exception):
        pass

    def stop(self):
        raise AtBarrier

    alone = sft_data.tokenize(build_char_tokenizer(), DEMOS, tmp_path / "one")
    monkeypatch.setattr(distributed.Dist, "barrier", stop)
    rendered = []
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "current", lambda rank=rank: distributed.Dist(rank, 2, rank, "ddp", "cpu"))
        tok = CountingTok()
        with pytest.raises(AtBarrier):
            sft_data.tokenize(tok, DEMOS, tmp_path / "two")
        rendered.append(tok.rendered)
    monkeypatch.setattr(distributed.Dist, "barrier", lambda self: None)
    tok = CountingTok()
    both = sft_data.tokenize(tok, DEMOS, tmp_path / "two")  # rank 1 past the barrier
    assert tok.rendered == 0
    assert rendered == [9, 6]
    assert both.to_list() == alone.to_list()


@pytest.mark.parametrize("batching", ["padded", "packed"])
@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_an_overlong_demo_never_runs_a_micro_batch_beyond_max_seq_len(tmp_path, batching, overlong):
    """One 16k-token trace used to set the width of its micro-batch (the code before had no limit: this test
    failed there, on the unknown key sft.max_seq_len). Every decoder input is now at most max_seq_len wide."""
    demos = [_demo(f"{a}*7=", str(a * 7), None) for a in range(10, 16)] + [_demo("99*9=", "891", "z" * 300)]
    widths: list[int] = []
    model, tok = _model()
    model.model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]),
                                          with_kwargs=True)
    cfg = _cfg(max_seq_len=48, overlong=overlong, batching=batching, batch_size=7, micro_batch_size=7,
               phases=[{"steps": 3, "cot_frac": 1.0}])
    res = training.sft_train(model, tok, demos, cfg, 0, tmp_path / "ck", "fp", progress=False)
    assert widths and max(widths) <= 48, widths
    assert res["data"]["dropped_overlong" if overlong == "drop" else "truncated"] == 1


def test_grouping_sorts_each_ranks_share_and_balances_them():
    """7 examples of lengths 7..1 over 2 ranks (shares of 3 and 4, as Dist.shard splits 7): dealt in length
    order, rank 0 gets lengths 1, 3, 5 and rank 1 gets 2, 4, 6, 7; every example once."""
    examples = [([0] * n, [0] * n) for n in range(7, 0, -1)]
    out = sft_data.group_by_length(examples, 2)
    assert [len(x) for x, _ in out] == [1, 3, 5, 2, 4, 6, 7]
    assert [len(x) for x, _ in sft_data.group_by_length(examples, 1)] == [1, 2, 3, 4, 5, 6, 7]


def test_batching_layouts_train_the_same_model(tmp_path):
    """padded, grouped and packed micro-batches give the same token-mean loss and the same weights (up to
    float summation order)."""
    demos = [_demo(f"{a}*{b}=", str(a * b), None) for a in (12, 345, 6789) for b in (2, 7)]
    ends, losses = [], []
    for batching in ("padded", "grouped", "packed"):
        model, tok = _model()
        res = training.sft_train(model, tok, demos, _cfg(batching=batching), 0, tmp_path / batching, "fp",
                                 progress=False)
        ends.append(model.state_dict())
        losses.append([r["loss"] for r in res["log"]])
    for other, loss in zip(ends[1:], losses[1:], strict=True):
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for k in ends[0]:
            torch.testing.assert_close(other[k], ends[0][k], atol=1e-5, rtol=1e-4)


def test_no_demo_fits_is_a_config_error(tmp_path):
    model, tok = _model()
    with pytest.raises(ConfigError, match="sft.max_seq_len"):
        training.sft_train(model, tok, DEMOS, _cfg(max_seq_len=5), 0, tmp_path / "ck", "fp", progress=False)


@pytest.mark.parametrize("key, value, expected", [
    ("max_seq_len", 1, "sft.max_seq_len: Input should be greater than or equal to 2"),
    ("overlong", "cut", "sft.overlong: Input should be 'drop' or 'truncate'"),
    ("batching", "bucketed", "sft.batching: Input should be 'padded', 'grouped' or 'packed'"),
])
def test_bad_sft_data_keys_name_the_key(key, value, expected):
    raw = copy.deepcopy(repo_params())
    raw["sft"][key] = value
    with pytest.raises(ConfigError, match=expected):
        parse_params(raw)



def test_sft_trains_on_the_arrow_table_the_stages_read_as_on_its_rows(tmp_path):
    """Issue 50, storage: the sft and distill stages held every demo as a Python dict on every rank
    (``read_problems``); they now pass the Arrow table ``read_demos`` reads from sft.parquet. The same weights,
    log and ledger either way; a demo without an id is named by its row. An empty file is one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from posttrain.demos import read_demos
    from posttrain.errors import StageError

    rows = [{"id": f"d{a}", **_demo(f"{a}*3=", str(a * 3), None)} for a in range(10, 18)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft.parquet")
    table = read_demos(tmp_path / "sft.parquet")
    assert isinstance(table, pa.Table) and table.num_rows == 8
    runs = []
    for name, demos in (("rows", rows), ("table", table)):
        model, tok = _model()
        res = training.sft_train(model, tok, demos, _cfg(), 0, tmp_path / name, "fp", progress=False)
        runs.append((model.state_dict(), [r["loss"] for r in res["log"]], res["ledger"]))
    (w_rows, loss_rows, led_rows), (w_tab, loss_tab, led_tab) = runs
    assert loss_tab == loss_rows and led_tab == led_rows and led_tab[0]["ids"][0].startswith("d")
    assert all(torch.equal(w_tab[k], w_rows[k]) for k in w_rows)
    no_ids = training.sft_train(_model()[0], tok, table.drop_columns(["id"]), _cfg(), 0, tmp_path / "n", "fp",
                                progress=False)["ledger"]
    assert no_ids[0]["ids"] == [str(int(i[1:]) - 10) for i in led_tab[0]["ids"]]  # row k of the file

    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(StageError, match="empty.parquet: no demonstrations"):
        read_demos(tmp_path / "empty.parquet")
