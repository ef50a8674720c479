"""Atomic outputs: write, fsync, rename; a killed run's temp folders are cleaned by the next run."""

from __future__ import annotations

import json
import logging
import os

import pytest

from posttrain import outputs, schema


def test_folder_output_replaced_whole_and_fsynced(tmp_path, monkeypatch):
    out = tmp_path / "models" / "rl"
    out.mkdir(parents=True)
    (out / "old.bin").write_text("old")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    with outputs.atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "model.safetensors").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "sub"]  # the old file is gone
    assert os.listdir(tmp_path / "models") == ["rl"]  # no temp left
    names = [os.path.basename(p) for p in synced]
    assert {"model.safetensors", "x.json", "sub", "models"} <= set(names)  # files, folders, then the parent


def test_failure_keeps_the_previous_output_and_leaves_nothing(tmp_path):
    out = tmp_path / "metrics.json"
    schema.write_json(out, {"a": 1})
    with pytest.raises(RuntimeError):
        with outputs.atomic_path(out) as tmp:
            tmp.write_text('{"a": 2')  # half-written, then the stage dies
            raise RuntimeError("killed")
    assert json.loads(out.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_temp_folders_of_a_killed_run_are_removed_and_logged(tmp_path, caplog):
    stale = tmp_path / f".student{outputs.TMP_TAG}abc123" / "student"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)  # model-sized in real life
    other = tmp_path / f".rl{outputs.TMP_TAG}zzz"  # another output's temp: not this write's business
    other.mkdir()
    with caplog.at_level(logging.WARNING, logger="posttrain.schema"):
        schema.write_text(tmp_path / "student", "done")
    assert not stale.parent.exists() and other.exists()
    assert "killed while writing" in caplog.text and f".student{outputs.TMP_TAG}abc123" in caplog.text


def test_an_io_error_inside_an_atomic_output_names_the_output_not_its_temp_folder(tmp_path):
    """Found with a real read-only folder (tests/test_errors.py): the one-line error named
    ``.curated.tmp-t6dtbf77``, a name the user never configured."""
    import errno

    from posttrain.outputs import atomic_path

    out = tmp_path / "curated"
    with pytest.raises(OSError) as e, atomic_path(out) as tmp:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "train.parquet"))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out / "train.parquet")
    assert not out.exists() and not list(tmp_path.glob(".curated.tmp-*"))  # nothing half-written left


def test_batched_writes_are_the_bytes_of_one_table_and_reads_stream(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from posttrain.errors import StageError

    monkeypatch.setattr(schema, "BATCH_ROWS", 4)  # 10 rows: batches of 4, 4, 2
    rows = [{"id": f"s:{i}", "source": "s", "task": "arith", "prompt": f"{i}*3=", "answer": str(3 * i),
             "solution": None} for i in range(10)]
    schema.write_parquet(tmp_path / "a.parquet", iter(rows), schema.PROBLEM_SCHEMA)  # a generator is enough
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.PROBLEM_SCHEMA), tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert [len(b) for b in schema.iter_rows(tmp_path / "a.parquet", ["id"], batch_rows=4)] == [4, 4, 2]
    assert next(schema.iter_rows(tmp_path / "a.parquet", ["id", "answer"]))[1] == {"id": "s:1", "answer": "3"}
    assert schema.read_problems(tmp_path / "a.parquet", limit=3) == rows[:3]
    assert schema.read_problems(tmp_path / "a.parquet") == rows
    with pytest.raises(StageError, match=r"missing columns \['nope'\]"):
        schema.read_columns(tmp_path / "a.parquet", ["id", "nope"])
