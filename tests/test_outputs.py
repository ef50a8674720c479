"""A stage's outputs replaced as one set (``posttrain.outputs``): a kill leaves the old set or the new one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from posttrain import outputs
from tests.conftest import import_base


def _digest(p: Path) -> str:
    """Every file of an output but the live train log (written as the run goes, by design)."""
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.name != "train_log.csv") if p.is_dir() else [p]
    return hashlib.md5(b"".join(f.read_bytes() for f in files)).hexdigest()


def _write_set(root: Path, version: str) -> None:
    with outputs.output_set([root / "model", root / "metrics.json"], root, "t"):
        with outputs.atomic_path(root / "model") as tmp:
            tmp.mkdir()
            (tmp / "weights").write_text(version)
        with outputs.atomic_path(root / "metrics.json") as tmp:
            tmp.write_text(version)
        with outputs.atomic_path(root / "checkpoint") as tmp:  # not in the set: written at once
            tmp.write_text(version)
        assert (root / "checkpoint").read_text() == version
        if version == "v1":
            assert not (root / "model").exists()  # held back until the set commits


def test_a_set_replaces_its_outputs_together_and_an_error_replaces_none(tmp_path):
    _write_set(tmp_path, "v1")
    assert (tmp_path / "model" / "weights").read_text() == (tmp_path / "metrics.json").read_text() == "v1"
    with pytest.raises(KeyboardInterrupt), outputs.output_set([tmp_path / "model", tmp_path / "metrics.json"],
                                                              tmp_path, "t"):
        with outputs.atomic_path(tmp_path / "model") as tmp:
            tmp.mkdir()
            (tmp / "weights").write_text("v2")
        raise KeyboardInterrupt  # killed between the model and the metrics
    assert (tmp_path / "model" / "weights").read_text() == "v1"  # the old set, whole
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_a_kill_during_the_renames_is_completed_by_the_next_start(tmp_path, monkeypatch):
    _write_set(tmp_path, "v1")
    real, calls = outputs._swap, []

    def dies_on_second(*a):
        calls.append(a)
        if len(calls) == 3:  # 1: the checkpoint (at once), 2: the model (the commit's first), 3: the metrics
            raise SystemExit("killed")
        real(*a)

    monkeypatch.setattr(outputs, "_swap", dies_on_second)
    with pytest.raises(SystemExit):
        _write_set(tmp_path, "v2")
    monkeypatch.undo()
    journals = list(tmp_path.glob(".commit-*.json"))
    assert journals and {(tmp_path / "model" / "weights").read_text(), (tmp_path / "metrics.json").read_text()} == \
        {"v1", "v2"}  # the mix a kill left
    assert outputs.finish_commits(tmp_path) == ["t"]
    assert (tmp_path / "model" / "weights").read_text() == (tmp_path / "metrics.json").read_text() == "v2"
    assert not list(tmp_path.glob(".commit-*")) and not list(tmp_path.glob(".*.tmp-*"))


def test_sft_killed_mid_training_leaves_its_previous_outputs_whole(tiny, tmp_path, monkeypatch):
    """Found by the hardening issue's reading: sft wrote the base model at its start and the SFT model at its
    end; a kill in between left the new base beside the old SFT model and metrics."""
    from posttrain import training
    from posttrain.config import parse_params
    from stages import curate, sft

    p = parse_params(tiny)
    curate.run(p, *curate.paths(p))
    import_base(p)
    sft.run(p, *sft.paths(p))
    _, out = sft.paths(p)
    before = {k: _digest(v) for k, v in out.items() if k != "checkpoints"}
    p2 = parse_params({**tiny, "seed": 1})  # another base model
    monkeypatch.setattr(training, "sft_train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        import_base(p2)
        sft.run(p2, *sft.paths(p2))
    assert {k: _digest(v) for k, v in out.items() if k != "checkpoints"} == before
    assert len((out["report_dir"] / "train_log.csv").read_text().splitlines()) == 1  # the killed run's, live


def test_every_stage_start_completes_a_half_replaced_set(tiny, tmp_path, capsys):
    from posttrain import runner
    from stages import curate

    metrics = Path(tiny["paths"]["metrics_dir"])
    metrics.mkdir(parents=True)
    twin_dir = metrics / ".x.json.tmp-abc"
    twin_dir.mkdir()
    (twin_dir / "x.json").write_text(json.dumps({"new": True}))
    (metrics / ".commit-rl.json").write_text(json.dumps([[str(twin_dir), str(twin_dir / "x.json"),
                                                          str(metrics / "x.json")]]))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny))
    runner.stage_main("curate", lambda p: curate.run(p, *curate.paths(p)), ["--params", str(tmp_path / "params.yaml")])
    assert json.loads((metrics / "x.json").read_text()) == {"new": True} and not twin_dir.exists()
    assert not (metrics / ".commit-rl.json").exists()


def test_the_live_train_log_is_written_at_once_inside_a_set(tmp_path):
    """Found by reading the set against the live log: its header went into a held-back twin, so the appends of
    a running stage landed in the previous run's file."""
    from posttrain.trainlog import TrainLog

    report = tmp_path / "report"
    report.mkdir()
    (report / "train_log.csv").write_text("step,loss\n1,9.0\n2,8.0\n")  # the previous run's
    with outputs.output_set([report], tmp_path, "t"):
        log = TrainLog(report / "train_log.csv", ["step", "loss"])
        log.append({"step": 1, "loss": 0.5})
        assert (report / "train_log.csv").read_text().splitlines() == ["step,loss", "1,0.5"]  # live, this run's
        log.close()
    assert (report / "train_log.csv").read_text().splitlines() == ["step,loss", "1,0.5"]


def test_a_journal_names_absolute_paths_so_any_folder_can_complete_it(tmp_path, monkeypatch):
    """Found in the last read of the change: stages pass relative paths, and the journal kept them relative,
    so a recovery started from another folder would have looked for the twins in the wrong place."""
    monkeypatch.chdir(tmp_path)
    with outputs.output_set([Path("model")], Path("."), "t"):
        with outputs.atomic_path(Path("model")) as tmp:
            tmp.write_text("v1")
    monkeypatch.setattr(outputs, "_replay", lambda pairs: (_ for _ in ()).throw(SystemExit("killed")))
    with pytest.raises(SystemExit), outputs.output_set([Path("model")], Path("."), "t"):
        with outputs.atomic_path(Path("model")) as tmp:
            tmp.write_text("v2")
    monkeypatch.undo()
    (journal,) = tmp_path.glob(".commit-*.json")
    assert all(Path(x).is_absolute() for pair in json.loads(journal.read_text()) for x in pair)
    monkeypatch.chdir("/")
    assert outputs.finish_commits(tmp_path) == ["t"] and (tmp_path / "model").read_text() == "v2"


def test_run_facts_leave_the_metrics_file_and_come_back_merged(tmp_path):
    """Issue 49, finding 6: timings filled ``dvc exp show --only-changed`` (15 of 17 columns before rl's pass@1).
    ``write_metrics`` keeps results in the metrics file and moves how the run went (times, throughputs, world
    size, resume point), nested sections too, to ``<stage>.run.json``; ``read_metrics`` gives back the whole."""
    import json

    from posttrain.outputs import run_facts_path
    from posttrain.runfacts import read_metrics, write_metrics

    m = {"steps": 40, "seconds": 35.7, "gen_s": 20.1, "samples_per_s": 9.0, "seconds_per_step": 0.9,
         "student_sft_seconds": 3.0, "world_size": 2, "resumed_from_step": 10, "final_reward": 0.5,
         "phase_steps": {"warmup": 2}, "eval": {"greedy": 0.25, "seconds": 4.0}, "timing": {"total_s": 1.0},
         "update_s": {"p50": 0.2, "n": 3}}
    f = tmp_path / "metrics" / "rl.json"
    write_metrics(f, m)
    assert json.loads(f.read_text()) == {"steps": 40, "final_reward": 0.5, "phase_steps": {"warmup": 2},
                                         "eval": {"greedy": 0.25}}  # (a section of run facts alone moves whole)
    assert run_facts_path(f) == tmp_path / "metrics" / "rl.run.json"
    assert json.loads(run_facts_path(f).read_text()) == {
        "seconds": 35.7, "gen_s": 20.1, "samples_per_s": 9.0, "seconds_per_step": 0.9, "student_sft_seconds": 3.0,
        "world_size": 2, "resumed_from_step": 10, "eval": {"seconds": 4.0}, "timing": {"total_s": 1.0},
        "update_s": {"p50": 0.2, "n": 3}}  # a section named like a run fact moves whole
    assert read_metrics(f) == m


def test_a_stage_run_through_main_records_its_peak_rss(tiny, tmp_path):
    """The run facts (metrics/<stage>.run.json, MLflow) carry the stage process's peak RSS (ru_maxrss), so every
    stage of a run says what memory it needed; the results file does not (it differs run to run)."""
    from posttrain import runner
    from posttrain.outputs import run_facts_path
    from posttrain.runfacts import read_metrics
    from stages import curate

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny))
    runner.stage_main("curate", lambda p: curate.run(p, *curate.paths(p)), ["--params", str(tmp_path / "params.yaml")])
    path = Path(tiny["paths"]["metrics_dir"]) / "curate.json"
    facts = json.loads(run_facts_path(path).read_text())
    assert 50 < facts["peak_rss_mb"] < 24_000 and "peak_rss_mb" not in json.loads(path.read_text())
    assert read_metrics(path)["peak_rss_mb"] == facts["peak_rss_mb"]
