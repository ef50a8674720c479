"""The PNG plots: what each panel draws (the figure is caught before it closes), not how it looks."""

from __future__ import annotations

import matplotlib.pyplot as plt

from posttrain import plots


def test_rl_panels_draw_every_metric_the_readme_lists_and_phases_are_marked(tmp_path, monkeypatch):
    """Issue 46, finding 6: the rl plot had 4 panels (reward, zero-variance share, length, entropy) where the
    README promises reward, pass rate, KL, entropy, clip fraction, lengths and the time split; the distill plot
    did not mark its phases. A tuple is one panel of several lines; ``phase`` draws a dashed line where it changes."""
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    rows = [{"step": s, "phase": "warmup" if s < 3 else "on_policy", "a": s, "b": 2 * s, "c": ""} for s in range(1, 6)]
    plots.training_curves(rows, "step", [("a", "b"), "c", "a"], "t", tmp_path / "x.png", phase="phase", per_row=2)
    (fig,) = figs
    axes = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in axes] == ["a / b", "c", "a"]  # 3 panels on 2 rows, the 4th cell off
    assert [len(ax.get_lines()) for ax in axes] == [2 + 1, 1 + 1, 1 + 1]  # a line per metric (c: empty), a phase line
    assert axes[0].get_lines()[-1].get_xdata()[0] == 2.5  # between step 2 (warmup) and step 3 (on_policy)
    assert [t.get_text() for t in axes[0].texts] == ["warmup", "on_policy"]
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_pass_at_k_has_a_zoomed_panel_intervals_and_models_told_apart(tmp_path, monkeypatch):
    """Issue 46, finding 6: sft hid under student_sft (same values, same style), the [0, 1] axis squashed where
    the trained models are, and no interval was drawn. Each model has its own marker and is nudged on x; the
    zoom panel spans the models near the best (not a base model at 0); error bars are the 95% intervals."""
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    ci = {"pass@1": 0.9, "pass@1_ci": [0.85, 0.94], "pass@4": 0.99, "pass@4_ci": [0.96, 1.0]}
    res = {"eval": {"base": {"pass@1": 0.0, "pass@1_ci": [0.0, 0.04], "pass@4": 0.0, "pass@4_ci": [0.0, 0.04]},
                    "sft": ci, "student_sft": ci}}
    plots.pass_at_k_curves(res, [1, 4], tmp_path / "p.png")
    (fig,) = figs
    full, zoom = fig.axes
    assert tuple(full.get_ylim()) == (-0.02, 1.02) and 0.8 < zoom.get_ylim()[0] < 0.85  # 0.85 minus a margin
    lines = [line for line in zoom.get_lines() if len(line.get_xdata()) == 2 and line.get_marker() not in ("_", "")]
    assert len({line.get_marker() for line in lines}) == 3 and len({line.get_xdata()[0] for line in lines}) == 3
    assert len(zoom.collections) == 3  # one set of error bars per model
