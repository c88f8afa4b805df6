"""The DP layers benchmark runs end to end on tiny settings (its numbers are not checked here)."""

import pandas as pd

from workbench.bench.dp_layers import main


def test_dp_layers_benchmark_writes_csv(tmp_path, capsys):
    out = tmp_path / "dp_layers.csv"
    main(["--layers", "lstm", "mha", "--batch-sizes", "2", "--repeats", "1", "--out", str(out)])
    table = pd.read_csv(out)
    assert list(table["layer"]) == ["lstm", "mha"]
    for column in ("torch", "dp", "dp_einsum", "dp/torch", "einsum/dp", "floor", "device"):
        assert column in table and table[column].notna().all(), column
    assert "dp_einsum" in capsys.readouterr().out
