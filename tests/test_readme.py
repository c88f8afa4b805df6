"""The README's API example runs as written (so it stays true)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    text = README.read_text()
    code = re.search(r"## The API in ten lines\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "BatchNorm1d" in capsys.readouterr().out


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "make lab" in text and "make test" in text
