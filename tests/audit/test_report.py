"""The report's section protocol: honest verdicts, one registration per kind, tables without
noise. (report.json and its schema: test_report_json.py; the CLI: test_cli.py.)"""

import math

import pandas as pd
import pytest

from tests.audit.report_helpers import small_sections
from workbench.audit import AuditResult
from workbench.audit.report import (
    FAILED,
    KINDS,
    PASSED,
    SKIPPED,
    Kind,
    Skipped,
    overall,
    register_kind,
    section,
)


@pytest.fixture(scope="module")
def sections():
    return {s.title: s for s in small_sections()}


def test_verdicts_are_honest(sections):
    assert sections["gradients"].verdict == PASSED
    assert sections["library swapped"].verdict == FAILED  # the swapped provider is caught
    absent = sections["library absent"]
    assert absent.verdict == SKIPPED and absent.label == "SKIPPED"
    assert "pip install nolib" in absent.reason and "not run" in absent.finding
    leak = sections["leak"]  # a no-noise step: the canary bound must exceed ε, and does
    assert leak.verdict == PASSED and leak.label == "caught"


def test_skipped_never_counts_as_passed():
    skipped = [section("a", Skipped("lib missing")), section("b", Skipped("model unsupported"))]
    verdict = overall(skipped)
    assert verdict["counts"] == {"passed": 0, "failed": 0, "informational": 0, "skipped": 2,
                                 "not_applicable": 0}
    assert verdict["skipped"] == ["a", "b"]
    with pytest.raises(TypeError):
        Skipped()  # a skip without its reason is not allowed


def test_overall_fails_on_must_pass_only(sections):
    verdict = overall(list(sections.values()))
    assert verdict["passed"] and verdict["verdict"] == "PASSED"
    assert verdict["informational_failures"] == ["library swapped"]
    assert verdict["counts"]["failed"] == 0 and verdict["counts"]["skipped"] == 1
    broken = section("must", Skipped("x"))
    broken.verdict = FAILED
    assert overall([broken])["failed"] == ["must"]


def test_a_bug_that_is_not_caught_fails():
    class Clean(AuditResult):  # an audit that passed where it had to fail
        passed, table, summary = True, pd.DataFrame({"passed": [True]}), "clean"

    s = section("bug", Clean(), expect_failure=True)
    assert s.verdict == FAILED and s.label == "NOT CAUGHT"


def test_a_new_audit_is_one_registration():
    class ToyAudit(AuditResult):  # a name no real audit uses: the registry is global
        passed, table = False, pd.DataFrame({"test": ["sizes"], "p_value": [1e-9]})
        summary = "toy sampling audit FAILED"

    def plot(ax, result):
        return ax.plot([0, 1], [0, 1])

    try:
        register_kind("ToyAudit", Kind(
            what="Batches are Poisson.", figures=(plot,),
            summary=lambda r: ("batch sizes are not Binomial", f"p {r.table.p_value[0]:.0e}")))
        s = section("sampling", ToyAudit())
    finally:
        del KINDS["ToyAudit"]
    assert (s.what, s.verdict, s.finding, s.key_number) == (
        "Batches are Poisson.", FAILED, "batch sizes are not Binomial", "p 1e-09")
    assert len(s.figures) == 1 and s.figures[0][:4] == b"\x89PNG"


def test_an_unregistered_result_still_gets_an_honest_section():
    class Custom(AuditResult):
        """Checks something custom."""
        passed, table, summary = True, pd.DataFrame({"x": [1]}), "all good"

    s = section("custom", Custom())
    assert (s.what, s.verdict, s.finding, s.key_number) == (
        "Checks something custom.", PASSED, "all good", "")
    assert s.figures == []


def test_a_result_outside_the_protocol_is_refused_by_name():
    class Loose:  # duck-typed: passed and table, but not an AuditResult
        passed, table = True, pd.DataFrame({"x": [1]})

    with pytest.raises(TypeError, match="section 'loose': the result must be an AuditResult.*"
                                        "got Loose. Subclass workbench.audit.AuditResult"):
        section("loose", Loose())


def test_gradient_table_has_no_unexplained_nan(sections):
    s = sections["gradients"]
    table = s.table[s.table["model"] == "mlp"]
    assert list(table["method"]) == ["einsum", "bookkeeping"]
    assert not table.isna().any().any()
    assert table.loc[table["method"] == "bookkeeping", "compared"].item() == "clipped sum only"
    assert math.isnan(s.data.loc[s.data["method"] == "bookkeeping", "norm_rel_error"].iloc[0])
    assert any("Book-keeping" in n and "null" in n for n in s.notes)  # the NaN, explained
    tolerance_notes = [n for n in s.notes if "Tolerance" in n]
    assert len(tolerance_notes) == 1 and "tolerance_reason" not in table.columns


def test_mechanism_table_states_the_significance_once(sections):
    s = sections["step"]
    assert "threshold" not in s.table.columns
    assert s.table.set_index("check").loc["sensitivity", "p-value"] == "— (a bound)"
    assert sum("Bonferroni" in n for n in s.notes) == 1
    assert "variance ratio" in s.key_number and len(s.figures) == 2  # band and QQ plot


def test_every_built_in_kind_draws_its_figures(sections):
    expected = {"gradients": 1, "step": 2, "clipping": 1, "zoo": 1, "canary": 2,
                "accountants": 1}
    assert {k: len(sections[k].figures) for k in expected} == expected


def test_sampling_and_gaussian_sections_have_findings_and_key_numbers():
    from workbench.audit.report_more_kinds import privacy_extras

    sections = privacy_extras(seed=0)
    assert [s.label for s in sections] == ["passed", "caught", "passed", "caught"]
    assert all(s.finding and s.key_number for s in sections)


def test_a_library_that_cannot_run_a_model_is_not_applicable(sections):
    whole, part = sections["library picky on mlp"], sections["library picky"]
    assert whole.verdict == "not applicable" and "picky has no rule for Tanh" in whole.reason
    assert whole.part == "library" and not whole.must_pass
    assert part.verdict == PASSED and "not applicable on mlp" in part.finding
    assert (part.table["passed"] == "not applicable").sum() == 1
    counts = overall(list(sections.values()))["by_part"]["library"]
    assert counts["not_applicable"] == 1 and counts["failed"] == 0


def test_a_row_that_raised_is_drawn_as_raised_not_at_a_height():
    import torch
    from matplotlib.figure import Figure
    from torch import nn

    from workbench.audit.gradients import audit_gradients
    from workbench.audit.report_suites import GradientSuite
    from workbench.viz.audit import plot_gradient_errors

    def broken(model, loss_fn, inputs, targets):
        raise RuntimeError("no")

    torch.manual_seed(0)
    audit = audit_gradients(nn.Sequential(nn.Linear(3, 2)), nn.CrossEntropyLoss(reduction="none"),
                            torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), methods=("einsum",),
                            providers={"broken": broken})
    ax = Figure().add_subplot()
    artists = plot_gradient_errors(ax, GradientSuite({"m": audit}, ("einsum", "broken")))
    texts = [a.get_text() for a in artists if hasattr(a, "get_text")]
    assert any(t.startswith("raised") for t in texts)
    points = [a.get_offsets() for a in artists if hasattr(a, "get_offsets")]
    heights = [float(y) for p in points for y in p[:, 1]]
    floor = 1e-18  # exact agreement is drawn at the floor; nothing higher is invented
    assert heights and max(heights) <= max(floor, float(audit.table["max_rel_error"].max()))


def test_bug_zoo_green_means_caught(sections):
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    from tests.audit.report_helpers import mechanism
    from workbench.audit import bug_zoo
    from workbench.audit.report_suites import BugZooSuite
    from workbench.viz.audit import plot_bug_zoo

    assert sections["zoo"].part == "self-check" and sections["zoo"].verdict == PASSED
    audits = {"no_noise": mechanism(bug_zoo.no_noise)}
    (image,) = plot_bug_zoo(Figure().add_subplot(), BugZooSuite(audits, {"no_noise": "x"}))
    colours = {to_hex(image.cmap(image.norm(v))) for v in image.get_array()[0]}
    assert "#2ca02c" in colours and "#d62728" not in colours  # green: caught; no red row


@pytest.mark.parametrize("verdict, caught", [("failed", True), ("inconclusive", False)])
def test_a_bug_is_caught_only_by_a_failed_check(verdict, caught):
    """A self-check that must catch a bug (``expect_failure``) read "caught" whenever the audit
    did not pass: an inconclusive run (too few steps to resolve anything) caught nothing."""
    from dataclasses import dataclass

    from workbench.audit.report import FAILED, PASSED, SELF_CHECK, section

    @dataclass
    class Run(AuditResult):
        verdict: str

        @property
        def passed(self):
            return self.verdict == "passed"

        @property
        def table(self):
            return pd.DataFrame({"check": ["x"], "passed": [self.verdict != "failed"]})

        @property
        def summary(self):
            return self.verdict

    made = section("a wrong step", Run(verdict), expect_failure=True, part=SELF_CHECK,
                   figures=False)
    assert made.verdict == (PASSED if caught else FAILED)
