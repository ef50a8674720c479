"""``key.path=value`` overrides of params.yaml (posttrain.config.overrides): validated on a copy, refused in one
line naming the override, rendered as ``dvc exp run -S`` writes the file."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO

from posttrain.config import ConfigError, parse_overrides, read_yaml, render_overrides


@pytest.fixture
def params_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text((REPO / "params.yaml").read_text())  # the real file: comments, anchors, every section
    return path


def test_overrides_give_validated_params_and_write_nothing(params_file):
    before = params_file.read_text()
    params, edits = parse_overrides(params_file, ["rl.lr=2.5e-6", "curate.eval.rows=7", "rl.policy_loss=vanilla_pg"])
    assert params.rl.lr == 2.5e-6 and params.curate.eval.rows == 7 and params.rl.policy_loss == "vanilla_pg"
    assert edits == [(("rl", "lr"), 2.5e-6), (("curate", "eval", "rows"), 7), (("rl", "policy_loss"), "vanilla_pg")]
    assert params_file.read_text() == before
    assert parse_overrides(params_file, [])[1] == []


@pytest.mark.parametrize("override, says", [
    ("curate.eval.sise=10", "curate.eval.sise: unknown key"),  # a typo of a key
    ("rl.lr=fast", "rl.lr: Input should be a valid number"),  # a value of the wrong type
    ("rl.lr.x=1", "override rl.lr.x: rl.lr is not a section of params.yaml"),  # below a leaf
    ("nope.x=1", "override nope.x: nope is not a section of params.yaml"),
    ("rl.lr=[1", "override 'rl.lr=[1': value is not valid YAML: while parsing a flow sequence: expected ',' or ']'"),
    ("rl.lr: [1, {", "override 'rl.lr: [1, {': expected key.path=value"),  # no '='
    ("rl..lr=1", "override 'rl..lr=1': expected key.path=value"),
    ("=1", "override '=1': expected key.path=value"),
])
def test_bad_override_is_one_line_naming_it(params_file, override, says):
    with pytest.raises(ConfigError) as e:
        parse_overrides(params_file, ["rl.lr=1e-6", override])
    msg = str(e.value)
    assert says in msg and "\n" not in msg, msg


def test_values_are_yaml_1_2_as_dvc_reads_them(params_file):
    # YAML 1.1 (PyYAML) reads ``off`` as false; DVC and read_yaml read YAML 1.2, where it is a string
    _, edits = parse_overrides(params_file, ["evaluate.ks=[1, 2]", "rl.ref_reset=null", "seed=3"])
    assert [v for _, v in edits] == [[1, 2], None, 3]


def test_rendered_text_keeps_comments_anchors_and_order(params_file):
    text = params_file.read_text()
    _, edits = parse_overrides(params_file, ["rl.lr=2.5e-6", "curate.eval.rows=7"])
    out = render_overrides(text, edits)
    comments = [line.strip() for line in text.splitlines() if line.strip().startswith("#")]
    assert comments and all(c in out for c in comments)  # every comment line survives
    assert "&base_model" in out and "*base_model" in out  # anchors and aliases too
    raw, new = read_yaml(text), read_yaml(out)
    assert list(new) == list(raw) and list(new["rl"]) == list(raw["rl"])  # key order kept
    assert new["rl"]["lr"] == 2.5e-6 and new["curate"]["eval"]["rows"] == 7
    new["rl"]["lr"], new["curate"]["eval"]["rows"] = raw["rl"]["lr"], raw["curate"]["eval"]["rows"]
    assert new == raw  # nothing else changed
    assert yaml.safe_load(out)["rl"]["lr"] == 2.5e-6  # DVC's other readers agree
    assert render_overrides(text, []) == text
