"""The e2e benchmark runs end to end on tiny settings (its numbers are not checked here)."""

import pandas as pd

from workbench.bench import opacus_twin
from workbench.bench.__main__ import main


def test_e2e_benchmark_writes_csv(tmp_path):
    out = tmp_path / "e2e.csv"
    main(["e2e", "--models", "mnist_cnn", "imdb_embedding", "--batch-sizes", "2",
          "--repeats", "1", "--methods", "einsum", "ghost", "bookkeeping", "--out", str(out)])
    table = pd.read_csv(out)
    assert list(table["model"]) == ["mnist_cnn", "imdb_embedding"]
    for column in ("plain_ms", "ghost/plain", "bookkeeping/plain", "einsum/plain", "device"):
        assert table[column].notna().all(), column


def test_e2e_tiny_gpt_rows_full_and_lora(tmp_path):
    out = tmp_path / "e2e_gpt.csv"
    main(["e2e", "--models", "tiny_gpt", "--batch-sizes", "2", "--seq-len", "8",
          "--repeats", "1", "--methods", "vmap", "bookkeeping", "--out", str(out)])
    row = pd.read_csv(out).iloc[0]
    assert row["model"] == "tiny_gpt" and row["params"] == 114_432 - 120 * 64
    for column in ("plain_ms", "vmap/plain", "lora_plain_ms", "lora_bookkeeping/lora_plain",
                   "lora_bookkeeping_mem/lora_plain", "lora_vmap/lora_plain"):
        assert pd.notna(row[column]), column
    assert row["vmap_audit"] == row["bookkeeping_audit"] == "passed"  # vs micro-batching
    if opacus_twin.available():  # its hooks miss the tied head F.linear(h, E)
        assert row["opacus_audit"] == "failed" and "wte.weight" in row["opacus_worst"]
