"""The headless main job: python -m workbench audit (small settings)."""

import json
import sys

import pytest

from workbench.__main__ import main as workbench_main


def test_quick_audit_passes_and_writes_the_report(tmp_path, capsys):
    code = workbench_main(["audit", "--quick", "--trials", "100", "--no-progress",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "report.json").read_text())
    titles = [s["title"] for s in report["sections"]]
    assert report["passed"] and "Mechanism audit: workbench" in titles
    assert sum("bug zoo" in t for t in titles) >= 6
    html = (tmp_path / "report.html").read_text()
    assert "caught" in html and "data:image/png;base64" in html


def test_user_model_and_data_factories(tmp_path, capsys, monkeypatch):
    (tmp_path / "mine.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def model():\n    torch.manual_seed(0)\n    return nn.Sequential(nn.Linear(3, 4), "
        "nn.Tanh(), nn.Linear(4, 2))\n"
        "def batch():\n    return torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = workbench_main(["audit", "--model", "mine:model", "--data", "mine:batch",
                           "--quick", "--trials", "60", "--no-progress",
                           "--out", str(tmp_path / "r")])
    assert code == 0
    titles = [s["title"] for s in json.loads((tmp_path / "r" / "report.json").read_text())
              ["sections"]]
    assert titles[0] == "Gradient audit: mine:model"


def test_bad_options_are_clear_errors(capsys):
    with pytest.raises(SystemExit, match="--model must look like module:callable"):
        workbench_main(["audit", "--model", "nocolon", "--data", "x:y", "--no-progress"])
    with pytest.raises(SystemExit):
        workbench_main(["audit", "--trials", "3"])
    assert "--trials must be >= 50" in capsys.readouterr().err
    assert workbench_main(["nonsense"]) == 2


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        workbench_main(["audit", "--help"])
    text = capsys.readouterr().out
    for option in ("--out", "--quick", "--model", "--data", "--loss", "--trials"):
        assert option in text
    assert sys.modules.get("workbench.audit.cli") is not None
