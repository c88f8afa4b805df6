"""Plot of the privacy budget: ε against epochs, RDP and PLD side by side.

Draws a :class:`workbench.accounting.BudgetResult` (from ``accounting.explore_budget``). The gap
between the two curves is the looseness of RDP's conversion to (ε, δ) (Balle et al. 2020,
arXiv:1905.09982, Thm. 21) against the near-exact PLD (Koskela et al. 2020, arXiv:1906.03049).
The PLD curve is labelled an upper bound: the explorer computes it on a coarse grid, capped by
RDP (``accounting.explore``), so at tiny batch sizes it can sit above the fine-grid PLD.

Notation: q sample rate, σ noise multiplier, E epochs, T steps, δ target delta.
"""

from math import inf


def plot_budget(ax, result):
    """Draw ε(δ) vs epochs on ``ax``; returns a dict of the artists drawn.

    Keys: "rdp" and "pld" (Line2D), "target" (the target ε line in solve mode, else None),
    "legend". Does not clear ``ax`` or create a figure; the caller owns both.
    """
    r = result
    artists = {
        "rdp": ax.plot(r.rdp_epochs, r.rdp_epsilon, color="C0", label="RDP")[0],
        "pld": ax.plot(r.pld_epochs, r.pld_epsilon, color="C1", marker="o", markersize=3,
                       label=f"PLD upper bound (grid {r.discretization:.1g}, capped by RDP)")[0],
        "target": None,
    }
    if r.mode == "solve":
        artists["target"] = ax.axhline(r.target_epsilon, color="k", linestyle="--",
                                       linewidth=1, label=f"target ε = {r.target_epsilon:g}")
    ax.set_xlabel("epochs")
    ax.set_ylabel(f"ε  (δ = {r.delta:.0e})")
    ax.set_xlim(0, r.epochs)
    finite = [v for v in (*r.rdp_epsilon, *r.pld_epsilon, r.target_epsilon or 0) if v < inf]
    ax.set_ylim(0, 1.1 * max(finite, default=1) or 1)  # room above the target line
    ax.grid(True, alpha=0.3)
    ax.locator_params(nbins=5)  # fewer tick labels: readable, and each one costs a redraw
    ax.set_title(
        f"N={r.dataset_size}, B={r.batch_size} (q={r.sample_rate:.3g}), "
        f"σ={r.noise_multiplier:.3f}, T={r.steps}: "
        f"ε = {r.epsilon_rdp:.3g} (RDP), {r.epsilon_pld:.3g} (PLD)",
        fontsize="small",
    )
    artists["legend"] = ax.legend(loc="upper left")
    return artists
