"""report.json validates against the JSON Schema shipped in the package; report.html is one
self-contained, printable file with the verdict and the summary first."""

import json
import re

import pytest

from tests.audit.report_helpers import small_provenance, small_sections
from workbench.audit.report_files import write_report
from workbench.audit.report_json import SCHEMA_PATH, SCHEMA_VERSION, schema, validate

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extra: "
                                 "pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    html_path, json_path, document = write_report(out, small_sections(), small_provenance())
    return html_path.read_text(encoding="utf-8"), json.loads(json_path.read_text()), document


def test_the_schema_is_shipped_and_is_a_valid_schema():
    assert SCHEMA_PATH.parent.name == "audit" and SCHEMA_PATH.exists()
    jsonschema.Draft202012Validator.check_schema(schema())


def test_report_json_validates(written):
    _, doc, _ = written
    validate(doc)
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["provenance"]["command"] == "python -m workbench audit --quick --out 'some dir'"
    skipped = [s for s in doc["sections"] if s["verdict"] == "skipped"]
    assert skipped and all(not s["passed"] and s["reason"] for s in skipped)


def test_nan_becomes_null(written):
    _, doc, _ = written
    rows = next(s for s in doc["sections"] if s["title"] == "gradients")["table"]
    book = [r for r in rows if r["method"] == "bookkeeping"]
    assert book and all(r["norm_rel_error"] is None for r in book)


def _verdict(d, verdict):
    return next(s for s in d["sections"] if s["verdict"] == verdict)


@pytest.mark.parametrize("breakage", [
    lambda d: _verdict(d, "skipped").update(passed=True),  # a skipped section that "passed"
    lambda d: _verdict(d, "skipped").update(reason=""),  # skipped without a reason
    lambda d: _verdict(d, "not applicable").update(passed=True),  # n/a counted as passed
    lambda d: _verdict(d, "passed").update(part="appendix"),  # a part that does not exist
    lambda d: d["by_part"].pop("library"),
    lambda d: d.pop("schema_version"),
    lambda d: d.update(verdict="OK"),
    lambda d: d["provenance"].update(command="make audit"),
])
def test_the_schema_rejects_dishonest_or_incomplete_reports(written, breakage):
    _, doc, _ = written
    doc = json.loads(json.dumps(doc))
    breakage(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def test_html_is_self_contained_and_printable(written):
    page, doc, _ = written
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing from a network
    assert page.count('src="data:image/png;base64,') == sum(s["figures"] for s in doc["sections"])
    assert "@media print" in page and ">nan<" not in page.lower()
    assert page.index('id="verdict"') < page.index('id="summary"') < page.index('id="s0"')
    assert "Skipped, not counted as passed: nolib is not installed" in page
    assert page.count("Bonferroni") == 1  # stated once in the mechanism section's notes
