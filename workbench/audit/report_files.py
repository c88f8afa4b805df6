"""The audit report's files: ``report.html`` for people, ``report.json`` for machines.

The sections (``report.py``) are rendered by ``report_html.py`` and documented by
``report_json.py`` (its JSON Schema); this file writes both, the subject's sections first.
"""

from pathlib import Path

from workbench.audit.report import PARTS
from workbench.audit.report_html import render_html
from workbench.audit.report_json import report_document, write_json

__all__ = ["write_report"]


def write_report(out, sections: list, provenance: dict, title: str = "DP-SGD Workbench audit",
                 claim=None):
    """Write ``report.html`` and ``report.json`` into the folder ``out``; ``claim``: a
    ``ClaimAudit`` for the cover (the claim under test, one verdict per element).

    Returns (html path, json path, the JSON document)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    order = list(PARTS)
    sections = sorted(sections, key=lambda s: order.index(s.part))  # the subject first
    document = report_document(sections, provenance, title, claim)
    (out / "report.html").write_text(render_html(document, sections), encoding="utf-8")
    return out / "report.html", write_json(out / "report.json", document), document
