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

from workbench.audit.report import FAILED, NOT_APPLICABLE, PARTS, PASSED, SKIPPED

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
.skipped{color:#6b5500;background:#fdf3d1}.info,.na{color:#555;background:#eee}
.supported{color:#17632a;background:#e3f4e6}.refuted{color:#a4161a;background:#fde4e4}
.inconclusive,.not-checked,.stated{color:#555;background:#eee}
table{border-collapse:collapse;margin:8px 0;font-size:12.5px;max-width:100%}
th,td{border-bottom:1px solid #dde;padding:3px 8px;text-align:left;vertical-align:top;
 overflow-wrap:anywhere}
#cover{border:1px solid #ccd;border-radius:6px;padding:8px 14px;margin:8px 0}
#cover h2{border:0;margin:4px 0;padding:0}
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
    cls = {PASSED: "passed", FAILED: "failed", SKIPPED: "skipped",
           NOT_APPLICABLE: "na"}.get(verdict, verdict.replace(" ", "-"))
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
    rows, part = [], None
    for i, s in enumerate(sections):
        if s.part != part:
            part = s.part
            rows.append(f'<tr class="part"><th colspan="4">{esc(PARTS[part])}</th></tr>')
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
    if s.verdict == NOT_APPLICABLE:
        parts.append(f'<p class="reason">Not applicable (the library cannot run it; not a '
                     f"failure, not counted as passed): {esc(s.reason)}</p>")
    if s.figures:
        imgs = "".join(f'<img alt="{esc(s.title)}: figure {k + 1}" src="data:image/png;base64,'
                       f'{base64.b64encode(png).decode()}">' for k, png in enumerate(s.figures))
        parts.append(f'<div class="figures">{imgs}</div>')
    parts.append(f'<div class="tablewrap">{table_html(s.table)}</div>')
    if s.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in s.notes)
                     + "</ul>")
    return "".join(parts) + "</section>"


def provenance_html(p: dict) -> str:
    git = p.get("git")
    code = (f"{git['commit']}{' (with uncommitted changes)' if git['dirty'] else ''}"
            if git else "not run from a git checkout")
    rows = [("git commit", code), ("uncommitted changes", "yes" if git and git["dirty"] else
                                   "no" if git else "—"), ("date", p["date"]),
            *((f"version: {k}", v) for k, v in p["versions"].items()),
            *((f"machine: {k}", v) for k, v in p["machine"].items()),
            *((f"setting: {k}", v) for k, v in p["settings"].items()),
            *((f"seed: {k}", v) for k, v in p["seeds"].items())]
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return (f'<section id="provenance"><h2>Provenance</h2><p>Reproduce this report with:</p>'
            f"<pre>{esc(p['command'])}</pre><table>{body}</table></section>")


def _count_line(c: dict) -> str:
    parts = [f"{c['passed']} passed", f"{c['failed'] + c['informational']} failed"]
    parts += [f"{c[k]} {k.replace('_', ' ')}" for k in ("skipped", "not_applicable") if c[k]]
    return " · ".join(parts)


def claim_html(claim) -> str:
    """The claim under test and one verdict per element (the report's cover)."""
    if not claim:
        return '<p id="claim">No privacy claim under test (pass --claim claim.yaml).</p>'
    c = claim["claim"]
    stated = "; ".join(f"{k} {v}" for k, v in c.items() if k != "subject")
    rows = "".join(
        f'<tr><td>{esc(e["element"])}</td><td>{esc(e["claimed"])}</td><td>'
        f'{badge(e["verdict"], e["verdict"])}</td><td>{esc(e["evidence"])}</td>'
        f'<td>{esc(e["finding"])}</td></tr>' for e in claim["elements"])
    head = "<tr><th>element</th><th>claimed</th><th>verdict</th><th>evidence</th>" \
           "<th>finding</th></tr>"
    return (f'<div id="claim"><p><b>Claim under test:</b> {esc(stated)}</p>'
            f'<table id="claim-elements" class="summary"><thead>{head}</thead><tbody>{rows}'
            f"</tbody></table></div>")


def render_html(document: dict, sections: list) -> str:
    """The page for ``document`` (from ``report_json.report_document``) and its sections."""
    p, by = document["provenance"], document["by_part"]
    verdict = PASSED if document["passed"] else FAILED
    git = p.get("git") or {}
    commit = (git.get("commit", "")[:10] + (" (uncommitted changes)" if git.get("dirty")
                                            else "")) or "no git checkout"
    counts = "".join(f'<li id="count-{part.replace(" ", "-")}">{esc(PARTS[part])}: '
                     f"{esc(_count_line(by[part]))}</li>" for part in PARTS)
    head = (f'<header><h1>{esc(document["title"])}</h1><section id="cover">'
            f'<p class="verdict" id="verdict">{badge(verdict, document["verdict"], big=True)} '
            f'<b>Audited:</b> <span id="subject">{esc(document["subject"])}</span></p>'
            f'{claim_html(document.get("claim"))}<ul class="counts">{counts}</ul>'
            f'<p class="notes">Skipped and not applicable never count as passed; the verdict '
            f"fails when the subject or a self-check fails, never on another library.</p>"
            f'<p class="meta">{esc(p["date"])} · commit {esc(commit)} · workbench '
            f'{esc(p["versions"]["workbench"])} · {esc(p["machine"].get("cpu_model", ""))} · '
            f'<a href="#provenance">provenance</a></p></section></header>')
    body, part = [], None
    for i, s in enumerate(sections):
        if s.part != part:
            part = s.part
            body.append(f'<h2 class="part" id="part-{part}">{esc(PARTS[part])}</h2>')
        body.append(section_html(i, s))
    body = "".join(body)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{esc(document["title"])}: '
            f'{document["verdict"]}</title><style>{CSS}</style></head><body>{head}'
            f"{summary_html(sections)}{body}{provenance_html(p)}</body></html>")


__all__ = [
    "CSS", "INFO", "badge", "cell", "claim_html", "esc", "provenance_html", "render_html",
    "section_html", "summary_html", "table_html",
]
