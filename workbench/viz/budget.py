"""Plot of the privacy budget: ε against epochs, one curve per accountant (RDP, PLD, ...).

Draws a :class:`workbench.accounting.BudgetResult` (from ``accounting.explore_budget``), each
of its ``curves`` with the style and legend its accountant registered. The gap
between the two curves is the looseness of RDP's conversion to (ε, δ) (Balle et al. 2020,
arXiv:1905.09982, Thm. 21) against the near-exact PLD (Koskela et al. 2020, arXiv:1906.03049).
The PLD curve is labelled an upper bound: the explorer computes it on a coarse grid, capped by
RDP (``accounting.explore``), so at tiny batch sizes it can sit above the fine-grid PLD.
When the result carries a shuffle bracket, the band between its lower bound (Chua et al. 2024,
arXiv:2403.17673) and the no-amplification upper bound is where the ε of the same run with
shuffled fixed-size batches lies; a lower edge above the Poisson curves means Poisson
accounting understates a shuffled run.

The y-axis: without the bracket it is linear, from 0 to just above the curves. With it, it is
*logarithmic*: the shuffled run's ε is often 10-100 times the Poisson ε, and on a linear axis
the band (up to its no-amplification top) flattened the Poisson curves against the bottom;
on a log axis the whole band and both Poisson curves stay readable, and the band is the
widget's main lesson, so it stays on by default rather than being hidden. The x-axis runs a
little past the last epoch so that its markers are not cut in half, and the legend sits
below the axes, never over the curves.

Notation: q sample rate, σ noise multiplier, E epochs, T steps, δ target delta.
"""

from math import inf

import numpy as np


def plot_budget(ax, result):
    """Draw ε(δ) vs epochs on ``ax``; returns a dict of the artists drawn.

    Keys: each accountant's name, "rdp", "pld", ... (Line2D), "target" (the target ε line in
    solve mode, else None),
    "shuffle_band" (PolyCollection) and "shuffle_lower" (Line2D) when the result has a shuffle
    bracket, else None, and "legend". Does not clear ``ax`` or create a figure.
    """
    r = result
    artists = {}
    unstyled = (f"C{k}" for k in range(3, 10))  # C0, C1: RDP, PLD; C2: the shuffle bracket
    for name, c in r.curves.items():
        style = c.style or {"color": next(unstyled, "k"), "linestyle": "--"}
        artists[name] = ax.plot(c.epochs, c.epsilon, label=c.legend, **style)[0]
    artists.update(target=None, shuffle_band=None, shuffle_lower=None)
    if r.shuffle_epochs.size:
        x, lo, hi = r.shuffle_epochs, r.shuffle_lower, r.shuffle_upper
        artists["shuffle_band"] = ax.fill_between(
            x, lo, hi, color="C2", alpha=0.15, linewidth=0,
            label=f"shuffled: ε in band (top {hi[-1]:.3g}: no amplification)")
        if x.size == 1:  # one epoch: a band of one point is invisible; draw it as a bracket
            ax.vlines(x, lo, hi, color="C2", alpha=0.35, linewidth=6)
        artists["shuffle_lower"] = ax.plot(
            x, lo, color="C2", marker="s", markersize=3,
            label="shuffled: lower bound (Chua et al. 2024)")[0]
    if r.mode == "solve":
        artists["target"] = ax.axhline(r.target_epsilon, color="k", linestyle="--",
                                       linewidth=1, label=f"target ε = {r.target_epsilon:g}")
    ax.set_xlabel("epochs")
    ax.set_ylabel(f"ε  (δ = {r.delta:.0e})")
    ax.set_xlim(0, 1.04 * r.epochs)  # room for the last epoch's markers
    values = [v for c in r.curves.values() for v in c.epsilon]
    target = r.target_epsilon if r.mode == "solve" else 0  # drawn in solve mode only
    finite = [v for v in (*values, *r.shuffle_lower, target or 0) if v < inf]
    if artists["shuffle_band"] is None:
        ax.set_ylim(0, 1.1 * max(finite, default=1) or 1)  # room above the target line
    else:  # log: the band (often 10-100x the Poisson ε) and the curves both readable
        upper = np.asarray(r.shuffle_upper, dtype=float)
        tops = [*finite, *upper[np.isfinite(upper)]]
        positive = [v for v in (*values, *r.shuffle_lower) if 0 < v < inf]
        ax.set_yscale("log")
        ax.set_ylim(min(positive, default=1e-3) / 1.5, 1.5 * max(tops, default=1))
    ax.grid(True, alpha=0.3)
    # fewer tick labels: readable, and each one costs a redraw (a log axis keeps its own)
    ax.locator_params(axis="x" if ax.get_yscale() == "log" else "both", nbins=5)
    ax.set_title(
        f"N={r.dataset_size}, B={r.batch_size} (q={r.sample_rate:.3g}), "
        f"σ={r.noise_multiplier:.3f}, T={r.steps}: ε = "
        + ", ".join(f"{c.final:.3g} ({c.label})" for c in r.curves.values()),
        fontsize="small",
    )
    artists["legend"] = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
                                  fontsize="small", frameon=False)  # below: never on a curve
    return artists


__all__ = ["plot_budget"]
