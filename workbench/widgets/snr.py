"""SNR explorer: sliders for ε, δ, epochs, N, C and the signal -> SNR and σ against batch size.

Glue only: ``accounting.snr.explore_snr`` computes (σ(B) cached, so C and signal moves never
call the accountant), ``viz.snr.plot_snr`` draws. Given a model and a batch, the signal ||m̃||
is measured at the slider's C from one per-sample gradient snapshot (``clipping.snapshot``);
"manual" uses the signal slider instead; in "measured" mode the slider is disabled and shows
the measured value in use. The measured ||m̃|| is the norm of this batch's mean:
with n samples it over-estimates the population's by about the samples' spread / √n.

>>> from workbench.widgets.snr import SNRExplorer
>>> w = SNRExplorer(num_params=10_000, signal=0.1, epsilon=1.0, epochs=10,
...                 batch_sizes=[64, 256, 1024])
>>> w.result.snr.round(2).tolist()
[0.07, 0.22, 0.54]
>>> w.controls["signal"].value = 0.2
>>> w.result.snr.round(2).tolist()
[0.14, 0.44, 1.08]
"""


import ipywidgets as widgets
from matplotlib.figure import Figure

from workbench.accounting.snr import explore_snr
from workbench.clipping.snapshot import clip_at, per_sample_snapshot
from workbench.viz.snr import plot_snr
from workbench.widgets.base import Explorer


def _controls(eps, delta, epochs, n, C, signal, sources):
    style = {"description_width": "110px"}

    def log_slider(value, lo, hi, description, fmt=".3g", step=0.05, continuous=True):
        return widgets.FloatLogSlider(value, base=10, min=lo, max=hi, step=step,
                                      description=description, readout_format=fmt, style=style,
                                      continuous_update=continuous)

    return {  # the accountant's sliders update on release: a new σ(B) costs ~5 ms per B
        "epsilon": log_slider(eps, -2, 2, "ε", continuous=False),
        "delta": log_slider(delta, -10, -2, "δ", fmt=".0e", step=0.5, continuous=False),
        "epochs": widgets.FloatSlider(epochs, min=1, max=200, step=1, description="epochs",
                                      style=style, continuous_update=False),
        "dataset_size": widgets.BoundedIntText(n, min=1, max=10**9, description="dataset size N",
                                               style=style),
        "max_grad_norm": log_slider(C, -3, 2, "clip norm C"),
        "signal_source": widgets.ToggleButtons(options=sources, value=sources[0],
                                               description="signal", style=style),
        "signal": log_slider(signal, -4, 2, "signal ||m̃||"),
    }


class SNRExplorer(Explorer):
    """SNR and σ against batch size; ``.controls``, ``.result``, ``.figure``, ``.widget``."""

    def __init__(self, model=None, loss_fn=None, inputs=None, targets=None, *, epsilon=3.0,
                 delta=1e-5, epochs=10, dataset_size=60_000, max_grad_norm=1.0, signal=None,
                 num_params=None, batch_sizes=None):
        self.snapshot = None if model is None else per_sample_snapshot(model, loss_fn, inputs,
                                                                       targets)
        if self.snapshot is None:
            sources, signal = ("manual",), 0.1 if signal is None else signal
            self.num_params = 26_010 if num_params is None else num_params  # Opacus' MNIST CNN
        else:
            measured = clip_at(self.snapshot, max_grad_norm).clipped_mean_norm
            sources = ("measured", "manual") if signal is None else ("manual", "measured")
            signal = measured if signal is None else signal
            self.num_params = self.snapshot.num_params if num_params is None else num_params
        self.batch_sizes = batch_sizes
        self.controls = _controls(epsilon, delta, epochs, dataset_size, max_grad_norm, signal,
                                  sources)
        self.figure = Figure(figsize=(7, 4.8), dpi=80)
        self.figure.subplots_adjust(left=0.1, right=0.97, bottom=0.3, top=0.93)
        self.ax = self.figure.add_subplot()
        self.result, self.artists = None, {}
        self._wire()

    def _signal(self, v):
        """||m̃|| measured at the C of ``v`` (the snapshot's clip_at), or the slider's value."""
        if v["signal_source"] == "measured":
            return clip_at(self.snapshot, v["max_grad_norm"]).clipped_mean_norm
        return v["signal"]

    def update(self):
        """Recompute and redraw from the controls; bad values are shown, not raised."""
        v = {name: c.value for name, c in self.controls.items()}
        self.controls["signal"].disabled = v["signal_source"] == "measured"
        try:
            self.result = explore_snr(v["epsilon"], v["delta"], v["epochs"], v["dataset_size"],
                                      self.num_params, v["max_grad_norm"], self._signal(v),
                                      batch_sizes=self.batch_sizes)
        except (TypeError, ValueError) as err:
            self._show_error(err)
            return
        r = self.result
        if v["signal_source"] == "measured" and self._show_in_use("signal", r.signal):
            return  # the greyed slider now shows the measured signal; its update() drew it
        self.message.value = (
            f"d = {r.num_params}, signal ||m̃|| = {r.signal:.3g} ({v['signal_source']})<br>"
            f"B = {r.batch_sizes[0]}: σ = {r.noise_multipliers[0]:.3g}, SNR = {r.snr[0]:.3g}, "
            f"T = {r.steps[0]}<br>B = {r.batch_sizes[-1]}: σ = {r.noise_multipliers[-1]:.3g}, "
            f"SNR = {r.snr[-1]:.3g}, T = {r.steps[-1]}")
        self.ax.clear()
        self.artists = plot_snr(self.ax, r)
        self._show_png()


__all__ = ["SNRExplorer"]
