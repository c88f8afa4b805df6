import pandas as pd
import pytest
import torch

from workbench.bench.__main__ import main


def test_training_benchmark_writes_csv(tmp_path):
    out = tmp_path / "training.csv"
    main(["training", "--models", "digits_mlp", "--batch-sizes", "4", "--repeats", "1",
          "--out", str(out)])
    table = pd.read_csv(out)
    assert {"plain_ms", "einsum/plain", "bookkeeping/plain"} <= set(table)


def test_training_benchmark_zoo_model_auto_and_opacus(tmp_path):
    pytest.importorskip("opacus")
    out = tmp_path / "training.csv"
    main(["training", "--models", "imdb_embedding", "--batch-sizes", "4", "--repeats", "1",
          "--modes", "einsum", "auto", "--opacus", "hooks", "--out", str(out)])
    table = pd.read_csv(out)
    assert {"einsum/plain", "auto/plain", "opacus_hooks/plain"} <= set(table)
    assert table["auto_chose"][0] in ("einsum", "bookkeeping")


def test_training_benchmark_tiny_gpt_beside_opacus(tmp_path):
    """tiny_gpt is not in the zoo: Opacus' loop gets the bench's own model and loss (a zoo
    lookup killed the run before any row was written). Opacus 1.6 cannot run it (its
    positional embedding on arange(T) gives T-row per-sample gradients): reported, not fatal."""
    pytest.importorskip("opacus")
    out = tmp_path / "training.csv"
    main(["training", "--models", "tiny_gpt", "--batch-sizes", "2", "--repeats", "1",
          "--modes", "bookkeeping", "--opacus", "hooks", "--out", str(out)])
    table = pd.read_csv(out)
    assert table["bookkeeping/plain"][0] > 0


def test_training_benchmark_modes_run_as_make_private_returns_them(monkeypatch):
    """A MODE column is the optimizer a user gets (skip_weight_grads at its default, on from
    the second step); only MODE+grads turns the skip off. Before, every MODE column ran with
    it off, which is not the default mode the README's table claims to measure."""
    from workbench.bench import training
    seen = {}
    real = training.step_fn

    def spy(model, optimizer, x, y, criterion=None):
        if hasattr(optimizer, "skip_weight_grads"):
            seen[len(seen)] = optimizer.recorder.skip_weight_grads
        return real(model, optimizer, x, y, criterion)

    monkeypatch.setattr(training, "step_fn", spy)
    row = training.bench("digits_mlp", 4, 1, torch.device("cpu"), modes=("bookkeeping",), keep=True)
    assert seen == {0: "auto", 1: False}
    assert {"bookkeeping/plain", "bookkeeping+grads/plain"} <= set(row)
