"""``report.json``: the audit report for machines, documented by a JSON Schema in the package.

The schema (``report.schema.json`` beside this file, ``SCHEMA_PATH``) describes every field;
``schema_version`` changes its major number when a field is removed or changes meaning, its
minor number when fields are added. ``validate`` checks a document against the schema (needs
the ``jsonschema`` package, in the dev extra). NaN and infinities become ``null``.
"""

import json
import math
from pathlib import Path

from workbench.audit.report import overall

SCHEMA_VERSION = "1.1"  # 1.1: part, by_part, not applicable, claim, subject, cpu_model
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


def _clean(value):
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, recursively."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def _records(table) -> list:
    if table is None or not len(table.columns):
        return []
    return [_clean(r) for r in table.to_dict(orient="records")]


def section_json(s) -> dict:
    return {"title": s.title, "what": s.what, "verdict": s.verdict, "label": s.label,
            "passed": s.verdict == "passed", "skipped": s.verdict == "skipped",
            "must_pass": s.must_pass, "reason": s.reason, "finding": s.finding,
            "key_number": s.key_number, "notes": list(s.notes), "figures": len(s.figures),
            "part": s.part, "table": _records(s.data if s.data is not None else s.table)}


def claim_json(audit) -> dict | None:
    """The claim under test and one verdict per element (None without a claim)."""
    if audit is None:
        return None
    return {"claim": _clean(audit.claim.as_dict()), "refuted": not audit.passed,
            "elements": _records(audit.table), "epsilons": _records(audit.epsilons)}


def subject(sections, provenance, audit) -> str:
    """What is audited, in one line: the claim's subject, the user's code, or the workbench."""
    named = getattr(getattr(audit, "claim", None), "subject", "")
    settings = provenance.get("settings", {})
    code = [f"{k} {settings[k]}" for k in ("model", "step", "provider", "loader")
            if settings.get(k) not in (None, "None", "[]")]
    return named or "; ".join(code) or "the DP-SGD Workbench itself (its engine and methods)"


def report_document(sections: list, provenance: dict, title: str, claim=None) -> dict:
    verdict = overall(sections)
    return {"schema_version": SCHEMA_VERSION, "title": title, **verdict,
            "subject": subject(sections, provenance, claim), "claim": claim_json(claim),
            "provenance": _clean(provenance), "sections": [section_json(s) for s in sections]}


def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate(document: dict) -> None:
    """Raise ``jsonschema.ValidationError`` if ``document`` does not follow the schema."""
    import jsonschema

    jsonschema.validate(document, schema())


def write_json(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False, allow_nan=False),
                    encoding="utf-8")
    return path


__all__ = [
    "SCHEMA_PATH", "SCHEMA_VERSION", "claim_json", "report_document", "schema", "section_json",
    "subject", "validate", "write_json",
]
