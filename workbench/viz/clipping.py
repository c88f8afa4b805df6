"""Plots of per-sample gradient norms and of what clipping at C does to them.

Draws a :class:`workbench.clipping.snapshot.ClippingResult` (from ``clip_at`` or
``clipping_snapshot``). DP-SGD clips every sample's gradient to norm at most C (Abadi et al.
2016, arXiv:1607.00133, Algorithm 1): the histogram shows how many samples lie beyond C, and
the text the bias this causes, cos(m̃, m) between the clipped and the unclipped mean gradient.

Notation: n batch size, g_i per-sample gradient, C max_grad_norm, m mean gradient, m̃ the
mean of the clipped gradients.
"""

import numpy as np
from matplotlib.ticker import FormatStrFormatter, Locator, MaxNLocator, NullLocator

ALL = "all"


class Log125Locator(Locator):
    """Log-axis ticks at 1, 2, 5 x 10^k inside the view; never fewer than ``min_ticks``.

    Too many (a view over many decades): decades only, then every few decades. Too few (a
    view inside one 1-2-5 gap, e.g. norms from 2.2 to 3.5): evenly spaced ticks at round
    values (2.4, 2.6, ...; matplotlib's ``MaxNLocator``), so a short range still gets labels.
    Labelled with plain numbers (0.2, 1, 2.5) by :func:`plain_log_ticks`: cheaper to lay out
    than matplotlib's default mathtext labels.
    """

    def __init__(self, max_ticks=7, min_ticks=3):
        self.max_ticks, self.min_ticks = max_ticks, min_ticks

    def __call__(self):
        lo, hi = sorted(self.axis.get_view_interval())
        if not (lo > 0 and np.isfinite(hi)):
            return []
        decades = 10.0 ** np.arange(np.floor(np.log10(lo)), np.ceil(np.log10(hi)) + 1)
        ticks = [t for t in np.outer(decades, (1, 2, 5)).ravel() if lo <= t <= hi]
        if len(ticks) < self.min_ticks:  # a short view: round values, evenly spaced
            even = MaxNLocator(self.min_ticks + 1, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
            return [t for t in even if lo <= t <= hi]
        if len(ticks) > self.max_ticks:
            ticks = [t for t in decades if lo <= t <= hi]
        if len(ticks) > self.max_ticks:
            ticks = ticks[:: -(-len(ticks) // self.max_ticks)]  # every few decades
        return ticks


def plain_log_ticks(axis):
    """Use :class:`Log125Locator` with plain labels and no minor ticks on a log ``axis``."""
    axis.set_major_locator(Log125Locator())
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_locator(NullLocator())  # no minor ticks: each tick is an artist to build


def _log_edges(values, C, bins):
    """``bins + 1`` log-spaced edges covering the positive ``values`` and C."""
    positive = values[values > 0]
    lo = min(positive.min(), C) if positive.size else C / 10
    hi = max(positive.max(), C) if positive.size else C * 10
    return np.geomspace(lo / 1.05, hi * 1.05, bins + 1)


def plot_norms(ax, result, layer=ALL, bins=30):
    """Histogram of per-sample norms (log x) with a line at C; returns a dict of artists.

    ``layer`` is ``"all"`` (the total norm ||g_i||, the one that is clipped) or one of
    ``result.layers`` (that layer's share ||g_{i,l}||; C still applies to the total).
    Keys: "hist" (StepPatch; ``get_data()`` gives counts and edges), "clip" (the C line),
    "text". Zero norms cannot sit on a log axis: they are counted in the text instead.
    """
    r, C = result, result.max_grad_norm
    if layer == ALL:
        values, label, cosine = r.norms, "||g_i||  (all parameters)", r.cosine
    else:
        i = r.layers.index(layer)  # ValueError names the unknown layer
        values, label, cosine = r.layer_norms[:, i], f"||g_i|| of {layer}", r.layer_cosine[i]
    edges = _log_edges(values, C, bins)
    counts, _ = np.histogram(values[values > 0], edges)  # (bins,)
    artists = {
        "hist": ax.stairs(counts, edges, fill=True, color="C0", alpha=0.6),
        "clip": ax.axvline(C, color="k", linestyle="--", linewidth=1.2),
    }
    zeros = int((values == 0).sum())
    text = [f"clipped at C = {C:.3g}: {r.fraction_clipped:.0%} of n = {r.num_samples}",
            f"cos(clipped mean, mean) = {cosine:.4f}"]
    if layer != ALL:
        share = (r.layer_norms[:, i] ** 2).sum() / max((r.norms**2).sum(), 1e-300)
        text[1] = f"{layer}: cos = {cosine:.4f}, {share:.0%} of Σ||g_i||²"
    if zeros:
        text.append(f"{zeros} zero norms not shown")
    artists["text"] = ax.text(0.02, 0.97, "\n".join(text), transform=ax.transAxes, va="top",
                              fontsize="small", bbox={"facecolor": "white", "alpha": 0.8,
                                                      "edgecolor": "none"})
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(0, 1.3 * max(counts.max(), 1))  # room for the text
    ax.yaxis.set_major_locator(MaxNLocator(4, integer=True))  # few ticks: each costs a redraw
    ax.set_xlabel(label)
    ax.set_ylabel("samples")
    return artists


def plot_layer_norms(ax, result):
    """Box plot of each layer's per-sample norms (log y) with a line at C; dict of artists.

    Keys: "boxes" (matplotlib's boxplot dict), "clip" (the C line). Flat clipping compares C
    with the total norm, which is at least every layer's norm (Eq. (3) of ``snapshot.py``).
    """
    r = result
    columns = [r.layer_norms[:, i][r.layer_norms[:, i] > 0] for i in range(len(r.layers))]
    artists = {
        "boxes": ax.boxplot(columns, showfliers=False),
        "clip": ax.axhline(r.max_grad_norm, color="k", linestyle="--", linewidth=1.2),
    }
    ax.set_xticks(range(1, len(r.layers) + 1), r.layers)
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set_ylabel("||g_i|| per layer")
    ax.tick_params(axis="x", labelrotation=45, labelsize="small")
    return artists


__all__ = ["ALL", "Log125Locator", "plain_log_ticks", "plot_layer_norms", "plot_norms"]
