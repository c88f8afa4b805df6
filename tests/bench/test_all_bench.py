"""``bench all`` runs every benchmark and draws the Fig. 2/3-style figures (tiny settings)."""

import pandas as pd
import pytest

from workbench.bench import accounting, e2e, layers, memory
from workbench.bench.__main__ import main

SHRINK = {  # appended to what ``all`` passes: argparse keeps an option's last value
    layers: ["--layers", "linear", "--methods", "einsum", "--batch-sizes", "2", "4",
             "--no-dp-layers"],
    e2e: ["--models", "mnist_cnn", "--methods", "ghost", "--batch-sizes", "2"],
    memory: ["--batch-sizes", "2", "4", "--layers", "linear", "layernorm"],
    accounting: ["--tasks", "rdp_epsilon", "--steps", "10", "--no-compare"],
}


def test_all_writes_every_csv_and_both_figures(tmp_path, monkeypatch):
    for module, extra in SHRINK.items():
        real = module.main
        if module is memory:  # the embedding sweep keeps its layer, at tiny batch sizes
            extra = lambda argv, e=extra: e[:3] if "embedding" in argv else e  # noqa: E731
        else:
            extra = lambda argv, e=extra: e  # noqa: E731
        monkeypatch.setattr(module, "main", lambda argv, real=real, extra=extra:
                            real([*argv, *extra(argv)]))
    assert main(["all", "--quick", "--out-dir", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"layers.csv", "e2e.csv", "memory.csv", "memory_embedding_sweep.csv",
            "accounting.csv", "fig2_overheads.png", "fig3_embedding.png"} <= names
    sweep = pd.read_csv(tmp_path / "memory_embedding_sweep.csv")
    assert sorted(set(sweep["width"])) == list(memory.LAYERS["embedding"].widths)
    mem = pd.read_csv(tmp_path / "memory.csv")
    assert set(mem["layer"]) == {"linear", "layernorm"} and mem["einsum_x"].notna().all()
    for figure in ("fig2_overheads.png", "fig3_embedding.png"):
        assert (tmp_path / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_all_refuses_bad_repeats(capsys):
    with pytest.raises(SystemExit):
        main(["all", "--repeats", "0"])
    assert "--repeats must be >= 1; got 0" in capsys.readouterr().err
