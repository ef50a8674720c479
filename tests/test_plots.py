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
