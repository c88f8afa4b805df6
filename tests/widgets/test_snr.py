"""The SNR explorer: explore_snr against the accountant, its monotone trends, and the widget."""


import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.accounting import get_noise_multiplier  # noqa: E402
from workbench.accounting import snr as snr_module  # noqa: E402
from workbench.accounting.snr import default_batch_sizes, explore_snr  # noqa: E402
from workbench.clipping.snapshot import clip_at  # noqa: E402
from workbench.viz.snr import plot_snr  # noqa: E402
from workbench.widgets.snr import SNRExplorer  # noqa: E402

BUDGET = {"epsilon": 2.0, "delta": 1e-5, "epochs": 10, "dataset_size": 60_000}


def increasing(a):
    return bool(np.all(np.diff(a) > 0))


@pytest.fixture(scope="module")
def result():
    return explore_snr(**BUDGET, num_params=10_000, max_grad_norm=1.0, signal=0.1)


def test_sigma_is_the_accountants_and_the_formulas_hold(result):
    r = result
    assert r.batch_sizes.tolist() == default_batch_sizes(60_000).tolist()
    for B, q, T, sigma in zip(r.batch_sizes, r.sample_rates, r.steps, r.noise_multipliers):
        assert q == B / 60_000 and T == 10 * round(1 / q)  # 10 epochs of round(1/q) steps
        assert sigma == get_noise_multiplier(2.0, 1e-5, B / 60_000, epochs=10)
    np.testing.assert_allclose(r.noise_norms, r.noise_multipliers * 1.0 * 100 / r.batch_sizes,
                               rtol=1e-15)  # σ C √d / B, √10000 = 100
    np.testing.assert_allclose(r.snr, 0.1 / r.noise_norms, rtol=1e-15)


@pytest.mark.parametrize("epsilon", [0.5, 2.0, 8.0])
def test_larger_batches_mean_more_sigma_less_noise_and_more_snr(epsilon):
    r = explore_snr(epsilon, 1e-5, 10, 60_000, 10_000, 1.0, 0.1)
    assert increasing(r.noise_multipliers)  # q grows: more privacy cost per step
    assert increasing(-r.noise_norms) and increasing(r.snr)  # but the mean divides by B
    slope = np.diff(np.log(r.snr)) / np.diff(np.log(r.batch_sizes))  # d log SNR / d log B
    assert slope[0] > 0.8 and slope[-2] < slope[0]  # ~linear while σ is flat, then slower


def test_snr_trends_in_the_other_knobs(result):
    r, kw = result, {**BUDGET, "num_params": 10_000, "max_grad_norm": 1.0, "signal": 0.1}
    more_eps = explore_snr(**{**kw, "epsilon": 4.0})
    assert np.all(more_eps.snr > r.snr) and np.all(more_eps.noise_multipliers < r.noise_multipliers)
    np.testing.assert_allclose(explore_snr(**{**kw, "signal": 0.3}).snr, 3 * r.snr, rtol=1e-12)
    np.testing.assert_allclose(explore_snr(**{**kw, "max_grad_norm": 2.0}).snr, r.snr / 2,
                               rtol=1e-12)
    np.testing.assert_allclose(explore_snr(**{**kw, "num_params": 40_000}).snr, r.snr / 2,
                               rtol=1e-12)
    B = [64, 256]  # same batches, a larger data set: smaller q, less noise needed
    assert np.all(explore_snr(**{**kw, "dataset_size": 120_000}, batch_sizes=B).snr
                  > explore_snr(**kw, batch_sizes=B).snr)


def test_default_batch_sizes():
    B = default_batch_sizes(60_000)
    assert len(B) == 12 and B[0] == 16 and B[-1] == 60_000 and increasing(B)
    assert default_batch_sizes(10).tolist() == [10]


@pytest.mark.parametrize("change, match", [
    ({"batch_sizes": [16, 70_000]}, "batch_sizes must be integers in"),
    ({"signal": -1.0}, "signal must be"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"num_params": 0}, "num_params"),
])
def test_bad_inputs_raise_errors_naming_the_argument(change, match):
    kw = {**BUDGET, "num_params": 100, "max_grad_norm": 1.0, "signal": 0.1, **change}
    with pytest.raises(ValueError, match=match):
        explore_snr(**kw)


@pytest.fixture(scope="module")
def explorer():
    return SNRExplorer(num_params=10_000, signal=0.1, **BUDGET)


def lines_match_result(w):
    r, a = w.result, w.artists
    return (np.array_equal(a["snr"].get_xdata(), r.batch_sizes)
            and np.allclose(a["snr"].get_ydata(), r.snr)
            and np.allclose(a["sigma"].get_ydata(), r.noise_multipliers))


def test_widget_initial_state(explorer):
    assert set(explorer.controls) == {"epsilon", "delta", "epochs", "dataset_size",
                                      "max_grad_norm", "signal_source", "signal"}
    assert explorer.controls["signal_source"].options == ("manual",)
    assert explorer.result.num_params == 10_000 and lines_match_result(explorer)
    assert bytes(explorer.image.value).startswith(b"\x89PNG")


def test_signal_and_C_moves_do_not_call_the_accountant(explorer, monkeypatch):
    def no_accountant(*args, **kwargs):
        raise AssertionError("σ(B) should come from the cache")

    sigma = explorer.result.noise_multipliers
    monkeypatch.setattr(snr_module, "get_noise_multiplier", no_accountant)
    snr = explorer.result.snr
    explorer.controls["signal"].value = 0.2
    explorer.controls["max_grad_norm"].value = 0.5
    C = explorer.controls["max_grad_norm"].value
    np.testing.assert_allclose(explorer.result.snr, snr * 2 * (1 / C), rtol=1e-6)
    assert np.array_equal(explorer.result.noise_multipliers, sigma) and lines_match_result(explorer)


def test_epsilon_moves_recalibrate_sigma(explorer):
    before = explorer.result
    explorer.controls["epsilon"].value = 8.0
    r = explorer.result
    assert r.epsilon == explorer.controls["epsilon"].value
    assert np.all(r.noise_multipliers < before.noise_multipliers) and np.all(r.snr > before.snr)
    assert lines_match_result(explorer) and f"{r.snr[-1]:.3g}" in explorer.message.value


def test_bad_values_show_a_message_and_keep_the_last_result(explorer):
    last = explorer.result
    explorer.controls["dataset_size"].value = 100
    explorer.controls["delta"].value = 1e-10
    explorer.controls["epsilon"].value = 0.01  # below RDP's floor at δ = 1e-10
    assert "unreachable" in explorer.message.value and explorer.result.delta == 1e-10
    assert explorer.result.dataset_size == 100
    explorer.controls["epsilon"].value = 2.0
    assert explorer.result is not last and explorer.result.epsilon == 2.0


@pytest.fixture(scope="module")
def measured():
    train, _ = wb.data.load_digits()
    x, y = train.tensors
    torch.manual_seed(0)
    return SNRExplorer(wb.models.digits_mlp(), nn.CrossEntropyLoss(reduction="none"), x[:64],
                       y[:64], dataset_size=1437, max_grad_norm=1.0)


def test_the_signal_is_measured_at_C_from_a_model(measured):
    w = measured
    assert w.controls["signal_source"].value == "measured" and w.controls["signal"].disabled
    assert w.result.num_params == 9_610
    assert w.result.signal == clip_at(w.snapshot, 1.0).clipped_mean_norm
    w.controls["max_grad_norm"].value = 100.0
    assert w.result.signal == clip_at(w.snapshot, 100.0).clipped_mean_norm
    assert w.result.signal == pytest.approx(clip_at(w.snapshot, 100.0).mean_norm)  # unclipped
    w.controls["signal_source"].value = "manual"
    assert not w.controls["signal"].disabled
    assert w.result.signal == w.controls["signal"].value


def test_plot_snr_draws_on_the_given_axes_only(result):
    figures_before = plt.get_fignums()
    fig, ax = plt.subplots()
    artists = plot_snr(ax, result)
    assert set(artists) == {"snr", "sigma", "unit", "legend"}
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert list(artists["sigma"].get_ydata()) == list(result.noise_multipliers)
    assert len(plt.get_fignums()) == len(figures_before) + 1  # only the one made here
    plt.close(fig)


def test_the_greyed_signal_slider_shows_the_measured_signal_in_use(measured):
    w = measured
    w.controls["signal_source"].value = "measured"
    for C in (0.5, 3.0):
        w.controls["max_grad_norm"].value = C
        assert w.controls["signal"].disabled
        assert w.controls["signal"].value == pytest.approx(w.result.signal, rel=1e-12)
        assert w.result.signal == clip_at(w.snapshot, C).clipped_mean_norm


def test_the_legend_is_below_the_axes_not_on_the_curves(explorer):
    explorer.figure.canvas.draw()
    legend = explorer.artists["legend"].get_window_extent()
    assert legend.y1 <= explorer.ax.get_window_extent().y0
    assert explorer.controls["epsilon"].layout.width == "440px"  # a track long enough to aim
