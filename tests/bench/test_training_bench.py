import pandas as pd

from workbench.bench.__main__ import main


def test_training_benchmark_writes_csv(tmp_path):
    out = tmp_path / "training.csv"
    main(["training", "--models", "digits_mlp", "--batch-sizes", "4", "--repeats", "1",
          "--out", str(out)])
    table = pd.read_csv(out)
    assert {"plain_ms", "einsum/plain", "ghost/plain", "bookkeeping/plain"} <= set(table)
