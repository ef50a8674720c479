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
