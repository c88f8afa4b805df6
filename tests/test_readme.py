"""The README's code blocks run as written (so they stay true)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def code_under(heading):
    """The first ```python block after the heading ``## {heading}``."""
    text = README.read_text()
    match = re.search(rf"## {re.escape(heading)}\n.*?```python\n(.*?)```", text, re.S)
    assert match, f"no python block under '## {heading}' in README.md"
    return match.group(1)


def test_readme_example_runs(capsys):
    exec(compile(code_under("The API in ten lines"), "README.md", "exec"), {})
    assert "BatchNorm1d" in capsys.readouterr().out


def test_readme_training_loop_runs_and_spends_privacy(capsys):
    namespace = {}
    exec(compile(code_under("Making a training loop private"), "README.md", "exec"), namespace)
    engine, optimizer = namespace["engine"], namespace["optimizer"]
    assert type(optimizer).__name__ == "DPOptimizer" and len(engine.accountant) > 0
    epsilon = float(re.search(r"epsilon = ([0-9.]+)", capsys.readouterr().out).group(1))
    assert 0 < epsilon < 10


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "make lab" in text and "make test" in text


def test_each_results_table_appears_once():
    """A table's header row stands once (the whole output of tools/results_tables.py was pasted
    twice where the training table alone belonged, until 2026-12-01)."""
    headers = [lines[i - 1] for lines in [README.read_text().split("\n")]
               for i, line in enumerate(lines) if i and re.fullmatch(r"\|(-+\|)+", line)]
    assert headers and len(headers) == len(set(headers)), sorted(
        h for h in headers if headers.count(h) > 1)
