"""The clipping explorer: set the controls from code, check the result and the figure."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.clipping import snapshot  # noqa: E402
from workbench.clipping.snapshot import clip_at, per_sample_snapshot  # noqa: E402
from workbench.viz.clipping import plot_layer_norms, plot_norms  # noqa: E402
from workbench.widgets.clipping import ClippingExplorer  # noqa: E402


@pytest.fixture(scope="module")
def batch():
    train, _ = wb.data.load_digits()
    x, y = train.tensors
    torch.manual_seed(0)
    return wb.models.digits_mlp(), nn.CrossEntropyLoss(reduction="none"), x[:128], y[:128]


@pytest.fixture(scope="module")
def explorer(batch):
    return ClippingExplorer(*batch, max_grad_norm=1.0)


def histogram_matches(w, values):
    """The drawn histogram holds every positive value of ``values``, binned by its edges."""
    counts, edges = w.artists["hist"].get_data().values, w.artists["hist"].get_data().edges
    expected, _ = np.histogram(values[values > 0], edges)
    return np.array_equal(counts, expected) and counts.sum() == np.count_nonzero(values)


def test_initial_state(explorer):
    assert set(explorer.controls) == {"max_grad_norm", "layer"}
    assert list(explorer.controls["layer"].options) == ["all", "fc1", "fc2"]
    r = explorer.result
    assert r.max_grad_norm == 1.0 and r.layers == ("fc1", "fc2") and r.num_samples == 128
    assert r.cosine == clip_at(explorer.snapshot, 1.0).cosine
    assert histogram_matches(explorer, r.norms)
    assert list(explorer.artists["clip"].get_xdata()) == [1.0, 1.0]
    assert bytes(explorer.image.value).startswith(b"\x89PNG")


def test_moving_C_reclips_without_computing_gradients(explorer, monkeypatch):
    def no_backward(*args, **kwargs):
        raise AssertionError("a C slider move must not compute per-sample gradients")

    monkeypatch.setattr(snapshot, "per_sample_gradients", no_backward)
    norms = explorer.snapshot.norms
    C = float(np.median(norms))
    explorer.controls["max_grad_norm"].value = C
    C = explorer.controls["max_grad_norm"].value  # the slider rounds to its step
    r = explorer.result
    assert r.max_grad_norm == C and r.fraction_clipped == np.mean(norms > C)
    assert 0 < r.fraction_clipped < 1
    assert list(explorer.artists["clip"].get_xdata()) == [C, C]
    assert list(explorer.layer_artists["clip"].get_ydata()) == [C, C]
    assert f"{r.fraction_clipped:.0%}" in explorer.artists["text"].get_text()
    explorer.controls["max_grad_norm"].value = 100.0
    assert explorer.result.fraction_clipped == 0.0
    assert explorer.result.cosine == pytest.approx(1.0, abs=1e-9)
    assert "cos(m̃, m) = 1.0000" in explorer.message.value


def test_the_layer_menu_shows_that_layers_norms(explorer):
    before = explorer.result.cosine
    explorer.controls["layer"].value = "fc2"
    r = explorer.result
    assert r.cosine == before  # the layer is a view; clipping still uses the total norm
    assert histogram_matches(explorer, r.layer_norms[:, 1])
    assert "fc2" in explorer.ax.get_xlabel() and "fc2: cos" in explorer.artists["text"].get_text()
    explorer.controls["layer"].value = "all"
    assert histogram_matches(explorer, r.norms)


def test_a_bad_C_is_refused_at_construction(batch):
    with pytest.raises(ValueError, match="max_grad_norm"):
        ClippingExplorer(*batch, max_grad_norm=0.0)


def test_plots_draw_on_the_given_axes_only(batch):
    figures_before = plt.get_fignums()
    fig, (ax, ax2) = plt.subplots(1, 2)
    r = clip_at(per_sample_snapshot(*batch), 2.0)
    artists = plot_norms(ax, r, layer="fc1")
    assert set(artists) == {"hist", "clip", "text"} and ax.get_xscale() == "log"
    assert artists["hist"].get_data().values.sum() == np.count_nonzero(r.layer_norms[:, 0])
    boxes = plot_layer_norms(ax2, r)
    assert len(boxes["boxes"]["boxes"]) == 2 and list(boxes["clip"].get_ydata()) == [2.0, 2.0]
    assert [t.get_text() for t in ax2.get_xticklabels()] == ["fc1", "fc2"]
    with pytest.raises(ValueError):
        plot_norms(ax, r, layer="nope")
    assert len(plt.get_fignums()) == len(figures_before) + 1  # only the one made here
    plt.close(fig)


def labelled_ticks(ax):
    """(position, label) of the x ticks matplotlib draws inside the view, with their text."""
    ax.figure.canvas.draw()
    lo, hi = ax.get_xlim()
    return [(t.get_position()[0], t.get_text()) for t in ax.get_xticklabels()
            if lo <= t.get_position()[0] <= hi and t.get_text()]


def test_histogram_labels_norms_between_the_1_2_5_ticks(batch):
    # The untrained digits MLP's norms lie between about 2.2 and 3.4 (the tour's values):
    # no tick at 1, 2 or 5 x 10^k falls in that view, and it must still be labelled.
    r = clip_at(per_sample_snapshot(*batch), 2.75)
    assert 2 < r.norms.min() and r.norms.max() < 5  # the case this test is about
    fig, ax = plt.subplots()
    plot_norms(ax, r)
    ticks = labelled_ticks(ax)
    assert len(ticks) >= 2, ticks  # at least two labels: a scale to read the norms on
    assert all(float(label) == pytest.approx(x) for x, label in ticks)  # plain numbers
    plt.close(fig)


@pytest.mark.parametrize("view", [(2.2, 3.5), (0.9, 1.1), (1.5, 9.5), (0.5, 12.0),
                                  (1e-3, 1e5), (1e-6, 1e9)])
def test_log_ticks_label_any_view_with_two_to_seven_ticks(view):
    from workbench.viz.clipping import plain_log_ticks

    fig, ax = plt.subplots()
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    ax.set_xlim(*view)
    ticks = labelled_ticks(ax)
    assert 2 <= len(ticks) <= 7, (view, ticks)
    plt.close(fig)
