"""The audit report: one HTML page (tables and figures) and one JSON file of the numbers.

Each section is an audit result (anything with ``.passed``, ``.table`` and optionally
``.plot(ax)``) or a pandas DataFrame with a ``passed`` column, under a title. Figures are
embedded as base64 PNG, so the page is a single file that can be mailed or archived.
"""

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure


@dataclass
class Section:
    title: str
    table: pd.DataFrame
    passed: bool
    must_pass: bool  # a failure here makes the audit (and the command) fail
    note: str = ""
    figure_png: bytes | None = None
    labels: tuple[str, str] = ("passed", "FAILED")  # the verdict words for passed / failed


def section(title: str, result, must_pass: bool = True, note: str = "") -> Section:
    """A report section from an audit result or a DataFrame with a ``passed`` column."""
    is_table = isinstance(result, pd.DataFrame)  # (a DataFrame's columns are attributes too)
    table = result if is_table else result.table
    passed = bool(table["passed"].all()) if is_table else bool(result.passed)
    png = None
    if not is_table and hasattr(result, "plot"):
        fig = Figure(figsize=(6, 3), dpi=90)
        result.plot(fig.add_subplot())
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        png = buffer.getvalue()
    return Section(title, table, passed, must_pass, note, png)


def write_report(out: Path, sections: list[Section], title: str = "DP-SGD Workbench audit"):
    """Write ``report.html`` and ``report.json`` to ``out``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ok = all(s.passed for s in sections if s.must_pass)
    parts = [f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>",
             f"<body><h1>{html.escape(title)}</h1>",
             f"<p><b>{'PASSED' if ok else 'FAILED'}</b>: {sum(s.passed for s in sections)} of "
             f"{len(sections)} sections passed.</p>"]
    for s in sections:
        verdict = s.labels[0] if s.passed else s.labels[1]
        parts.append(f"<h2>{html.escape(s.title)}: {verdict}</h2>")
        if s.note:
            parts.append(f"<p>{html.escape(s.note)}</p>")
        parts.append(s.table.to_html(index=False, float_format=lambda v: f"{v:.3g}"))
        if s.figure_png:
            data = base64.b64encode(s.figure_png).decode()
            parts.append(f"<p><img src='data:image/png;base64,{data}'/></p>")
    parts.append("</body></html>")
    (out / "report.html").write_text("\n".join(parts))
    numbers = {"passed": ok, "sections": [
        {"title": s.title, "passed": s.passed, "must_pass": s.must_pass,
         "table": json.loads(s.table.to_json(orient="records"))} for s in sections]}
    (out / "report.json").write_text(json.dumps(numbers, indent=1))
    return out / "report.html", out / "report.json"
