"""The memory explorer: live measurements, shipped CSVs, the model curves, the plots."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from workbench.bench import memory as M  # noqa: E402
from workbench.bench import memory_explore as X  # noqa: E402
from workbench.viz.memory import plot_memory, plot_overheads, plot_sweep  # noqa: E402
from workbench.widgets.memory import MemoryExplorer  # noqa: E402


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A small measured table: two layers, two widths of one, three batch sizes."""
    rows = [M.measure_layer(name, b, width) for name, width in
            [("linear", 32), ("linear", 128), ("layernorm", 64)] for b in (4, 8, 16)]
    return pd.DataFrame(rows).assign(torch="x", date="2026-11-22")


def test_moving_the_batch_size_measures_and_redraws():
    w = MemoryExplorer("linear", width=64, batch_size=16)
    before = (w.message.value, w.image.value, w.result.predicted("einsum"))
    w.controls["batch_size"].value = 32
    assert w.result.batch_size == 32 and sorted(w.live["batch_size"]) == [16, 32]
    assert w.message.value != before[0] and w.image.value != before[1]
    assert w.result.predicted("einsum") > before[2]  # Eq. (2)/(1) grows with b
    at = w.result.at_b
    assert at["einsum_x"] == pytest.approx(w.result.predicted("einsum"), rel=0.1)
    w.controls["batch_size"].value = 16  # measured once, then kept
    assert len(w.live) == 2
    assert set(w.artists) >= {"model_einsum", "model_ghost", "measured_einsum",
                              "measured_ghost", "measured_bookkeeping", "b", "legend"}


def test_a_new_layer_brings_its_widths_and_one_measurement():
    w = MemoryExplorer("linear", width=64, batch_size=16)
    w.controls["layer"].value = "groupnorm"
    assert w.controls["width"].options == (64, 256, 1024)
    assert w.result.layer == "groupnorm" and w.result.width == 256
    assert list(w.live["layer"]) == ["linear", "groupnorm"]  # no measurement at a stale width


def test_too_large_live_batches_are_not_measured_but_said_so():
    w = MemoryExplorer("linear", width=64, batch_size=16, max_live_batch_MB=0.001)
    assert "not measured live" in w.message.value and w.live.empty
    assert w.result.measured.empty and "model_einsum" in w.artists  # the model still shows
    w = MemoryExplorer("linear", width=64, batch_size=16, max_live_MB=0.1)
    assert "einsum is not measured live" in w.message.value
    assert "einsum: model" in w.message.value and "measured not measured" in w.message.value
    assert pd.isna(w.result.at_b.get("einsum_x", float("nan")))


def test_a_shipped_csv_is_a_labelled_source(table, tmp_path, monkeypatch):
    table.to_csv(tmp_path / "memory_test.csv", index=False)
    monkeypatch.setattr(X, "SHIPPED_DIR", tmp_path)
    w = MemoryExplorer("linear", width=32, batch_size=8)
    label = X.source_label(table)
    assert label.endswith(" · 2026-11-22") and "profiler" not in label
    assert w.controls["source"].options == ("live (cpu)", label)
    w.controls["source"].value = label
    assert w.result.source == label and list(w.result.measured["batch_size"]) == [4, 8, 16]
    assert label in w.ax.get_title()


def test_plots_draw_one_line_per_layer_and_width(table):
    fig, axes = plt.subplots(1, 3)
    r = X.explore_memory("linear", 32, 8, table, "test")
    artists = plot_memory(axes[0], r)
    # the model over the standard batch sizes and the chosen b (8)
    assert list(artists["model_einsum"].get_xdata()) == [8, *M.BATCH_SIZES]
    assert list(artists["measured_einsum"].get_xdata()) == [4, 8, 16]
    lines = plot_overheads(axes[1], table, "einsum_x")
    assert set(lines) == {"linear", "layernorm"}
    assert list(lines["linear"].get_ydata()) == list(table["einsum_x"][:3])  # first width
    sweep = plot_sweep(axes[2], table, "linear")
    assert set(sweep) == {32, 128}
    plt.close(fig)


def test_a_live_measurement_shows_that_it_is_busy(monkeypatch):
    """While measuring: controls locked, a 'measuring' message and a redrawn (greyed) plot."""
    import workbench.widgets.memory as W

    w = MemoryExplorer("linear", width=64, batch_size=16)
    seen, measure = [], W.measure_layer

    def spy(*args, **kwargs):
        seen.append((w.message.value, [c.disabled for c in w.controls.values()],
                     w.image.value, [t.get_text() for t in w.ax.texts]))
        return measure(*args, **kwargs)

    monkeypatch.setattr(W, "measure_layer", spy)
    old_png = w.image.value
    w.controls["batch_size"].value = 32
    message, disabled, png, texts = seen[0]
    assert "measuring linear (width 64) at b = 32" in message and all(disabled)
    assert png != old_png and texts == ["measuring b = 32 ..."]
    assert not any(c.disabled for c in w.controls.values())  # unlocked afterwards
    assert "measuring" not in w.message.value and not w.ax.texts
    w.controls["batch_size"].value = 16  # already measured: no busy state, no measurement
    assert len(seen) == 1


def test_user_text_has_no_internal_names_and_labels_fit():
    w = MemoryExplorer("linear", width=64, batch_size=16, max_live_MB=0.1)
    w2 = MemoryExplorer("linear", width=64, batch_size=16, max_live_batch_MB=0.001)
    for text in (w.message.value, w2.message.value):
        assert "max_live" not in text and "_MB" not in text
    assert "live limit of 0.1 MB" in w.message.value
    source = w.controls["source"]
    assert source.style.button_width == "auto"  # buttons as wide as their labels
    assert all(len(label) <= 28 for label in source.options), source.options
    assert any("NVIDIA H200" in label for label in source.options)  # the shipped GPU run
