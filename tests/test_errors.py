"""Bad input anywhere: one clear line and exit 1 (config errors: exit 2, tests/test_config.py); tracebacks
only for bugs. Each case runs the stage's real ``main`` path (``runner.stage_main``) in-process."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import yaml

from posttrain import runner
from stages import curate, rl, sft


def _main(tmp_path: Path, raw: dict, stage, capsys) -> tuple[int, str]:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as e:
        runner.stage_main(stage.__name__.split(".")[-1], lambda p: stage.run(p, *stage.paths(p)),
                          ["--params", str(tmp_path / "params.yaml")])
    err = capsys.readouterr().err.strip()
    return e.value.code, err


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("posttrain ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_source_whose_rows_are_all_quarantined_stops_curate(tiny, tmp_path, capsys):
    """A .json file holding one array: every 'row' is bad. curate stops naming the file and the top reason,
    instead of succeeding with zero rows for sft to die on."""
    src = tmp_path / "gsm8k.json"
    src.write_text(json.dumps([{"question": "q?", "answer": "#### 1"}] * 3))
    tiny["task"] = {"kind": "math"}
    tiny["curate"]["sources"] = [{"kind": "file", "name": "gsm", "path": str(src), "format": "gsm8k"}]
    tiny["curate"]["eval"] = {"source": {"kind": "file", "name": "gsm_eval", "path": str(src), "format": "gsm8k"},
                              "rows": 1}
    code, err = _main(tmp_path, tiny, curate, capsys)
    line = _one_line(err)
    assert code == 1 and str(src) in line and "1 of 1 rows quarantined" in line and "row is not a JSON object" in line
    assert (Path(tiny["paths"]["curated_dir"]) / "quarantine.jsonl").is_file()  # nothing lost: every reason kept


def test_missing_upstream_output(tiny, tmp_path, capsys):
    code, err = _main(tmp_path, tiny, rl, capsys)  # nothing upstream has run
    line = _one_line(err)
    assert code == 1 and "train.parquet: not found" in line and "dvc repro" in line


def test_unreadable_parquet(tiny, tmp_path, capsys):
    d = Path(tiny["paths"]["curated_dir"])
    d.mkdir(parents=True)
    (d / "train.parquet").write_text("this is not parquet")
    code, err = _main(tmp_path, tiny, rl, capsys)
    line = _one_line(err)
    assert code == 1 and "train.parquet: not a readable Parquet file" in line


@pytest.mark.parametrize("base,expected", [
    ("someone/not-cached-here", "not a local folder and HF_HUB_OFFLINE=1"),
    ("EMPTY", "no file named"),  # a model folder without weights
])
def test_model_that_cannot_be_loaded(tiny, tmp_path, capsys, monkeypatch, base, expected):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if base == "EMPTY":
        folder = tmp_path / "empty_model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        base = str(folder)
    tiny["model"]["base"] = base
    d = Path(tiny["paths"]["curated_dir"])
    d.mkdir(parents=True)
    from posttrain.schema import PROBLEM_SCHEMA, write_parquet

    write_parquet(d / "sft.parquet", [{"id": "a:0", "source": "a", "task": "arith", "prompt": "12*3=", "answer": "36",
                                       "solution": None}], PROBLEM_SCHEMA)
    from stages import model

    code, err = _main(tmp_path, tiny, model, capsys)  # the model stage imports model.base
    line = _one_line(err)
    assert code == 1 and expected in line, line


@pytest.mark.parametrize("exc,expected", [
    ("cuda", "out of GPU memory. Lower sft.micro_batch_size"),
    ("host", "out of host memory. Lower sft.micro_batch_size"),
])
def test_out_of_memory_is_one_line_with_the_fix(tiny, tmp_path, capsys, monkeypatch, exc, expected):
    import torch

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") if exc == "cuda" \
            else MemoryError()

    monkeypatch.setattr(sft, "run", oom)
    code, err = _main(tmp_path, tiny, sft, capsys)
    assert code == 1 and expected in _one_line(err)


def test_a_bug_keeps_its_traceback(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "run", lambda *a, **k: {}["missing"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny))
    with pytest.raises(KeyError):
        runner.stage_main("sft", lambda p: sft.run(p, *sft.paths(p)), ["--params", str(tmp_path / "params.yaml")])


@pytest.mark.parametrize("made,hint", [
    ((), "re-run the same command (no checkpoint was written yet in {ck}: it starts over)"),
    # step_15 is being written (no meta.json yet), step_20.partial not renamed yet: step 10 is the newest whole one
    (("step_5", "step_10", "step_15/", "step_20.partial"), "re-run the same command to resume from step 10 (its "
                                                             "checkpoint in {ck})"),
])
def test_an_interrupt_names_the_step_a_re_run_resumes_from(tiny, tmp_path, capsys, monkeypatch, made, hint):
    """Issue 46, finding 9: the interrupt line said only "resume from their last checkpoint"; it names the step
    of the newest complete checkpoint on disk (the one a re-run loads), or says the re-run starts over."""
    ck = Path(tiny["paths"]["sft_checkpoints"])
    for name in made:
        (ck / name.rstrip("/")).mkdir(parents=True)
        if not name.endswith("/") and not name.endswith(".partial"):
            (ck / name / "meta.json").write_text("{}")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sft, "run", interrupted)
    code, err = _main(tmp_path, tiny, sft, capsys)
    assert code == 130 and _one_line(err) == f"posttrain sft: interrupted; {hint.format(ck=ck)}"


def test_the_resume_hint_of_a_reward_model_member_looks_in_its_own_folder(tiny):
    from posttrain.config import parse_params

    p = parse_params(tiny)
    member = Path(p.paths.reward_model_checkpoints) / "rm1"
    (member / "step_3").mkdir(parents=True)
    (member / "step_3" / "meta.json").write_text("{}")
    assert runner.resume_hint("reward_model@rm1", p) == (f"re-run the same command to resume from step 3 (its "
                                                        f"checkpoint in {member})")
    assert "starts over" in runner.resume_hint("reward_model@rm2", p) and "starts over" in runner.resume_hint(
        "curate", p)


@pytest.mark.parametrize("exc,expected", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/rl/shards"), "/data/rl/shards: no space left"),
    (PermissionError(errno.EACCES, "Permission denied", "/models/rl"), "/models/rl: permission denied"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x"), "/mnt/ro/x: read-only file system"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 400000000000000 bytes."), "out of host memory"),
])
def test_io_faults_and_host_oom_are_one_line_not_a_traceback(exc, expected):
    """Found by the hardening pass: a full disk, an unwritable path and torch's host allocation failure (a
    RuntimeError, not MemoryError) went out as tracebacks."""
    from posttrain.runner import expected_failure

    line = expected_failure("rl", exc)
    assert line is not None and expected in line and "\n" not in line
    assert expected_failure("rl", ValueError("a bug")) is None  # bugs keep their traceback
    shape = FileExistsError(errno.EEXIST, "File exists", "/srv/run/metrics")
    assert expected_failure("rl", shape, ["/srv/run/metrics"]) is not None  # a configured path: params.yaml's fault
    assert expected_failure("rl", shape, ["/srv/run/models"]) is None  # elsewhere: maybe a bug, keep the traceback


def test_a_file_where_an_output_folder_belongs_exits_1_in_one_line(tiny, tmp_path, capsys):
    blocker = tmp_path / "metrics"
    blocker.write_text("a file, where metrics/ should be a folder")
    tiny["paths"]["metrics_dir"] = str(blocker)
    code, err = _main(tmp_path, tiny, curate, capsys)
    assert code == 1 and "a file stands where a folder is needed" in _one_line(err)


def test_a_benchmark_with_no_usable_row_stops_curate_and_evaluate(tiny, tmp_path, capsys):
    """Found by the hardening pass: a garbage (or empty) decontamination benchmark passed with 0 items indexed,
    and with the wrong format half its rows were dropped uncounted."""
    garbage = tmp_path / "bench.jsonl"
    garbage.write_text("not json\n{\"question\": \"no answer field\"}\n")
    spec = {"kind": "file", "name": "junk", "path": str(garbage), "format": "math"}
    tiny["curate"]["decontam"]["benchmarks"] = [spec]
    code, err = _main(tmp_path, tiny, curate, capsys)
    line = _one_line(err)
    assert code == 1 and "benchmark 'junk'" in line and "0 usable of 2 rows" in line

    from posttrain.config import parse_params
    from posttrain.errors import StageError
    from posttrain.sources import check_usable

    p = parse_params({**tiny, "curate": {**tiny["curate"], "decontam": {}}})
    with pytest.raises(StageError, match="3 dropped > evaluate.max_unusable_frac=0.5"):
        check_usable(p.curate.sources[0], 2, ["format: no answer"] * 3, p.evaluate.max_unusable_frac,
                     "evaluate.max_unusable_frac")


@pytest.mark.parametrize("how", ["immutable", "read-only mount"])
def test_a_real_unwritable_output_folder_exits_1_in_one_line_naming_it(tiny, tmp_path, capsys, how):
    """The I/O faults above are raised by hand; here the file system refuses for real. Tests run as root, whom
    permission bits do not stop, so the folder is made immutable (``chattr +i``) or a read-only tmpfs is mounted
    on it; skipped where the machine allows neither."""
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = {"immutable": (["chattr", "+i", str(ro)], ["chattr", "-i", str(ro)]),
           "read-only mount": (["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], ["umount", str(ro)])}
    on, off = cmd[how]
    if subprocess.run(on, capture_output=True).returncode != 0:
        pytest.skip(f"{how}: not permitted on this machine")
    try:
        tiny["paths"]["curated_dir"] = str(ro / "curated")
        code, err = _main(tmp_path, tiny, curate, capsys)
    finally:
        subprocess.run(off, capture_output=True)
    line = _one_line(err)
    assert code == 1 and str(ro / "curated") in line, line


def test_evaluate_of_a_model_no_stage_has_made_yet_refuses_in_one_line(tiny, tmp_path, capsys, monkeypatch):
    """Issue 46, finding 9: ``evaluate@rl`` with the eval split present but no ``models/rl`` yet went on to load
    it (a hub lookup of the path, offline) after opening its MLflow run. A model folder a pipeline stage writes
    (a ``paths`` entry) is now one of its needs: one line, exit 1, before any work."""
    from stages import evaluate

    d = Path(tiny["paths"]["curated_dir"])
    d.mkdir(parents=True)
    (d / "eval.parquet").write_text("")  # present: only the model is missing
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny))
    monkeypatch.setattr("sys.argv", ["evaluate", "--model", "rl", "--params", str(tmp_path / "params.yaml")])
    with pytest.raises(SystemExit) as e:
        evaluate.main()
    line = _one_line(capsys.readouterr().err)
    assert e.value.code == 1 and line == (f"posttrain evaluate@rl: {tiny['paths']['rl_model']} does not exist: run "
                                          "the stages upstream of evaluate@rl first (`dvc repro evaluate@rl` or "
                                          "`posttrain repro`)")


@pytest.mark.parametrize(("argv", "code", "line"), [
    (["-m", "stages.rl"], 1, "posttrain rl: {curated}/train.parquet does not exist: run the stages upstream of rl "
                            "first (`dvc repro rl` or `posttrain repro`)"),
    (["-m", "stages.evaluate", "--model", "sft"], 1, "posttrain evaluate@sft: {curated}/eval.parquet does not "
                                                       "exist: run the stages upstream of evaluate@sft first "
                                                       "(`dvc repro evaluate@sft` or `posttrain repro`)"),
    (["-m", "stages.evaluate", "--model", "nope"], 2, "posttrain: evaluate --model 'nope': not a key of "
                                                        "evaluate.models ['base', 'rl', 'sft', 'student', "
                                                        "'student_sft']"),  # (safe_dump sorts the keys)
    (["-m", "stages.sft", "--misspelled"], 2, "posttrain: {params}: sft.lerning_rate: unknown key; did you mean "
                                               "'lr'?"),
])
def test_a_refusal_comes_before_the_stage_imports_torch(tiny, tmp_path, argv, code, line):
    """Issue 46, finding 9: ``python -m stages.rl`` refused a missing upstream only after importing its module
    (torch, transformers: about 6 s here, 13-14 s on a loaded machine). ``stages/__init__.py`` now runs
    ``layout.preflight`` first: the same one line and exit code, and torch never imported (``-X importtime``
    lists every module a run imports)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    if "--misspelled" in argv:
        argv = argv[:-1]
        tiny["sft"]["lerning_rate"] = tiny["sft"].pop("lr")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny))
    r = subprocess.run([sys.executable, "-X", "importtime", *argv, "--params", str(tmp_path / "params.yaml")],
                       cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    imported = {x.rsplit("|", 1)[1].strip() for x in r.stderr.splitlines() if x.startswith("import time:")}
    said = [x for x in r.stderr.splitlines() if not x.startswith("import time:")]
    expected = line.format(curated=tiny["paths"]["curated_dir"], params=tmp_path / "params.yaml")
    assert r.returncode == code and len(said) == 1 and said[0].startswith(expected), r.stderr[-2000:]
    assert "stages.layout" in imported and not {"torch", "transformers"} & imported
