"""``python -m workbench.bench real``'s options: threads and repeats checked, threads restored."""

import math

import pytest
import torch

from workbench.bench import real


def test_threads_default_to_one_and_bad_values_are_refused(tmp_path, capsys):
    out = ["--out", str(tmp_path / "real.csv")]
    assert real.parse(out).threads == 1  # tiny models: one thread, no OpenMP stalls
    assert real.parse(["--threads", "0", *out]).threads == 0  # PyTorch's default
    for bad in (["--threads", "-1"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            real.parse([*bad, *out])
        assert bad[0] in capsys.readouterr().err


def test_main_leaves_the_thread_count_as_it_was(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(real, "row", lambda name, repeats, device, sizes, mode: seen.append(
        torch.get_num_threads()) or {"model": name, **dict.fromkeys(
            ("microbatch", "vmap", "einsum", "ghost", "bookkeeping"), "exact"),
            "opacus": "exact", "plain_ms": 1.0, "time_x": 1.0, "memory_x": 1.0})
    before = torch.get_num_threads()
    real.main(["--models", "gpt2", "--threads", "1", "--out", str(tmp_path / "real.csv")])
    assert seen == [1] and torch.get_num_threads() == before


def test_base_size_widens_every_architecture_it_builds():
    """``realzoo.sizes``: "base" changes only the keys a tiny builder sets, so each model keeps
    its architecture (same module types) at the width the cost table measures; outside the
    block the tiny model comes back."""
    from workbench.realzoo import PROBLEMS, sizes

    for name in ("gpt2", "t5", "timm_vit"):
        tiny = PROBLEMS[name].build(torch.float32)
        with sizes.size("base"):
            base = PROBLEMS[name].build(torch.float32)
            x, _ = PROBLEMS[name].batch(2, T=sizes.TOKENS["base"], dtype=torch.float32)
            assert base(x).shape[0] == 2
        assert {type(m) for m in base.modules()} == {type(m) for m in tiny.modules()}, name
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        assert count(base) > 20 * count(tiny), name
        assert count(PROBLEMS[name].build(torch.float32)) == count(tiny)
    with pytest.raises(ValueError, match="size must be one of"):
        with sizes.size("huge"):
            pass


def test_every_model_builds_at_base_or_says_why_not(monkeypatch):
    """Each architecture has a base size the cost table can build (Mamba-2's heads follow its
    width: heads x head_dim = expand x hidden), or ``sizes.NO_BASE`` says why it is not
    measured there, and the table's row carries that reason instead of a number."""
    from workbench.realzoo import sizes

    config = {"hidden_size": 16, "expand": 2, "num_heads": 4, "head_dim": 8}
    with sizes.size("base"):
        sizes_config = sizes.scaled(config)
    assert sizes_config["num_heads"] * sizes_config["head_dim"] == 2 * sizes_config["hidden_size"]
    monkeypatch.setattr(real, "verdicts", lambda name, device=None: {})
    monkeypatch.setattr(real, "cost", lambda *a, **k: pytest.fail("cost measured at base"))
    row = real.row("mixtral", 1, torch.device("cpu"), ("base",))
    assert row["cost_note_base"] == sizes.NO_BASE["mixtral"]
    assert math.isnan(row["time_x_base"]) and math.isnan(row["memory_x_base"])


def test_mode_reaches_the_optimizer_and_the_first_step_is_measured(tmp_path, monkeypatch):
    """``--mode`` is the DP optimizer's method for the cost columns (checked while parsing);
    the first, self-checked step's peak is a column of its own, and the summary names both."""
    out = ["--out", str(tmp_path / "real.csv")]
    assert real.parse(out).mode == "auto"
    with pytest.raises(SystemExit):
        real.parse(["--mode", "ghostly", *out])
    made = []
    original = real.DPOptimizer
    monkeypatch.setattr(real, "DPOptimizer", lambda *a, **k: made.append(k["method"]) or
                        original(*a, **k))
    cost = real.cost("gpt2", 1, torch.device("cpu"), "tiny", "bookkeeping")
    assert made == ["bookkeeping"]
    assert set(cost) == {"plain_ms", "time_x", "memory_x", "memory_first_x"}
    assert cost["memory_first_x"] > 0 and cost["memory_x"] > 0
    table = real.pd.DataFrame([{"model": "gpt2", **dict.fromkeys(
        ("microbatch", "vmap", "einsum", "ghost", "bookkeeping"), "exact"), "opacus": "exact",
        **cost}])
    line = real.summary(table, "bookkeeping")
    assert "mode bookkeeping" in line and "first step" in line and "worst" in line, line
