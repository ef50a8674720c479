"""PNG plots people open instead of reading tables (``dvc plots show`` needs a CDN; these need nothing)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.schema import atomic_path


def training_curves(rows: Sequence[dict[str, Any]], x: str, ys: Sequence[str], title: str, path: Path) -> None:
    """One small panel per metric in ``ys`` against ``x``; rows as written to a stage's train_log.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ys), figsize=(3.2 * len(ys), 2.8), squeeze=False)
    xs = [float(r[x]) for r in rows]
    for ax, y in zip(axes[0], ys, strict=True):
        pts = [(a, float(r[y])) for a, r in zip(xs, rows, strict=True) if r.get(y) not in (None, "")]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        ax.set_title(y, fontsize=10)
        ax.set_xlabel(x, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
