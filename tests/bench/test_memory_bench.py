"""The memory benchmark: a real CPU measurement, the Opacus memory model, the CSV it writes.

Numbers are checked only where they are exact by construction: the bytes of tensors we
allocate ourselves, and the per-sample gradients every materialising method must hold.
"""

import re

import pandas as pd
import pytest
import torch
from torch import nn

from workbench.bench import layer_specs as specs
from workbench.bench import memory as M
from workbench.bench import memory_explore as X
from workbench.bench import peak_memory as P
from workbench.bench.__main__ import main
from workbench.clipping import memory_model as MM

MB = 2**20
CPU = torch.device("cpu")


def test_cpu_peak_counts_live_allocations_not_freed_ones():
    def two_in_turn():  # 4 MB allocated, freed, then 8 MB: the peak is 8 MB, not 12
        a = torch.ones(2**20)
        del a
        return torch.ones(2**21)

    assert P.peak_bytes(two_in_turn, CPU, resident=0) == pytest.approx(8 * MB, abs=64 * 1024)

    def together():
        a, b = torch.ones(2**20), torch.ones(2**21)
        return a.sum() + b.sum()

    assert P.peak_bytes(together, CPU, resident=MB) == pytest.approx(13 * MB, abs=64 * 1024)


def test_tensor_bytes_counts_shared_storage_once():
    layer = nn.Linear(10, 10)
    x = torch.zeros(4, 10)
    assert P.tensor_bytes(layer, x, x) == (110 + 40) * 4


def test_memory_model_is_eq_1_and_2_and_has_the_eq_3_limits():
    m = MM.model_bytes(b=8, L=100.0, C=10.0, S=3.0)
    assert m == {"plain": 8 * 10 + 2 * 100, "einsum": 8 * 10 + 9 * 100,
                 "ghost": 8 * 10 + 2 * 100 + 8 * 3}
    b = 512
    small = MM.model_bytes(b, L=1.0, C=1000.0)  # L/C << b: 1 + L/C
    assert small["einsum"] / small["plain"] == pytest.approx(1 + 1 / 1000, rel=1e-2)
    large = MM.model_bytes(b, L=1e9, C=1.0)  # L/C >> b: (1 + b) / 2
    assert large["einsum"] / large["plain"] == pytest.approx((1 + b) / 2, rel=1e-3)
    assert MM.eq3_regime(1.0, b).startswith("L/C ≪ b")
    assert MM.eq3_regime(5000.0, b).startswith("L/C ≫ b")
    assert MM.eq3_regime(500.0, b).startswith("L/C ≈ b")


def test_layer_sizes_and_ghost_scratch_follow_the_routes():
    layer, x = nn.Linear(8, 4), torch.randn(3, 8)
    t = torch.randn(3, 4)
    sizes = MM.layer_sizes(layer, x, t)
    assert sizes["L_bytes"] == 36 * 4 and sizes["C_bytes"] == (8 + 2 * 4) * 4
    # one position per sample: the backprop (4) and the two norms (norm product route)
    assert M.ghost_S(layer, x, t) == (4 + 2) * 4
    xs, ts = torch.randn(2, specs.T, 64), torch.randn(2, specs.T, 64)
    # hidden 64: two projections (input, recurrent), each 2T² < pd, so the Gram route:
    # the backprop (T·4h) plus two (T, T) Grams
    lstm = specs.LAYERS["lstm"].make(64)
    assert M.ghost_S(lstm, xs, ts) == 2 * (specs.T * 256 + 2 * specs.T**2) * 4
    # hidden 16: 2T² >= pd, so each projection's own per-sample gradient is materialised
    xs, ts = xs[..., :16], ts[..., :16]
    own = (64 * 16 + 2 * 64) + 64 * 16  # input weight and both biases; recurrent weight
    assert M.ghost_S(specs.LAYERS["lstm"].make(16), xs, ts) == (2 * specs.T * 64 + own) * 4


def test_einsum_holds_the_per_sample_gradients_and_eq_2_predicts_linear():
    """Linear(256, 256), b = 64: bL = 16 MB must be live; the paper's model is near exact."""
    row = M.measure_layer("linear", 64, width=256)
    bL = 64 * row["L_bytes"] / MB
    assert row["einsum_MB"] >= bL
    assert abs(row["einsum_error"]) < 0.1  # measured within 10% of Eq. (2) / Eq. (1)
    assert row["ghost_x"] < 1.5 and row["bookkeeping_x"] < 2.0  # no b·L anywhere
    assert row["device"].startswith("CPU (profiler)")


def test_check_layer_names_the_argument_and_the_fix():
    with pytest.raises(ValueError, match="layer must be one of .*'dense'"):
        specs.check_layer("dense")
    with pytest.raises(ValueError, match="width for groupnorm must be a multiple of 16; got 20"):
        specs.check_layer("groupnorm", 20)
    with pytest.raises(ValueError, match="width must be a positive int; got 0"):
        specs.check_layer("linear", 0)
    with pytest.raises(ValueError, match="batch_size must be a positive int; got 0"):
        X.explore_memory("linear", 64, 0, pd.DataFrame(), "live")


def test_load_refuses_missing_files_and_foreign_csvs(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m workbench.bench memory --out"):
        X.load(tmp_path / "nope.csv")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a memory benchmark CSV: columns .*'layer'"):
        X.load(tmp_path / "other.csv")


def test_benchmark_writes_csv_and_explore_reads_it(tmp_path, capsys):
    out = tmp_path / "memory.csv"
    main(["memory", "--layers", "linear", "mha", "--batch-sizes", "4", "8", "--out", str(out)])
    table = X.load(out)
    assert list(table["layer"]) == ["linear"] * 2 + ["mha"] * 2
    for column in ("plain_MB", "einsum_x", "ghost_x", "bookkeeping_x", "model_einsum_x",
                   "model_ghost_x", "einsum_error", "L/C", "device", "torch", "date"):
        assert table[column].notna().all(), column
    printed = capsys.readouterr().out
    assert "Summary" in printed and "Eq. (3) off by -23% to +41%" in printed
    r = X.explore_memory("mha", 64, 8, table, source=str(out))
    assert list(r.measured["batch_size"]) == [4, 8] and r.at_b["batch_size"] == 8
    assert r.predicted("einsum") == pytest.approx(table["model_einsum_x"].iloc[-1])
    assert r.predicted("ghost") == pytest.approx(table["model_ghost_x"].iloc[-1])
    empty = X.explore_memory("linear", 512, 16, pd.DataFrame(), "live")
    assert empty.measured.empty and empty.at_b is None


def test_shipped_results_load_and_name_their_device():
    shipped = X.shipped_results()
    assert shipped, "data/bench/memory_*.csv should ship with the package"
    for label, path in shipped.items():
        table = X.load(path)
        assert label == X.source_label(table) and label.endswith(f" · {table['date'].iloc[0]}")
        device = table["device"].iloc[0]
        assert label.split(" · ")[0] in device or device.startswith("CPU")  # CPU: shortened
        assert set(table["layer"]) == set(specs.LAYERS)
        assert {"torch", "date", "model_einsum_x", "ghost_x"} <= set(table.columns)


@pytest.mark.crosscheck
def test_opacus_grad_sample_module_is_measured_beside_ours():
    pytest.importorskip("opacus", reason="Opacus not installed (pip install -e '.[crosscheck]')")
    row = M.measure_layer("linear", 32, width=128, modes=(*M.MODES, "opacus"))
    assert row["opacus_MB"] >= 32 * row["L_bytes"] / MB  # it holds b per-sample gradients too
    assert row["opacus_x"] > row["ghost_x"]
    lstm = M.measure_layer("lstm", 4, width=16, modes=("plain", "opacus"))  # Opacus' DPLSTM
    assert lstm["opacus_MB"] > lstm["plain_MB"]


def test_too_large_steps_are_skipped_but_keep_the_model():
    row = M.measure_layer("linear", 64, width=512, modes=("plain", "einsum", "ghost"),
                          max_GB=0.05)  # b·L = 64 MiB > 0.05 GiB
    assert "einsum_MB" not in row and "einsum_x" not in row
    assert row["model_einsum_x"] == pytest.approx(MM.model_bytes(
        64, row["L_bytes"], row["C_bytes"])["einsum"] / MM.model_bytes(
        64, row["L_bytes"], row["C_bytes"])["plain"])
    assert row["ghost_x"] > 0  # the other modes still run


def test_cpu_peak_fails_loudly_when_the_profiler_records_change(monkeypatch):
    monkeypatch.setattr(P, "_memory_records", lambda prof: [(0, 4096), (1, -4096)])
    version = re.escape(torch.__version__)
    with pytest.raises(RuntimeError, match=f"torch {version} did not record a known "
                                           f"allocation of {P.CANARY_BYTES} bytes"):
        P.peak_bytes(lambda: None, CPU, resident=0)

    class Renamed:  # a profiler whose private records are gone
        profiler = None

    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=f"torch {version} does not provide"):
        P._memory_records(Renamed())


def test_cpu_peak_does_not_depend_on_earlier_profiled_calls():
    """A step that frees last step's .grad reads the same peak on its first profiled call and
    on later ones (the allocator remembers blocks allocated under any earlier profiler)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)

    def step():
        opt.zero_grad()  # frees the .grad the previous step allocated
        model(x).square().sum().backward()
        opt.step()

    step()
    peaks = [P.peak_bytes(step, CPU, resident=0) for _ in range(3)]
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peaks[0] == peaks[1] == peaks[2]
    assert peaks[0] >= grads + 32 * 256 * 4  # the new .grad and the hidden activations
