"""``report.html``: the audit report for people, as one self-contained file.

Top of the page (above the fold): the verdict, then a summary table with one row per section
(what was checked, verdict badge, one-line finding, key number). Below: each section (what it
checks and why, figures, a table without noise, notes stated once), then provenance. Figures
are embedded PNGs (data URIs) and the stylesheet is inline: no network, one file to hand over.
The page prints cleanly (``@media print``: no colours needed to read a verdict, sections do not
split across pages where avoidable).
"""

import base64
import html
import math

from workbench.audit.report import FAILED, PASSED, SKIPPED

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;
 max-width:1120px;margin:0 auto;padding:12px 20px}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:28px 0 6px;border-top:1px solid #ccd;
 padding-top:14px}
.verdict{font-size:16px;margin:6px 0 10px}.meta{color:#556;font-size:12px}
.badge{display:inline-block;padding:1px 8px;border-radius:9px;font-weight:600;font-size:12px;
 border:1px solid currentColor;white-space:nowrap}
.big{font-size:18px;padding:2px 12px}
.passed{color:#17632a;background:#e3f4e6}.failed{color:#a4161a;background:#fde4e4}
.skipped{color:#6b5500;background:#fdf3d1}.info{color:#555;background:#eee}
table{border-collapse:collapse;margin:8px 0;font-size:12.5px}
th,td{border-bottom:1px solid #dde;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f8}td.num{text-align:right;font-variant-numeric:tabular-nums}
table.summary{width:100%}table.summary td:nth-child(2){white-space:nowrap}
table.summary td:first-child a{color:inherit}
.what{max-width:900px}.notes{color:#445;font-size:12.5px}.reason{font-weight:600}
.figures{display:flex;flex-wrap:wrap;gap:10px}.figures img{max-width:540px;width:100%;
 border:1px solid #eee}
pre{background:#f6f7f9;padding:6px 10px;white-space:pre-wrap;word-break:break-all}
@media print{body{max-width:none;font-size:11px}section,figure,tr,.figures img{
 break-inside:avoid}h2{break-after:avoid}a{text-decoration:none}.badge{background:none}}
"""


INFO = (' <span class="badge info" title="about another library, not part of the verdict">'
        "informational</span>")


def esc(value) -> str:
    return html.escape(str(value))


def badge(verdict: str, label: str, big: bool = False) -> str:
    cls = {PASSED: "passed", FAILED: "failed", SKIPPED: "skipped"}.get(verdict, verdict)
    return f'<span class="badge {cls}{" big" if big else ""}">{esc(label)}</span>'


def cell(value) -> str:
    if isinstance(value, bool):
        return "<td>yes</td>" if value else "<td><b>no</b></td>"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and math.isnan(value):
            return '<td class="num">—</td>'
        return f'<td class="num">{value:.4g}</td>'
    return f"<td>{esc(value)}</td>"


def table_html(df, cls: str = "") -> str:
    if df is None or not len(df):
        return ""
    head = "".join(f"<th>{esc(c)}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>"
                   for row in df.itertuples(index=False))
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def summary_html(sections) -> str:
    rows = []
    for i, s in enumerate(sections):
        label = badge(s.verdict, s.label) + ("" if s.must_pass else INFO)
        rows.append(f'<tr><td><a href="#s{i}">{esc(s.title)}</a></td><td>{label}</td>'
                    f"<td>{esc(s.finding)}</td><td>{esc(s.key_number)}</td></tr>")
    head = "<tr><th>check</th><th>verdict</th><th>finding</th><th>key number</th></tr>"
    return f'<table class="summary" id="summary"><thead>{head}</thead><tbody>' \
           f'{"".join(rows)}</tbody></table>'


def section_html(i: int, s) -> str:
    parts = [f'<section id="s{i}"><h2>{esc(s.title)} {badge(s.verdict, s.label)}</h2>']
    if s.what:
        parts.append(f'<p class="what">{esc(s.what)}</p>')
    if not s.must_pass:
        parts.append('<p class="notes">Informational: a finding about another library, '
                     "not part of the workbench's verdict.</p>")
    if s.verdict == SKIPPED:
        parts.append(f'<p class="reason">Skipped, not counted as passed: {esc(s.reason)}</p>')
    if s.figures:
        imgs = "".join(f'<img alt="{esc(s.title)}: figure {k + 1}" src="data:image/png;base64,'
                       f'{base64.b64encode(png).decode()}">' for k, png in enumerate(s.figures))
        parts.append(f'<div class="figures">{imgs}</div>')
    parts.append(table_html(s.table))
    if s.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in s.notes)
                     + "</ul>")
    return "".join(parts) + "</section>"


def provenance_html(p: dict) -> str:
    git = p.get("git")
    code = (f"{git['commit']}{' (with uncommitted changes)' if git['dirty'] else ''}"
            if git else "not run from a git checkout")
    rows = [("git commit", code), ("date", p["date"]),
            *((f"version: {k}", v) for k, v in p["versions"].items()),
            *((f"machine: {k}", v) for k, v in p["machine"].items()),
            *((f"setting: {k}", v) for k, v in p["settings"].items()),
            *((f"seed: {k}", v) for k, v in p["seeds"].items())]
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return (f'<section id="provenance"><h2>Provenance</h2><p>Reproduce this report with:</p>'
            f"<pre>{esc(p['command'])}</pre><table>{body}</table></section>")


def render_html(document: dict, sections: list) -> str:
    """The page for ``document`` (from ``report_json.report_document``) and its sections."""
    c, p = document["counts"], document["provenance"]
    verdict = PASSED if document["passed"] else FAILED
    extra = (f" · {c['informational']} informational finding(s) about other libraries"
             if c["informational"] else "")
    commit = (p.get("git") or {}).get("commit", "")[:10] or "no git checkout"
    head = (f'<header><h1>{esc(document["title"])}</h1><p class="verdict" id="verdict">'
            f'{badge(verdict, document["verdict"], big=True)} {c["passed"]} passed · '
            f'{c["failed"]} failed · {c["skipped"]} skipped (skipped never counts as passed)'
            f'{esc(extra)}</p><p class="meta">{esc(p["date"])} · commit {esc(commit)} · '
            f'workbench {esc(p["versions"]["workbench"])} · <a href="#provenance">provenance'
            f"</a></p></header>")
    body = "".join(section_html(i, s) for i, s in enumerate(sections))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{esc(document["title"])}: '
            f'{document["verdict"]}</title><style>{CSS}</style></head><body>{head}'
            f"{summary_html(sections)}{body}{provenance_html(p)}</body></html>")
