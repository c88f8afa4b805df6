"""Plot of the update's signal-to-noise ratio against the batch size, at a fixed budget.

Draws a :class:`workbench.accounting.snr.SNRResult` (from ``accounting.snr.explore_snr``): the
SNR ||m̃|| B / (σ(B) C √d), and the noise multiplier σ(B) that the budget (ε, δ, E) allows, as
two lines on one log-log axes (both are pure numbers; one axes draws faster than a twin pair).
Lee et al. (2022, arXiv:2109.12191, §3.2, Fig. 3) plot the measured gradient SNR against the
batch size in the same spirit.

Notation: B batch size, q = B / N, σ noise multiplier, C clip norm, d parameters, m̃ mean
clipped gradient.
"""

import numpy as np

from workbench.viz.clipping import plain_log_ticks


def plot_snr(ax, result):
    """Draw SNR(B) and σ(B) on ``ax`` (log-log); returns a dict of the artists drawn.

    Keys: "snr", "sigma" (Line2D), "unit" (the SNR = 1 line: noise as large as the signal),
    "legend". Does not clear ``ax`` or create a figure. With signal = 0 the y axis is linear.
    """
    r = result
    artists = {
        "snr": ax.plot(r.batch_sizes, r.snr, color="C0", marker="o", markersize=3,
                       label="SNR = ||m̃|| B / (σ C √d)")[0],
        "sigma": ax.plot(r.batch_sizes, r.noise_multipliers, color="C3", marker="s",
                         markersize=3, label="σ(B) that spends the budget")[0],
        "unit": ax.axhline(1.0, color="k", linestyle=":", linewidth=1),
    }
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    if (r.snr > 0).all():  # signal = 0 gives SNR = 0, which a log axis cannot show
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    values = np.concatenate([r.snr, r.noise_multipliers, [1.0]])
    ax.set_ylim(values.min() / 1.5 if ax.get_yscale() == "log" else 0, values.max() * 1.5)
    ax.set_xlabel(f"batch size B  (N = {r.dataset_size}, q = B / N)")
    ax.set_ylabel("SNR and σ")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"ε = {r.epsilon:.3g}, δ = {r.delta:.0e}, E = {r.epochs:g}, C = "
                 f"{r.max_grad_norm:.3g}, d = {r.num_params}, ||m̃|| = {r.signal:.3g}",
                 fontsize="small")
    artists["legend"] = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
                                  fontsize="small", frameon=False)  # below: never on a curve
    return artists


__all__ = ["plot_snr"]
