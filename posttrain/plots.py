"""PNG plots people open instead of reading tables (``dvc plots show`` needs a CDN; these need nothing)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.outputs import atomic_path

Panel = str | tuple[str, ...]  # one metric, or several drawn in one panel (the first names it)


def training_curves(rows: Sequence[dict[str, Any]], x: str, ys: Sequence[Panel], title: str, path: Path,
                    phase: str | None = None, per_row: int = 4) -> None:
    """One small panel per entry of ``ys`` against ``x`` (a tuple: its metrics as lines of one panel, with a
    legend), ``per_row`` panels a row; rows as written to a stage's train_log.csv. ``phase``: a column whose
    changes are drawn as dashed vertical lines, labelled with the phase that starts there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows = -(-len(ys) // per_row)
    cols = min(len(ys), per_row)
    fig, axes = plt.subplots(n_rows, cols, figsize=(3.4 * cols, 2.9 * n_rows), squeeze=False)
    xs = [float(r[x]) for r in rows]
    starts = [(xs[i], str(r[phase])) for i, r in enumerate(rows)
              if phase and (i == 0 or r[phase] != rows[i - 1][phase])]
    for ax, panel in zip(axes.flat, ys, strict=False):
        names = (panel,) if isinstance(panel, str) else panel
        for y in names:
            pts = [(a, float(r[y])) for a, r in zip(xs, rows, strict=True) if r.get(y) not in (None, "")]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1, label=y)
        if len(names) > 1:
            ax.legend(fontsize=7)
        for i, (at, name) in enumerate(starts if len(starts) > 1 else []):
            if i:
                ax.axvline(at - 0.5, color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(name, (at - 0.5, 1.0), xycoords=("data", "axes fraction"), fontsize=7, va="top")
        ax.set_title(" / ".join(names), fontsize=9)
        ax.set_xlabel(x, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(ys):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def pass_at_k_curves(results: dict[str, dict[str, dict[str, Any]]], ks: Sequence[int], path: Path) -> None:
    """pass@k against k (log scale) with 95% intervals, one line per model (its own marker and dash, models
    nudged apart on x so equal curves stay visible), two panels per split (``evaluate`` results): the whole
    [0, 1] and a zoom on the models whose best pass@k is within 0.5 of the best model's (a base model at 0
    would squash the rest into a line at the top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.8 * len(results)), squeeze=False)
    for (full, zoom), (split, by_model) in zip(axes, results.items(), strict=True):
        curves: list[tuple[list[float], list[float]]] = []  # per model: its values, and its interval ends
        for j, (name, m) in enumerate(by_model.items()):
            pts = [(k, m[f"pass@{k}"], m.get(f"pass@{k}_ci")) for k in ks if f"pass@{k}" in m]
            if not pts:
                continue
            marker, line = styles[j % len(styles)]
            x = [k * 1.04 ** (j - len(by_model) / 2) for k, _, _ in pts]
            y = [v for _, v, _ in pts]
            err = [[max(v - ci[0], 0) for _, v, ci in pts], [max(ci[1] - v, 0) for _, v, ci in pts]] \
                if all(ci is not None for _, _, ci in pts) else None
            for ax in (full, zoom):
                ax.errorbar(x, y, yerr=err, marker=marker, linestyle=line, markersize=4, capsize=2, linewidth=1,
                            label=name)
            curves.append((y, y + [v - e for v, e in zip(y, err[0], strict=True)]
                           + [v + e for v, e in zip(y, err[1], strict=True)] if err else y))
        for ax, title in ((full, f"pass@k on {split}"), (zoom, f"pass@k on {split}, zoomed")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("k")
            ax.set_ylabel("pass@k (95% interval)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        full.set_ylim(-0.02, 1.02)
        full.legend(fontsize=8)
        if curves:
            best = max(max(y) for y, _ in curves)
            near = [v for y, ends in curves if max(y) >= best - 0.5 for v in ends]
            lo, hi = min(near), max(near)
            pad = max(0.01, 0.15 * (hi - lo))
            zoom.set_ylim(max(-0.02, lo - pad), min(1.02, hi + pad))
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def learned_scores(by_name: dict[str, dict[str, Any]], path: Path) -> None:
    """One panel per learned reward: histograms of its scores by the verifier's verdict (correct, incorrect,
    unverified), on shared bins; ``by_name[name][verdict]`` is an array of scores (the reward audit's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(by_name), figsize=(4.5 * len(by_name), 3.2), squeeze=False)
    for ax, (name, by) in zip(axes[0], by_name.items(), strict=True):
        every = np.concatenate([np.asarray(v, dtype=float) for v in by.values()])
        bins = np.histogram_bin_edges(every, bins=30) if len(every) else 10
        for verdict, color in (("correct", "tab:green"), ("incorrect", "tab:red"), ("unverified", "tab:gray")):
            if len(by[verdict]):
                ax.hist(by[verdict], bins=bins, alpha=0.55, color=color, label=f"{verdict} ({len(by[verdict])})")
        ax.set_title(f"{name}: score by verifier verdict", fontsize=10)
        ax.set_xlabel("learned score", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
