"""The resumable chunked writer (posttrain.streaming) and the rollout stage's resume on it."""

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain import streaming
from posttrain.streaming import PartialParquet, rebatch
from tests.conftest import import_base

SCHEMA = pa.schema([("prompt_id", pa.string()), ("sample", pa.int32())])
KEY = {"params": "p1", "train": "t1", "policy": "w1"}


class Killed(Exception):
    pass


def _rows(c: int) -> list[dict]:
    return [{"prompt_id": f"q{c}", "sample": j} for j in range(3)]


def test_done_counts_the_contiguous_parts_from_chunk_0(tmp_path):
    w = PartialParquet(tmp_path / "part", KEY, 4, SCHEMA)
    assert w.done() == 0
    w.write(0, _rows(0))
    w.write(2, _rows(2))  # chunk 1 missing: the run continues at 1 (chunk 2 is rewritten, same rows)
    assert w.done() == 1
    w.write(1, _rows(1))
    assert PartialParquet(tmp_path / "part", KEY, 4, SCHEMA).done() == 3  # reopened with the same key: kept


def test_chunks_are_buffered_into_parts_of_flush_rows_and_a_kill_loses_only_the_buffer(tmp_path):
    w = PartialParquet(tmp_path / "part", KEY, 5, SCHEMA, flush_rows=6, flush_seconds=3600)
    for c in range(3):
        w.write(c, _rows(c))  # 3 rows each: a part every 2 chunks
    assert sorted(f.name for f in (tmp_path / "part").glob("part-*")) == ["part-0000000-0000002.parquet"]
    assert w.done() == 2  # chunk 2 is in memory only: a kill now loses it
    w2 = PartialParquet(tmp_path / "part", KEY, 5, SCHEMA, flush_rows=6, flush_seconds=3600)  # the re-run
    assert w2.done() == 2
    for c in range(2, 5):
        w2.write(c, _rows(c))
    w2.assemble(tmp_path / "out.parquet")  # flushes the last, partial, buffer first
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == [r for c in range(5) for r in _rows(c)]
    w3 = PartialParquet(tmp_path / "t", KEY, 3, SCHEMA, flush_rows=10**6, flush_seconds=0)  # 0 s: every chunk
    w3.write(0, _rows(0))
    assert w3.done() == 1


def test_another_key_starts_over_and_names_what_changed(tmp_path, caplog):
    w = PartialParquet(tmp_path / "part", KEY, 4, SCHEMA)
    w.write(0, _rows(0))
    with caplog.at_level(logging.WARNING, logger="posttrain.streaming"):
        w2 = PartialParquet(tmp_path / "part", {**KEY, "policy": "w2"}, 4, SCHEMA)
    assert w2.done() == 0 and not list((tmp_path / "part").glob("part-*"))
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'part'} holds a partial run of another configuration (changed: policy): starting over"]
    w2.write(0, _rows(0))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.streaming"):
        assert PartialParquet(tmp_path / "part", {**KEY, "policy": "w2"}, 5, SCHEMA).done() == 0  # total changed
    assert "changed: total" in caplog.records[0].getMessage()


def test_a_folder_without_a_cursor_is_not_resumed(tmp_path):
    (tmp_path / "part").mkdir()
    pq.write_table(pa.Table.from_pylist(_rows(0), schema=SCHEMA), tmp_path / "part" / "part-0000000-0000001.parquet")
    assert PartialParquet(tmp_path / "part", KEY, 2, SCHEMA).done() == 0


def test_assembled_file_is_the_same_bytes_however_the_run_was_split(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "ROW_GROUP_ROWS", 4)  # row groups cross chunk boundaries
    one = PartialParquet(tmp_path / "one", KEY, 5, SCHEMA)
    for c in range(5):
        one.write(c, _rows(c))
    assert one.assemble(tmp_path / "one.parquet") == 15
    first = PartialParquet(tmp_path / "two", KEY, 5, SCHEMA)
    for c in range(2):
        first.write(c, _rows(c))
    second = PartialParquet(tmp_path / "two", KEY, 5, SCHEMA)  # "killed" after 2 chunks, re-run
    for c in range(second.done(), 5):
        second.write(c, _rows(c))
    second.assemble(tmp_path / "two.parquet")
    assert (tmp_path / "one.parquet").read_bytes() == (tmp_path / "two.parquet").read_bytes()
    f = pq.ParquetFile(tmp_path / "one.parquet")
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == [4, 4, 4, 3]
    assert f.read().to_pylist() == [r for c in range(5) for r in _rows(c)]


def test_assemble_refuses_a_partial_run(tmp_path):
    w = PartialParquet(tmp_path / "part", KEY, 2, SCHEMA)
    w.write(0, _rows(0))
    with pytest.raises(RuntimeError, match="1 of 2 chunks"):
        w.assemble(tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_rebatch_gives_batches_of_exactly_n_rows():
    bs = [pa.RecordBatch.from_pylist([{"prompt_id": "a", "sample": i} for i in range(k)], schema=SCHEMA)
          for k in (3, 0, 5, 1)]  # 9 rows in uneven batches
    out = list(rebatch(iter(bs), 4))
    assert [b.num_rows for b in out] == [4, 4, 1]
    assert [x for b in out for x in b.column("sample").to_pylist()] == [0, 1, 2, 0, 1, 2, 3, 4, 0]


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_rollout_stage_resumes_after_a_crash_and_starts_over_on_another_config(tiny, monkeypatch, caplog):
    from posttrain.config import parse_params
    from stages import curate, rollout, sft

    tiny["rollout"].update({"num_prompts": 12, "samples_per_prompt": 2, "generate_batch_size": 4,  # 6 chunks
                            "checkpoint_every_s": 0})  # a part per chunk
    p = parse_params(tiny)
    curate.run(p, *curate.paths(p))
    import_base(p)
    sft.run(p, *sft.paths(p))
    ins, out = rollout.paths(p)
    rollout.run(p, ins, out)
    straight = pq.read_table(out["rollouts"])
    out["rollouts"].unlink()

    real_write, calls = PartialParquet.write, []

    def crash_at_chunk_3(self, c, rows):
        calls.append(c)
        if c == 3:
            raise Killed  # a crash after chunks 0-2 are on disk
        real_write(self, c, rows)

    def recording(self, c, rows):
        calls.append(c)
        real_write(self, c, rows)

    monkeypatch.setattr(PartialParquet, "write", crash_at_chunk_3)
    with pytest.raises(Killed):
        rollout.run(p, ins, out)
    assert not out["rollouts"].exists() and len(list(out["checkpoints"].glob("part-*"))) == 3
    monkeypatch.setattr(PartialParquet, "write", recording)
    calls.clear()
    with caplog.at_level(logging.INFO):
        m = rollout.run(p, ins, out)
    assert calls == [3, 4, 5]  # only the missing chunks were sampled
    assert "resuming at prompt 6 of 12 (3 of 6 chunks on disk" in caplog.text
    assert m["resumed_at_prompt"] == 6 and m["samples"] == 24
    assert pq.read_table(out["rollouts"]).equals(straight) and not out["checkpoints"].exists()

    # a partial run of another configuration is not resumed
    monkeypatch.setattr(PartialParquet, "write", crash_at_chunk_3)
    with pytest.raises(Killed):
        rollout.run(p, ins, out)
    tiny["rollout"]["sampling"]["temperature"] = 0.7
    monkeypatch.setattr(PartialParquet, "write", recording)
    calls.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rollout.run(parse_params(tiny), ins, out)
    assert calls == [0, 1, 2, 3, 4, 5]
    assert "holds a partial run of another configuration (changed: params): starting over" in caplog.text
