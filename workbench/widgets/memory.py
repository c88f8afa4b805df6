"""Memory explorer: layer, width (so L/C) and batch size -> predicted vs measured overhead.

Glue only: ``bench.memory`` measures (``measure_layer``), ``bench.memory_explore`` computes
the model beside the measurements (``explore_memory``), ``viz.memory.plot_memory`` draws.
The source is either a live measurement on this machine's device (each (layer, width, b)
is measured once, when first shown, and kept) or a CSV shipped in ``data/bench/``
(e.g. GPU results), named in the plot's title. A live measurement runs one step per mode under
the profiler, so it is kept small: the einsum mode is skipped when its per-sample gradients
alone would exceed ``max_live_MB``, and a batch whose inputs, labels and outputs (bC)
exceed ``max_live_batch_MB`` is not measured at all (the benchmark measures those:
``python -m workbench.bench memory``).
While a live measurement runs (seconds for a big layer) the controls are disabled and the
previous plot is shown greyed with "measuring ...", so a new slider value never sits silently
over an old plot.

>>> from workbench.widgets.memory import MemoryExplorer
>>> w = MemoryExplorer("linear", width=64, batch_size=16)
>>> w.result.L_over_C, round(w.result.predicted("einsum"), 2)
(21.666666666666668, 6.48)
>>> w.controls["batch_size"].value = 64
>>> round(w.result.predicted("einsum"), 2), sorted(w.result.measured["batch_size"])
(13.72, [16, 64])
"""

import ipywidgets as widgets
import pandas as pd
import torch
from matplotlib.figure import Figure

from workbench.bench.layer_specs import LAYERS, check_layer
from workbench.bench.memory import BATCH_SIZES, MODES, measure_layer
from workbench.bench.memory_explore import (
    explore_memory,
    layer_constants,
    load,
    shipped_results,
)
from workbench.viz.memory import plot_memory
from workbench.widgets.base import Explorer


def _widths(layer, also=()):
    return sorted({*LAYERS[layer].widths, LAYERS[layer].width, *also})


def _controls(layer, width, b, sources, source):
    style = {"description_width": "80px"}
    return {
        "layer": widgets.Dropdown(options=list(LAYERS), value=layer, description="layer",
                                  style=style),
        "width": widgets.SelectionSlider(options=_widths(layer, [width]), value=width,
                                         description="width", style=style),
        "batch_size": widgets.SelectionSlider(options=sorted({*BATCH_SIZES, b}), value=b,
                                              description="batch size", style=style),
        "source": widgets.ToggleButtons(options=sources, value=source, description="source",
                                        style={**style, "button_width": "auto"}),
    }


class MemoryExplorer(Explorer):
    """Overhead vs batch size for one layer; ``.controls``, ``.result``, ``.figure``."""

    def __init__(self, layer="linear", width=None, batch_size=64, source=None, device=None,
                 max_live_MB=2048, max_live_batch_MB=16):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.live_label = f"live ({self.device.type})"
        self.shipped = shipped_results()
        sources = [self.live_label, *self.shipped]
        check_layer(layer, width)
        width = LAYERS[layer].width if width is None else width
        self.max_live_MB, self.max_live_batch_MB = max_live_MB, max_live_batch_MB
        self.live = pd.DataFrame()
        self.controls = _controls(layer, width, batch_size, sources, source or sources[0])
        self.controls["layer"].observe(self._layer_changed, names="value")
        self.figure = Figure(figsize=(7, 4), dpi=80)
        self.figure.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.92)
        self.ax = self.figure.add_subplot()
        self.result, self.artists, self._quiet = None, {}, False
        self._wire()

    def _layer_changed(self, change):
        """A new layer brings its own widths; one redraw, at its default width."""
        self._quiet = True
        try:
            self.controls["width"].options = _widths(change["new"])
            self.controls["width"].value = LAYERS[change["new"]].width
        finally:
            self._quiet = False

    def _measured_live(self, layer, width, b) -> bool:
        return not self.live.empty and bool(((self.live["layer"] == layer)
                & (self.live["width"] == width) & (self.live["batch_size"] == b)).any())

    @staticmethod
    def _batch_MB(layer, width, b) -> float:
        return b * layer_constants(layer, width)["C_bytes"] / 2**20  # bC

    def _show_busy(self, layer, width, b) -> None:
        """Grey the previous plot, say what is being measured, and lock the controls."""
        self.message.value = (f"<b>measuring {layer} (width {width}) at b = {b} on "
                              f"{self.device.type} ...</b><br><i>the plot shows the previous "
                              f"values until it is done</i>")
        for artist in [*self.ax.lines, *self.ax.texts]:
            artist.set_alpha(0.25)
        self.ax.text(0.5, 0.5, f"measuring b = {b} ...", transform=self.ax.transAxes,
                     ha="center", va="center", fontsize="large", color="0.2")
        for control in self.controls.values():
            control.disabled = True
        self._show_png()

    def _measurements(self, layer, width, b, source):
        """(table of measurements, a note on what was not measured)."""
        if source != self.live_label:
            return load(self.shipped[source]), ""
        bC = self._batch_MB(layer, width, b)
        if bC > self.max_live_batch_MB:
            return self.live, (f"<br><i>b = {b} is not measured live: the batch (bC = {bC:.3g}"
                               f" MB) is above this widget's live limit of "
                               f"{self.max_live_batch_MB:g} MB. Choose a shipped source, or "
                               f"run python -m workbench.bench memory</i>")
        if self._measured_live(layer, width, b):
            return self.live, ""
        self._show_busy(layer, width, b)
        try:
            row = measure_layer(layer, b, width, MODES, self.device,
                                max_GB=self.max_live_MB / 1024)
        finally:
            for control in self.controls.values():
                control.disabled = False
        self.live = pd.concat([self.live, pd.DataFrame([row])], ignore_index=True)
        return self.live, ("" if "einsum_MB" in row else
                           f"<br><i>einsum is not measured live: its per-sample gradients "
                           f"would take more than this widget's live limit of "
                           f"{self.max_live_MB:g} MB</i>")

    def update(self):
        """Measure if needed, recompute and redraw; bad values are shown, not raised."""
        if self._quiet:
            return
        v = {name: c.value for name, c in self.controls.items()}
        try:
            table, note = self._measurements(v["layer"], v["width"], v["batch_size"],
                                             v["source"])
            self.result = explore_memory(v["layer"], v["width"], v["batch_size"], table,
                                         v["source"])
        except (ValueError, FileNotFoundError) as err:
            self._show_error(err)
            return
        r, at = self.result, self.result.at_b

        def measured(mode):
            value = None if at is None else at.get(f"{mode}_x")
            return "not measured" if value is None or pd.isna(value) else f"{value:.3g}x"

        self.message.value = (
            f"L = {r.L_bytes / 2**20:.3g} MB, C = {r.C_bytes / 1024:.3g} KB/sample, "
            f"L/C = {r.L_over_C:.3g}, b = {r.batch_size}<br>"
            f"einsum: model {r.predicted('einsum'):.3g}x, measured {measured('einsum')}<br>"
            f"ghost: model {r.predicted('ghost'):.3g}x, measured {measured('ghost')}<br>"
            f"book-keeping: measured {measured('bookkeeping')}{note}")
        self.ax.clear()
        self.artists = plot_memory(self.ax, r)
        self._show_png()


__all__ = ["MemoryExplorer"]
