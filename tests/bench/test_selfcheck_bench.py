"""The self-check benchmark returns its table (a tiny configuration; no timing asserted)."""

import torch

from workbench.bench import selfcheck


def test_selfcheck_bench_returns_ratios_for_layers_and_models():
    table = selfcheck.run([4], repeats=1, device=torch.device("cpu"), methods=("einsum",),
                          layers=("linear",), zoo=("mnist_cnn",))
    assert list(table["case"]) == ["layer linear", "model mnist_cnn", "optimizer mnist_cnn"]
    assert (table["checked/unchecked"] > 0).all() and (table["always/unchecked"] > 0).all()
    assert {"unchecked_ms", "checked_ms", "always_ms"} <= set(table.columns)
