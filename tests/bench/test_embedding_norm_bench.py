"""``bench embedding_norm`` returns a table of both timings and their ratio per run."""

import pandas as pd

from workbench.bench import embedding_norm


def test_one_row_per_run_with_the_ratio(tmp_path):
    out = tmp_path / "en.csv"
    assert embedding_norm.main(["--batch-sizes", "8", "--runs", "2", "--repeats", "2",
                                "--vocab", "50", "--device", "cpu", "--out", str(out)]) == 0
    table = pd.read_csv(out)
    assert list(table["run"]) == [0, 1] and (table["ghost/torch"] > 0).all()
    assert {"torch_backward", "ghost_norms", "device"} <= set(table.columns)
