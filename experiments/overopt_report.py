"""The over-optimisation experiment's analysis (``experiments/overopt.py``'s runs): the claims with paired
bootstrap intervals over held-out problems (seed means), the rows of the Reproductions table, the plot.

Claims (issue 29; Gao et al. 2023, Coste et al. 2024):

1. proxy keeps rising while gold peaks and falls (single RM, small N, no KL);
2. an ensemble (WCO or UWO) + small KL keeps gold higher at the end than a single RM (no KL), same N;
3. more preference data delays the peak (the single RM's peak step, large N vs small N, per seed).

Ablations (same N, at the last step): what the KL alone does (single RM with and without it), what each
ensemble alone does (without KL, against the single RM), and each ensemble given the KL (against the single RM
with the KL): claim 2 changes two things at once; these say which one carries it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain import metrics as M  # noqa: E402

KL = 0.05  # the "small KL" (rl.kl_coef, k3 estimator)
# (baseline arm, arm, what differs): the arm's held-out gold at the last step minus the baseline's
CLAIM2 = (("rm_large", "wco_large_kl"), ("rm_large", "uwo_large_kl"))
ABLATIONS = (("rm_large", "rm_large_kl", f"KL {KL} alone (single RM)"),
             ("rm_large", "wco_large", "WCO ensemble alone (no KL)"),
             ("rm_large", "uwo_large", "UWO ensemble alone (no KL)"),
             ("rm_large_kl", "wco_large_kl", f"WCO ensemble given KL {KL}"),
             ("rm_large_kl", "uwo_large_kl", f"UWO ensemble given KL {KL}"))


def heldout_mean(rec: dict[str, Any], step: str, key: str) -> float:
    """One run's mean held-out ``key`` over problems at saved ``step``."""
    return float(np.mean([v[key] for v in rec["heldout"][step].values()]))


def seed_mean(recs: list[dict[str, Any]], step: str, key: str) -> dict[str, float]:
    """problem id -> mean over seeds of ``key`` at saved ``step``."""
    ids = set.intersection(*(set(r["heldout"][step]) for r in recs))
    return {i: float(np.mean([r["heldout"][step][i][key] for r in recs])) for i in sorted(ids)}


def paired(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """b - a over shared problems: mean and 95% paired-bootstrap interval."""
    ids = [i for i in a if i in b and a[i] is not None and b[i] is not None]
    lo, hi = M.paired_bootstrap_ci([a[i] for i in ids], [b[i] for i in ids], 2000, 0)
    return {"diff": float(np.mean([b[i] - a[i] for i in ids])), "lo": lo, "hi": hi, "n": len(ids)}


def sign(d: dict[str, float], want: str) -> str:
    pos, neg = d["lo"] > 0, d["hi"] < 0
    return ("holds" if (pos if want == ">" else neg) else "does not hold" if (neg if want == ">" else pos)
            else "inconclusive")


def analyse(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, Any]:
    """The three claims (module docstring) on held-out ``key`` (greedy or pass@1)."""
    out: dict[str, Any] = {}
    steps = {arm: sorted(recs[0]["heldout"], key=int) for arm, recs in runs.items()}
    curve = {arm: [float(np.mean(list(seed_mean(recs, s, key).values()))) for s in steps[arm]]
             for arm, recs in runs.items()}
    out["heldout_curve"] = {arm: dict(zip(steps[arm], c, strict=True)) for arm, c in curve.items()}
    # the intervals are over problems (of seed means); how far the seeds themselves spread is this:
    out["last_per_seed"] = {arm: [round(heldout_mean(r, steps[arm][-1], key), 4) for r in recs]
                            for arm, recs in runs.items()}
    if "rm_small" in runs:
        recs, st = runs["rm_small"], steps["rm_small"]
        peak = st[int(np.argmax(curve["rm_small"]))]
        g = paired(seed_mean(recs, peak, key), seed_mean(recs, st[-1], key))
        proxy = [np.asarray(r["proxy"], dtype=float) for r in recs]
        lo, hi = max(0, int(peak) - 5), max(int(peak), 5)  # the 5 steps before the peak (the first 5 at step 0)
        p_peak = [float(np.nanmean(p[lo:hi])) for p in proxy]
        p_last = [float(np.nanmean(p[-5:])) for p in proxy]
        out["claim_peak"] = {"peak_step": int(peak), "gold_last_minus_peak": g,
                             "proxy_peak": p_peak, "proxy_last": p_last,
                             "proxy_rose_every_seed": all(b > a for a, b in zip(p_peak, p_last, strict=True)),
                             "verdict": ("holds" if g["hi"] < 0 and all(b > a for a, b in zip(p_peak, p_last,
                                                                                                strict=True))
                                         else "does not hold" if g["lo"] >= 0 else "inconclusive")}
    for base, arm, *_ in (*CLAIM2, *ABLATIONS):
        if arm in runs and base in runs:
            last = steps[arm][-1]
            d = paired(seed_mean(runs[base], last, key), seed_mean(runs[arm], last, key))
            out[f"{'claim' if (base, arm) in CLAIM2 else 'ablation'}_{arm}_vs_{base}"] = {**d, "verdict": sign(d, ">")}
    if "rm_small" in runs and "rm_large" in runs:
        def held_peaks(recs: list[dict[str, Any]]) -> list[int]:  # the saved step of the best held-out gold
            st = sorted(recs[0]["heldout"], key=int)
            return [int(st[int(np.argmax([heldout_mean(r, s, key) for s in st]))]) for r in recs]

        def step_peaks(recs: list[dict[str, Any]]) -> list[int]:  # the step of the best 5-step mean train gold
            return [int(np.nanargmax(np.convolve(np.asarray(r["train_gold"], dtype=float), np.ones(5) / 5,
                                                 mode="valid"))) + 5 for r in recs]

        small, large = step_peaks(runs["rm_small"]), step_peaks(runs["rm_large"])
        pairs = list(zip(small, large, strict=False))  # seed by seed
        out["claim_more_data_later_peak"] = {
            "peak_small": small, "peak_large": large, "later_in_seeds": sum(b > a for a, b in pairs),
            "heldout_peak_small": held_peaks(runs["rm_small"]), "heldout_peak_large": held_peaks(runs["rm_large"]),
            "verdict": "holds" if all(b > a for a, b in pairs) else "does not hold" if all(b < a for a, b in pairs)
            else "inconclusive"}  # a tie in any seed: inconclusive
    return out


PAPER = ("Scaling Laws for Reward Model Overoptimization (Gao et al. 2023); Reward Model Ensembles Help Mitigate "
         "Overoptimization (Coste et al. 2024) (verifier = gold, Bradley-Terry proxy RMs on N rollout pairs, "
         "our tiny policy)")


def table_rows(res: dict[str, Any], seeds: dict[str, int]) -> list[str]:
    """The claims as rows of experiments/REPRODUCTIONS.md: (pass@1 and greedy, first - second, points)."""
    def cell(d: dict[str, float]) -> str:
        return f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"

    p1, gr, rows = res["pass@1"], res["greedy"], []
    if "claim_peak" in p1:
        c, g = p1["claim_peak"], gr["claim_peak"]
        rows.append(f"| {PAPER} | proxy rises while gold peaks and falls: held-out gold at the last step - at its "
                    f"peak (step {c['peak_step']}), single RM, N small, no KL, {seeds['rm_small']} seeds; proxy "
                    f"{np.mean(c['proxy_peak']):.2f} -> {np.mean(c['proxy_last']):.2f} | "
                    f"{cell(c['gold_last_minus_peak'])} | greedy (peak at step {g['peak_step']}): "
                    f"{cell(g['gold_last_minus_peak'])} | "
                    f"{c['verdict']} |")
    for base, ens in CLAIM2:
        key = f"claim_{ens}_vs_{base}"
        if key in p1:
            rows.append(f"| {PAPER} | {ens.split('_')[0].upper()} ensemble + KL {KL} keeps gold higher at the end "
                        f"than a single RM (N large, {seeds[ens]} vs {seeds[base]} seeds) | {cell(p1[key])} | "
                        f"greedy: {cell(gr[key])} | {p1[key]['verdict']} |")
    for base, arm, what in ABLATIONS:
        key = f"ablation_{arm}_vs_{base}"
        if key in p1:
            rows.append(f"| {PAPER} | ablation: {what} raises held-out gold at the end ({arm} - {base}, N large, "
                        f"{seeds[arm]} vs {seeds[base]} seeds) | {cell(p1[key])} | greedy: {cell(gr[key])} | "
                        f"{p1[key]['verdict']} |")
    if "claim_more_data_later_peak" in p1:
        c = p1["claim_more_data_later_peak"]
        rows.append(f"| {PAPER} | more preference data delays the gold peak (single RM, no KL; the step of the "
                    "best 5-step mean gold on the step's own samples, per seed; held-out gold, measured every 30 "
                    f"steps, peaks at {c['heldout_peak_small']} vs {c['heldout_peak_large']}) | N small "
                    f"{c['peak_small']} vs N large {c['peak_large']} | - | {c['verdict']} |")
    return rows


def upsert_rows(path: Path, rows: list[str]) -> None:
    """Replace this experiment's rows of the Reproductions table (those naming ``PAPER``) with ``rows``."""
    lines = [ln for ln in path.read_text().splitlines() if PAPER not in ln]
    end = max(i for i, ln in enumerate(lines) if ln.startswith("|")) + 1
    path.write_text("\n".join([*lines[:end], *rows, *lines[end:]]) + "\n")


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Proxy and gold (train samples; held-out pass@1 and greedy at saved steps) against RL steps, per arm (seed
    mean, band min..max over seeds; dashed: the arms with the KL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    for n, (arm, recs) in enumerate(runs.items()):
        c, ls = f"C{n}", "--" if arm.endswith("_kl") else "-"
        for ax, key in ((axes[0], "proxy"), (axes[1], "train_gold")):
            y = np.array([r[key] for r in recs], dtype=float)  # [seeds, steps]
            k = 5  # moving mean over 5 steps (one step is 128 samples)
            sm = np.array([np.convolve(row, np.ones(k) / k, mode="valid") for row in y])
            x = np.arange(k, y.shape[1] + 1)
            ax.plot(x, sm.mean(0), color=c, ls=ls, label=f"{arm} ({len(recs)})")
            ax.fill_between(x, sm.min(0), sm.max(0), color=c, alpha=0.12)
        st = sorted(recs[0]["heldout"], key=int)
        for ax, key in ((axes[2], "pass@1"), (axes[3], "greedy")):
            g = np.array([[heldout_mean(r, s, key) for s in st] for r in recs])
            ax.plot([int(s) for s in st], g.mean(0), marker="o", color=c, ls=ls, label=arm)
            ax.fill_between([int(s) for s in st], g.min(0), g.max(0), color=c, alpha=0.12)
    for ax, t in zip(axes, ("proxy reward (rl log, 5-step mean)", "gold on the step's samples (verifier)",
                            "gold held out: pass@1 (4 samples, eval split)", "gold held out: greedy (eval split)"),
                     strict=True):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("rl step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, title="arm (seeds)", title_fontsize=7)
    fig.suptitle("reward over-optimisation: seed mean, band = min..max over seeds; dashed = KL "
                 f"{KL}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
