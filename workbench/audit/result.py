"""The one protocol every audit result follows: ``passed``, ``table``, ``summary``, HTML repr.

An audit answers a yes/no question with numbers behind it. Every result class of
``workbench.audit`` (and any audit of your own that the report should show) subclasses
:class:`AuditResult` and provides three things, as fields or properties:

    passed   bool               the audit's own verdict
    table    pandas DataFrame   its numbers, one row per check (or per parameter, per test)
    summary  str                one line a person reads first ("... passed: ...")

and inherits ``_repr_html_`` (the summary in green or red over the table, for notebooks).
Optional: ``what`` (what it checks and why; the report otherwise uses the registered kind or
the class docstring) and ``skipped`` with ``reason`` (it could not run, and why; never passed).

The report (``workbench.audit.report``) relies on this protocol, not on attribute probing:
``section`` refuses an object that is not an :class:`AuditResult` (or a DataFrame with a
``passed`` column), naming its type and the fix. Plots live in ``workbench.viz``.

>>> import pandas as pd
>>> class Toy(AuditResult):
...     passed, table, summary = True, pd.DataFrame({"x": [1.0]}), "toy audit passed"
>>> Toy()._repr_html_()[:46]
'<p style="color:green"><b>toy audit passed</b>'
"""

import html

import pandas as pd


class AuditResult:
    """Base of every audit result: subclasses give ``passed``, ``table`` and ``summary``.

    No dataclass fields here, so a ``@dataclass`` subclass may declare any of the three as a
    field (``passed: bool``) or compute it as a property.
    """

    passed: bool
    table: pd.DataFrame
    summary: str
    what: str = ""  # what it checks and why (optional)
    skipped: bool = False  # it could not run; then ``reason`` (a str) says why
    float_format = "{:.3g}"  # how the HTML table prints floats

    def _repr_html_(self) -> str:
        color = "green" if self.passed and not self.skipped else "red"
        head = f'<p style="color:{color}"><b>{html.escape(str(self.summary))}</b></p>'
        return head + self.table.to_html(index=False, float_format=self.float_format.format)


class Crashed(AuditResult):
    """The code under audit raised: a FAILED section that shows the error."""

    def __init__(self, error: Exception):
        self.passed, self.summary = False, f"raised {type(error).__name__}: {error}"
        self.table = pd.DataFrame([{"error": f"{type(error).__name__}: {error}"}])


__all__ = ["AuditResult", "Crashed"]
