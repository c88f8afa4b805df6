"""Fig. 2's runtime panel explains the points that cannot be real (a noisy plain baseline)."""

import pandas as pd
from matplotlib.figure import Figure

from workbench.bench.all import NOISY_BELOW, mark_noisy_baselines, runtime_overheads
from workbench.bench.memory_explore import SHIPPED_DIR


def test_overheads_below_one_are_ringed_and_labelled(tmp_path):
    table = pd.DataFrame({"layer": ["linear", "linear"], "batch_size": [16, 64],
                          "einsum/plain": [0.33, 3.8], "plain_ms": [3.44, 0.84]})
    ax = Figure().subplots()
    noisy = mark_noisy_baselines(ax, table)
    assert list(noisy["batch_size"]) == [16]
    (label,) = [t.get_text() for t in ax.texts]
    assert "b = 16: 0.33x" in label and "3.44 ms" in label and "noisy plain baseline" in label


def test_the_shipped_cpu_run_has_its_noisy_point_marked():
    runtime = runtime_overheads(SHIPPED_DIR / "layers_cpu.csv",
                                SHIPPED_DIR / "layers_cpu_dp.csv")
    noisy = runtime[runtime["einsum/plain"] < NOISY_BELOW]
    assert ((noisy["layer"] == "linear") & (noisy["batch_size"] == 16)).any()
