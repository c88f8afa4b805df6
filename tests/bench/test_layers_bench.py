"""The layers benchmark runs end to end on tiny settings (its numbers are not checked here)."""

import pandas as pd
import pytest

from workbench.bench.__main__ import main


def test_layers_benchmark_writes_csv(tmp_path, capsys):
    out = tmp_path / "layers.csv"
    main(["layers", "--layers", "linear", "embedding", "--batch-sizes", "2", "--repeats", "1",
          "--out", str(out)])
    dp = pd.read_csv(tmp_path / "layers_dp.csv")  # the DP layers' table comes along
    assert {"rnn", "gru", "lstm", "mha"} <= set(dp["layer"])
    table = pd.read_csv(out)
    assert list(table["layer"]) == ["linear", "embedding"]
    for column in ("plain", "microbatch", "vmap", "einsum", "floor", "microbatch/einsum",
                   "einsum/(plain+floor)", "device"):
        assert column in table and table[column].notna().all(), column
    assert "einsum" in capsys.readouterr().out


def test_unknown_benchmark_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["nonsense"])
    assert "invalid choice" in capsys.readouterr().err
