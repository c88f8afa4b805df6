"""Budget explorer: sliders for N, B, σ, epochs and δ -> ε vs epochs by each accountant.

Glue only: ``accounting.explore_budget`` computes, ``viz.budget.plot_budget`` draws. In "solve"
mode the σ slider is ignored and the σ that spends exactly the target ε is shown instead. The
"shuffle bracket" box adds the ε bracket of the same run with shuffled fixed-size batches.

>>> from workbench.widgets.budget import BudgetExplorer
>>> w = BudgetExplorer()
>>> w.controls["noise_multiplier"].value = 2.0
>>> w.result.noise_multiplier, round(w.result.epsilon_rdp, 2)
(2.0, 1.11)
"""


import ipywidgets as widgets
from matplotlib.figure import Figure

from workbench.accounting.explore import explore_budget
from workbench.viz.budget import plot_budget
from workbench.widgets.base import Explorer


def _controls(n, b, sigma, epochs, delta, mode, target, shuffle):
    style = {"description_width": "120px"}
    return {
        "dataset_size": widgets.BoundedIntText(n, min=1, max=10**9, description="dataset size N",
                                               style=style),
        "batch_size": widgets.BoundedIntText(b, min=1, max=10**9, description="batch size B",
                                             style=style),
        "noise_multiplier": widgets.FloatSlider(sigma, min=0.3, max=5.0, step=0.01,
                                                description="σ", readout_format=".3f",
                                                style=style),
        "epochs": widgets.FloatSlider(epochs, min=1, max=200, step=1, description="epochs",
                                      style=style),
        "delta": widgets.FloatLogSlider(delta, base=10, min=-10, max=-2, step=0.5,
                                        description="δ", readout_format=".0e", style=style),
        "mode": widgets.ToggleButtons(options=["epsilon", "solve"], value=mode,
                                      description="mode", style=style),
        "target_epsilon": widgets.FloatSlider(target, min=0.1, max=20, step=0.1,
                                              description="target ε (solve)", style=style),
        "shuffle": widgets.Checkbox(shuffle, description="shuffle bracket", style=style),
    }


class BudgetExplorer(Explorer):
    """ε(δ) vs epochs by each accountant, shuffle bracket; ``.controls``, ``.result``."""

    def __init__(self, dataset_size=60_000, batch_size=256, noise_multiplier=1.1, epochs=60,
                 delta=1e-5, mode="epsilon", target_epsilon=8.0, shuffle=True):
        self.controls = _controls(dataset_size, batch_size, noise_multiplier, epochs, delta,
                                  mode, target_epsilon, shuffle)
        self.figure = Figure(figsize=(7, 4.8), dpi=80)  # fixed margins: constrained layout
        self.figure.subplots_adjust(left=0.09, right=0.97, bottom=0.3, top=0.93)  # costs 70 ms
        self.ax = self.figure.add_subplot()
        self.result, self.artists = None, {}
        self._wire()

    def update(self):
        """Recompute and redraw from the controls; bad values are shown, not raised."""
        v = {name: c.value for name, c in self.controls.items()}
        self.controls["noise_multiplier"].disabled = v["mode"] == "solve"
        try:
            self.result = explore_budget(**v)
        except ValueError as err:
            self._show_error(err)
            return
        r = self.result
        if v["mode"] == "solve" and self._show_in_use("noise_multiplier", r.noise_multiplier):
            return  # the greyed σ slider now shows the σ in use; its update() drew it
        text = (f"q = {r.sample_rate:.4g}, T = {r.steps} steps<br>σ = {r.noise_multiplier:.3f}"
                "<br>ε = " + ", ".join(f"{c.final:.3f} ({c.label})" for c in r.curves.values()))
        if r.epsilon_shuffle is not None:
            lo, hi = r.epsilon_shuffle
            text += f"<br>shuffled, {r.shuffle_epochs[-1]} epochs: {lo:.3f} <= ε <= {hi:.3f}"
        self.message.value = text
        self.ax.clear()
        self.artists = plot_budget(self.ax, r)
        self._show_png()


__all__ = ["BudgetExplorer"]
