"""The budget explorer widget: set controls from code, check the result and the figure."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from workbench.accounting import epsilon, explore_budget  # noqa: E402
from workbench.accounting.explore import COARSE_NOTE  # noqa: E402
from workbench.viz.budget import plot_budget  # noqa: E402
from workbench.widgets.budget import BudgetExplorer  # noqa: E402


@pytest.fixture
def explorer():  # a fresh widget per test: no test depends on what another one set
    return BudgetExplorer(dataset_size=60_000, batch_size=256, noise_multiplier=1.1, epochs=30)


def lines_match_result(w):
    r = w.result
    rdp, pld = w.artists["rdp"], w.artists["pld"]
    return (np.allclose(rdp.get_xdata(), r.rdp_epochs) and np.allclose(rdp.get_ydata(),
            r.rdp_epsilon) and np.allclose(pld.get_xdata(), r.pld_epochs)
            and np.allclose(pld.get_ydata(), r.pld_epsilon))


def test_initial_state(explorer):
    assert set(explorer.controls) == {"dataset_size", "batch_size", "noise_multiplier", "epochs",
                                      "delta", "mode", "target_epsilon", "shuffle"}
    assert explorer.result.sample_rate == 256 / 60_000 and explorer.result.epochs == 30
    assert lines_match_result(explorer)
    assert bytes(explorer.image.value).startswith(b"\x89PNG")


def test_more_noise_means_less_epsilon(explorer):
    before = explorer.result.epsilon_rdp
    explorer.controls["noise_multiplier"].value = 2.0
    assert explorer.result.noise_multiplier == 2.0
    assert explorer.result.epsilon_rdp < before and lines_match_result(explorer)


def test_batch_size_sets_the_sample_rate(explorer):
    explorer.controls["batch_size"].value = 600
    assert explorer.result.sample_rate == 0.01 and explorer.result.steps == 3000
    assert "q = 0.01" in explorer.message.value


def test_solve_mode_shows_the_sigma_for_the_target(explorer):
    explorer.controls["target_epsilon"].value = 4.0
    explorer.controls["mode"].value = "solve"
    r = explorer.result
    assert r.mode == "solve" and 3.9 <= r.epsilon_rdp <= 4.0
    assert explorer.controls["noise_multiplier"].disabled
    assert explorer.artists["target"].get_ydata()[0] == 4.0
    assert f"σ = {r.noise_multiplier:.3f}" in explorer.message.value
    explorer.controls["mode"].value = "epsilon"
    assert explorer.result.noise_multiplier == explorer.controls["noise_multiplier"].value


def test_shuffle_bracket_is_drawn_beside_poisson_and_can_be_switched_off(explorer):
    # the explorer's default run (N = 60,000, B = 256, σ = 1.1, 30 epochs) with shuffled batches
    # is provably far less private than its Poisson ε (Chua et al. 2024)
    r = explorer.result
    band, lower = explorer.artists["shuffle_band"], explorer.artists["shuffle_lower"]
    assert np.allclose(lower.get_xdata(), r.shuffle_epochs)
    assert np.allclose(lower.get_ydata(), r.shuffle_lower)
    vertices = band.get_paths()[0].vertices  # the band's outline: lower edge, then upper edge
    assert np.isclose(vertices[:, 1].max(), r.shuffle_upper[-1])
    assert np.all(r.shuffle_lower <= r.shuffle_upper)
    lo, hi = r.epsilon_shuffle
    assert lo > 3 * r.epsilon_pld  # measured: 7.9 vs 1.64 at 30 epochs
    assert f"{lo:.3f} <= ε <= {hi:.3f}" in explorer.message.value
    assert explorer.ax.get_ylim()[1] >= lo  # the lower edge is on the plot
    explorer.controls["shuffle"].value = False
    assert explorer.result.epsilon_shuffle is None and explorer.artists["shuffle_band"] is None
    assert "shuffled" not in explorer.message.value


def test_bad_values_show_a_message_and_keep_the_last_result(explorer):
    last = explorer.result
    explorer.controls["batch_size"].value = 10**8
    assert "batch_size must be an integer" in explorer.message.value
    assert explorer.result is last
    explorer.controls["batch_size"].value = 256
    assert explorer.result is not last


def test_plot_budget_draws_on_the_given_axes_only():
    figures_before = plt.get_fignums()
    fig, ax = plt.subplots()
    result = explore_budget(1000, 50, 1.0, 10, 1e-5, mode="solve", target_epsilon=2.0, points=5,
                            pld_points=3)
    artists = plot_budget(ax, result)
    assert set(artists) == {"rdp", "pld", "prv", "target", "shuffle_band", "shuffle_lower",
                            "legend"}
    assert list(artists["rdp"].get_ydata()) == list(result.rdp_epsilon)
    assert artists["target"].get_ydata()[0] == 2.0
    assert ax.get_legend() is artists["legend"]
    assert len(plt.get_fignums()) == len(figures_before) + 1  # only the one made here
    plt.close(fig)


@pytest.mark.parametrize("batch_size", [1, 4, 16, 64, 256, 1024, 8192, 60_000])
def test_pld_curve_is_a_labelled_bound_never_above_rdp(batch_size):
    # every batch size the widget allows at N = 60,000 (powers of 4 up to N): the explorer's PLD
    # is an upper bound (>= the fine-grid PLD), never above RDP, and within 1% of the fine grid
    # wherever its legend does not say the grid is coarse (at σ = 1.1: every B, B = 1 included;
    # tests/accounting/test_explore_pld.py checks against dp-accounting and the coarse cases)
    r = explore_budget(60_000, batch_size, 1.1, 60, 1e-5, points=8, pld_points=8)
    rdp_at_pld = np.interp(r.pld_epochs, r.rdp_epochs, r.rdp_epsilon)
    assert np.all(r.pld_epsilon <= rdp_at_pld + 1e-12)
    fine = epsilon(r.sample_rate, 1.1, r.steps, 1e-5, "pld")
    assert fine * (1 - 1e-9) <= r.epsilon_pld <= r.epsilon_rdp
    if COARSE_NOTE not in r.curves["pld"].legend:
        assert r.epsilon_pld <= 1.01 * fine
    fig, ax = plt.subplots()
    assert "upper bound" in plot_budget(ax, r)["pld"].get_label()
    plt.close(fig)


def test_the_greyed_sigma_slider_shows_the_sigma_in_use(explorer):
    explorer.controls["noise_multiplier"].value = 2.0
    explorer.controls["target_epsilon"].value = 4.0
    explorer.controls["mode"].value = "solve"
    slider, r = explorer.controls["noise_multiplier"], explorer.result
    assert slider.disabled and r.noise_multiplier != 2.0
    assert slider.value == r.noise_multiplier and slider.readout_format == ".3f"
    assert f"σ={r.noise_multiplier:.3f}" in explorer.ax.get_title()
    explorer.controls["target_epsilon"].value = 0.2  # a σ beyond the slider's range
    assert slider.value == explorer.result.noise_multiplier > 5.0 and slider.max >= slider.value


def _poisson_share(w):
    """Fraction of the y-axis (in its own scale) that the Poisson curves span."""
    lo, hi = w.ax.get_ylim()
    ys = np.concatenate([w.result.rdp_epsilon, w.result.pld_epsilon])
    f = np.log10 if w.ax.get_yscale() == "log" else (lambda v: v)
    assert lo < ys.min() and ys.max() < hi, "a Poisson curve runs off the axes"
    bottom = f(ys.min()) if w.ax.get_yscale() == "log" else lo  # a linear axis starts at 0
    return (f(ys.max()) - bottom) / (f(hi) - f(lo))


def test_the_shuffle_band_does_not_squash_the_poisson_curves(explorer):
    assert explorer.controls["shuffle"].value and explorer.ax.get_yscale() == "log"
    r = explorer.result
    assert explorer.ax.get_ylim()[1] >= np.max(r.shuffle_upper)  # the whole band is shown
    assert _poisson_share(explorer) > 0.2
    explorer.controls["shuffle"].value = False
    assert explorer.ax.get_yscale() == "linear" and _poisson_share(explorer) > 0.8


def test_legend_outside_and_one_epoch_markers_inside(explorer):
    explorer.controls["epochs"].value = 1
    explorer.figure.canvas.draw()
    legend = explorer.artists["legend"].get_window_extent()
    assert legend.y1 <= explorer.ax.get_window_extent().y0  # below the axes, not on curves
    marker_x = explorer.artists["shuffle_lower"].get_xdata()
    assert list(marker_x) == [1] and explorer.ax.get_xlim()[1] > 1.02  # not cut in half
    assert all(c.layout.width == "440px" for c in explorer.controls.values())
