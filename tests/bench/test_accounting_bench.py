"""The accounting benchmark runs end to end on tiny settings (its numbers are not checked here)."""

import pandas as pd

from workbench.bench.__main__ import main


def test_accounting_benchmark_writes_csv(tmp_path, capsys):
    out = tmp_path / "accounting.csv"
    main(["accounting", "--steps", "50", "--repeats", "1", "--no-compare", "--out", str(out)])
    table = pd.read_csv(out)
    assert list(table["task"]) == ["rdp_epsilon", "rdp_curve", "noise_multiplier",
                                   "pld_epsilon"]
    for column in ("workbench_ms", "workbench_value", "target_ms", "meets_target", "device"):
        assert column in table and table[column].notna().all(), column
    assert "pld_epsilon" in capsys.readouterr().out
