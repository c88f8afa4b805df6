"""``bench all`` runs every benchmark and draws the Fig. 2/3-style figures (tiny settings)."""

import pandas as pd
import pytest

from workbench.bench import accounting, dp_layers, e2e, layer_specs, layers, memory
from workbench.bench.__main__ import main

SHRINK = {  # keyword arguments that override what ``all`` passes to each ``run``
    layers: dict(layers=["linear"], methods=["einsum"], batch_sizes=[2, 4]),
    dp_layers: dict(layers=["rnn"], batch_sizes=[2]),
    e2e: dict(models=["mnist_cnn"], methods=["ghost"], batch_sizes=[2]),
    memory: dict(batch_sizes=[2, 4], layers=["linear", "layernorm"]),
    accounting: dict(tasks=["rdp_epsilon"], steps=10, compare=False),
}


def test_all_writes_every_csv_and_both_figures(tmp_path, monkeypatch):
    for module, extra in SHRINK.items():
        def run(real=module.run, extra=extra, **kwargs):
            if kwargs.get("layers") == ["embedding"]:  # the sweep keeps its layer, tiny b
                extra = {"batch_sizes": extra["batch_sizes"]}
            return real(**{**kwargs, **extra})

        monkeypatch.setattr(module, "run", run)
    assert main(["all", "--quick", "--out-dir", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"layers.csv", "e2e.csv", "memory.csv", "memory_embedding_sweep.csv",
            "accounting.csv", "fig2_overheads.png", "fig3_embedding.png"} <= names
    sweep = pd.read_csv(tmp_path / "memory_embedding_sweep.csv")
    assert sorted(set(sweep["width"])) == list(layer_specs.LAYERS["embedding"].widths)
    mem = pd.read_csv(tmp_path / "memory.csv")
    assert set(mem["layer"]) == {"linear", "layernorm"} and mem["einsum_x"].notna().all()
    for figure in ("fig2_overheads.png", "fig3_embedding.png"):
        assert (tmp_path / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_all_refuses_bad_repeats(capsys):
    with pytest.raises(SystemExit):
        main(["all", "--repeats", "0"])
    assert "--repeats must be >= 1; got 0" in capsys.readouterr().err
