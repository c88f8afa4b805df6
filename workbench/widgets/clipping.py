"""Clipping explorer: a C slider and a layer menu -> per-sample norms, fraction clipped, bias.

Glue only: ``clipping.snapshot`` computes (the per-sample gradients once, at construction;
a slider move only reads the snapshot's tables), ``viz.clipping`` draws. The per-layer box plot
does not depend on C, so it is drawn once and only its C line moves (redrawing it too costs
about 20 ms an update).

>>> import torch
>>> from torch import nn
>>> import workbench as wb
>>> from workbench.widgets.clipping import ClippingExplorer
>>> train, _ = wb.data.load_digits()
>>> x, y = train.tensors
>>> _ = torch.manual_seed(0)
>>> w = ClippingExplorer(wb.models.digits_mlp(), nn.CrossEntropyLoss(reduction="none"),
...                      x[:256], y[:256], max_grad_norm=1.0)
>>> w.result.fraction_clipped
1.0
>>> w.controls["max_grad_norm"].value = 100.0
>>> w.result.fraction_clipped, round(w.result.cosine, 9)
(0.0, 1.0)
"""

import math

import ipywidgets as widgets
from matplotlib.figure import Figure

from workbench.checks import check_max_grad_norm
from workbench.clipping.snapshot import clip_at, per_sample_snapshot
from workbench.viz.clipping import ALL, plot_layer_norms, plot_norms
from workbench.widgets.base import Explorer


def _controls(C, layers, norms):
    positive = norms[norms > 0]
    lo = math.floor(math.log10(min(positive.min(), C) if positive.size else C)) - 1
    hi = math.ceil(math.log10(max(positive.max(), C) if positive.size else C)) + 1
    style = {"description_width": "60px"}
    return {
        "max_grad_norm": widgets.FloatLogSlider(C, base=10, min=lo, max=hi, step=0.05,
                                                description="C", readout_format=".3g",
                                                style=style),
        "layer": widgets.Dropdown(options=[ALL, *layers], value=ALL, description="layer",
                                  style=style),
    }


class ClippingExplorer(Explorer):
    """Per-sample norms clipped at C; ``.controls``, ``.result``, ``.figure``, ``.widget``."""

    def __init__(self, model, loss_fn, inputs, targets, max_grad_norm=1.0):
        C = check_max_grad_norm(max_grad_norm)
        self.snapshot = per_sample_snapshot(model, loss_fn, inputs, targets)  # the one backward
        self.controls = _controls(C, self.snapshot.layers, self.snapshot.norms)
        self.figure = Figure(figsize=(8, 3.6), dpi=80)
        self.figure.subplots_adjust(left=0.08, right=0.98, bottom=0.2, top=0.9, wspace=0.3)
        self.ax, self.layer_ax = self.figure.subplots(1, 2, width_ratios=(3, 1))
        self.result, self.artists = None, {}
        self.layer_artists = plot_layer_norms(self.layer_ax, clip_at(self.snapshot, C))  # once:
        positive = self.snapshot.layer_norms[self.snapshot.layer_norms > 0]  # only C moves there
        self.layer_span = (positive.min(), positive.max()) if positive.size else (C, C)
        self._wire()

    def update(self):
        """Re-clip the stored gradients at C and redraw; bad values are shown, not raised."""
        layer = self.controls["layer"].value
        try:
            self.result = clip_at(self.snapshot, self.controls["max_grad_norm"].value)
        except (TypeError, ValueError) as err:
            self._show_error(err)
            return
        r = self.result
        self.message.value = (f"n = {r.num_samples}, d = {r.num_params}<br>"
                              f"clipped: {r.fraction_clipped:.1%}<br>"
                              f"cos(m̃, m) = {r.cosine:.4f}<br>"
                              f"||m|| = {r.mean_norm:.3g}, ||m̃|| = {r.clipped_mean_norm:.3g}")
        self.ax.clear()
        self.artists = plot_norms(self.ax, r, layer=layer)
        C, (lo, hi) = r.max_grad_norm, self.layer_span
        self.layer_artists["clip"].set_ydata([C, C])
        self.layer_ax.set_ylim(min(lo, C) / 1.5, max(hi, C) * 1.5)
        self._show_png()


__all__ = ["ClippingExplorer"]
