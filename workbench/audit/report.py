"""The audit report's sections: one protocol for every audit, one registration per kind.

A *section* is an audit result under a title. Every result is an ``AuditResult``
(``workbench.audit.result``, the one protocol):

    .passed  bool                      the audit's own verdict
    .table   pandas DataFrame          its numbers
    .summary str                       its one-line finding
    .skipped bool, .reason str         (optional) it could not run, and why

and the report learns the rest (what the audit checks and why, the one-line finding, the key
number, a table without noise, figures) from the result's ``kind``, registered once by class
name::

    register_kind("SamplingAudit", Kind(
        what="Batches are Poisson: ... Why it matters: ...",
        summary=lambda r: ("inclusions look Poisson", f"min p {r.table.p_value.min():.2g}"),
        figures=(plot_sampling,)))          # plot_x(ax, result) -> artists, workbench.viz

An unregistered result still gets a section: its ``.summary`` is the finding, its ``.what``
or docstring says what it checks, no key number and no figure.

Verdicts are honest: a skipped section is SKIPPED with its reason and never counts as passed
(nor does a library's "not applicable": it cannot run the model, e.g. Opacus on the
workbench's own DPLSTM);
a section whose audit is *expected* to fail (a bug the audit must catch) reads "caught" when it
fails and "NOT CAUGHT" otherwise; ``must_pass=False`` marks findings about other libraries,
reported but not part of the overall verdict.
"""

import io
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
from matplotlib.figure import Figure

from workbench.audit.result import AuditResult

PASSED, FAILED, SKIPPED, NOT_APPLICABLE = "passed", "failed", "skipped", "not applicable"
SUBJECT, SELF_CHECK, LIBRARY = "subject", "self-check", "library"
PARTS = {SUBJECT: "What is audited", SELF_CHECK: "Appendix A: the tool's self-checks",
         LIBRARY: "Appendix B: other libraries"}
"""part -> heading: the subject's results first; the audit proving its own power (bugs it must
catch, the reference step) and other libraries (informational) in appendices, counted apart."""


@dataclass(frozen=True)
class Kind:
    """How the report presents one kind of audit result."""

    what: str  # what it checks and why, two sentences
    summary: Callable  # result -> (finding: str, key number: str)
    table: Callable | None = None  # result -> (DataFrame for people, [notes stated once])
    figures: tuple = ()  # plot_x(ax, result) -> artists, each drawn on its own axes
    figsize: tuple = (6.4, 3.2)


KINDS: dict[str, Kind] = {}


def register_kind(class_name: str, kind: Kind) -> Kind:
    """Present results whose class (or a base class) is named ``class_name`` with ``kind``."""
    KINDS[class_name] = kind
    return kind


def kind_of(result) -> Kind | None:
    """The registered kind of ``result``'s class or a base class (the built-in kinds are
    registered by ``report_kinds.py`` and ``report_claim_kinds.py``, which ``workbench.audit``
    imports before any of its modules is used)."""
    for cls in type(result).__mro__:
        if cls.__name__ in KINDS:
            return KINDS[cls.__name__]
    return None


@dataclass
class Skipped(AuditResult):
    """An audit that could not run: never passed, always with the reason."""

    reason: str
    what: str = ""
    skipped: bool = True
    passed: bool = False
    table: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def summary(self) -> str:
        return f"not run: {self.reason}"


@dataclass
class Section:
    title: str
    what: str
    verdict: str  # PASSED, FAILED, SKIPPED or NOT_APPLICABLE
    finding: str
    key_number: str
    table: pd.DataFrame  # what people read
    notes: list  # tolerances and column meanings, stated once
    must_pass: bool  # counts toward the overall verdict
    reason: str = ""  # why it was skipped
    data: pd.DataFrame | None = None  # the full numbers (report.json)
    figures: list = field(default_factory=list)  # PNG bytes
    words: tuple = ("passed", "FAILED")  # how PASSED / FAILED read here
    part: str = SUBJECT  # SUBJECT, SELF_CHECK or LIBRARY

    @property
    def label(self) -> str:
        if self.verdict in (SKIPPED, NOT_APPLICABLE):
            return self.verdict.upper() if self.verdict == SKIPPED else self.verdict
        return self.words[0] if self.verdict == PASSED else self.words[1]


def render_png(plot, result, figsize=(6.4, 3.2), dpi=100) -> bytes:
    """``plot(ax, result)`` on a fresh off-screen Figure (no pyplot), as PNG bytes."""
    fig = Figure(figsize=figsize, dpi=dpi)
    plot(fig.add_subplot(), result)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _summary(result, kind):
    if kind is not None:  # the registered kind is the report's view of the result
        return kind.summary(result)
    return str(result.summary), ""


def section(title: str, result, must_pass: bool = True, expect_failure: bool = False,
            figures: bool = True, part: str | None = None) -> Section:
    """The report section of ``result`` (an audit result, a :class:`Skipped` or a DataFrame
    with a ``passed`` column). ``expect_failure``: the audit must *catch* this (a bug).
    ``part``: SUBJECT, SELF_CHECK or LIBRARY (default: LIBRARY when not ``must_pass``)."""
    part = part or (SUBJECT if must_pass else LIBRARY)
    if part not in PARTS:
        raise ValueError(f"section {title!r}: part must be one of {sorted(PARTS)}; got {part!r}")
    made = _section(title, result, must_pass, expect_failure, figures)
    made.part = part
    return made


def _section(title, result, must_pass, expect_failure, figures):
    if isinstance(result, pd.DataFrame):
        return _table_section(title, result, must_pass)
    if not isinstance(result, AuditResult):
        raise TypeError(f"section {title!r}: the result must be an AuditResult or a DataFrame "
                        f"with a 'passed' column; got {type(result).__name__}. Subclass "
                        f"workbench.audit.AuditResult and give it passed, table and summary")
    kind = kind_of(result)
    what = result.what or (kind.what if kind else "") or \
        (type(result).__doc__ or "").strip().split("\n\n")[0]
    if result.skipped:
        return Section(title, what, SKIPPED, result.summary, "", pd.DataFrame(),
                       [], must_pass, reason=str(result.reason))
    if getattr(result, "not_applicable", False) is True:  # nothing it could run on
        return Section(title, what, NOT_APPLICABLE, result.summary, "", result.table, [],
                       must_pass, reason=str(result.reason), data=result.table)
    passed = bool(result.passed)
    finding, key = _summary(result, kind)
    table, notes = kind.table(result) if kind and kind.table else (result.table, [])
    if expect_failure:  # caught: a check failed; an inconclusive run caught nothing
        verdict = getattr(result, "verdict", None)
        ok = verdict == "failed" if verdict in ("passed", "failed", "inconclusive") else not passed
    else:
        ok = passed
    words = ("caught", "NOT CAUGHT") if expect_failure else ("passed", "FAILED")
    pngs = [render_png(p, result, kind.figsize) for p in kind.figures] if kind and figures else []
    return Section(title, what, PASSED if ok else FAILED, finding, key, table, list(notes),
                   must_pass, data=result.table, figures=pngs, words=words)


def _table_section(title, table, must_pass):
    passed = bool(table["passed"].all())
    finding = f"{int(table['passed'].sum())} of {len(table)} rows pass"
    return Section(title, "", PASSED if passed else FAILED, finding, "", table, [], must_pass,
                   data=table)


def counts(sections: list) -> dict:
    """Sections by verdict: passed, failed (must_pass), informational (failed, not must_pass),
    skipped, not applicable."""
    return {"passed": sum(s.verdict == PASSED for s in sections),
            "failed": sum(s.must_pass and s.verdict == FAILED for s in sections),
            "informational": sum(not s.must_pass and s.verdict == FAILED for s in sections),
            "skipped": sum(s.verdict == SKIPPED for s in sections),
            "not_applicable": sum(s.verdict == NOT_APPLICABLE for s in sections)}


def overall(sections: list) -> dict:
    """The report's verdict: FAILED if a must-pass section failed (the subject's, or a
    self-check: then the tool cannot be trusted). Counted per part (``by_part``) so the
    subject's results never mix with the tool's self-checks and other libraries; skipped and
    not-applicable sections never count as passed."""
    failed = [s.title for s in sections if s.must_pass and s.verdict == FAILED]
    findings = [s.title for s in sections if not s.must_pass and s.verdict == FAILED]
    skipped = [s.title for s in sections if s.verdict == SKIPPED]
    by_part = {part: counts([s for s in sections if s.part == part]) for part in PARTS}
    return {"verdict": "FAILED" if failed else "PASSED", "passed": not failed,
            "counts": counts(sections), "by_part": by_part,
            "failed": failed, "informational_failures": findings, "skipped": skipped}


__all__ = [
    "KINDS", "PARTS", "Kind", "Section", "Skipped", "counts", "kind_of", "overall", "register_kind",
    "render_png", "section",
]
