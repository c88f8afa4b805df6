"""Report kinds for the claim audit and the record-influence audit, and their sections.

``ClaimAudit`` (``claim_audit.py``) is the report's cover: the claim under test and one
verdict per element; its evidence's results follow as sections of the subject.
``InfluenceAudit`` (``influence.py``): the largest change of the noiseless released sum when
one record is removed or replaced, against C. ``influence_sections`` builds the headless job's
sections: the engine (or the user's --model with their loss, or a --step) must pass; a naive
DP step on each coupling case of ``bug_zoo_coupling`` must be caught (a self-check).
"""

import pandas as pd
import torch

from workbench.audit import bug_zoo_coupling as coupling
from workbench.audit.influence import RELATIONS, audit_record_influence, change_text
from workbench.audit.influence_steps import (
    engine_released_sum,
    influence_pool,
    median_norm,
    naive_released_sum,
    step_released_sum,
)
from workbench.audit.report import SELF_CHECK, Kind, register_kind, section
from workbench.audit.result import AuditResult, Crashed
from workbench.viz.audit import plot_record_influence


def _influence_table(result):
    t = result.table
    wide = t.pivot(index="record", columns="relation", values="change_over_C")
    wide = wide.apply(lambda col: col.map(
        lambda v, bound=RELATIONS[col.name]: change_text(v, bound))).reset_index()
    return wide, [f"Change of the noiseless released sum when record i is removed (add/remove, "
                  f"bound 1 C) or replaced by a spare record (substitution, bound 2 C), in units "
                  f"of C = {result.max_grad_norm:g}; the sums hold {result.compared} "
                  f"(per_sample/precision.py)."]


register_kind("InfluenceAudit", Kind(
    what="One record is removed (or replaced) and the noiseless released sums are compared: "
         "the change must be that record's own clipped gradient, at most C (2C when replaced), "
         "whatever the model, the loss and the randomness. A loss or model that couples records "
         "(class weights or a token mean normalised over the batch, InfoNCE, batch statistics) "
         "moves the others' contributions too, and the noise no longer covers it.",
    summary=lambda r: (r.summary, f"max {change_text(r.worst('add/remove'), 1.0)} C "
                                  f"(add/remove)"),
    table=_influence_table, figures=(plot_record_influence,)))


register_kind("ClaimAudit", Kind(
    what="The privacy claim under test, element by element (unit of privacy, neighbouring "
         "relation, sampler, step, ε, δ, what the accounting covers, the trained model), each "
         "with the evidence that supports or refutes it. \"Not checked\" and \"stated\" are "
         "never support.",
    summary=lambda r: (r.summary, f"{int((r.table['verdict'] == 'refuted').sum())} refuted"),
    table=lambda r: (r.table, [])))


class CouplingSuite(AuditResult):
    """A naive DP step on every coupling case: ``passed`` when each one is caught."""

    def __init__(self, audits: dict):
        self.audits = audits
        self.table = pd.DataFrame([{
            "case": k, "what couples the records": coupling.DOCS[k],
            "largest change (add/remove)": f"{change_text(a.worst('add/remove'), 1.0)} C",
            "caught": not a.passed, "passed": not a.passed} for k, a in audits.items()])
        self.passed = bool(audits) and not any(a.passed for a in audits.values())
        self.summary = f"{int(self.table['caught'].sum())} of {len(self.table)} coupling " \
                       f"cases caught"


register_kind("CouplingSuite", Kind(
    what="The record-influence audit must see every way a loss or a model couples records; "
         "each case of workbench.audit.bug_zoo_coupling runs through a naive DP step (per-record "
         "terms of the loss taken at face value) and must break the bound.",
    summary=lambda s: (s.summary, ""), table=lambda s: (s.table.drop(columns="passed"), [])))


def influence_sections(case, loss_fn, user_steps: dict, C: float, B: int,
                       engine_part: str) -> list:
    """The record-influence sections: the engine on ``case`` = (name, model, inputs, targets)
    (n + 1 records, the last one the substitute) with ``loss_fn``, each --step, and the
    coupling self-check."""
    name, model, x, y = case
    n = min(len(x) - 1, 8)
    x, y = x[:n + 1], y[:n + 1]
    try:  # C at the median norm: some records clipped, some not
        c = median_norm(model, loss_fn, x, y)
    except Exception:  # noqa: BLE001  (the engine's own section will show the error)
        c = C
    released = engine_released_sum(model, loss_fn, x, y, c)
    out = [section(f"Record influence: workbench engine on {name}",
                   _guarded(released, n, c, name), part=engine_part)]
    for spec, factory in user_steps.items():
        G = influence_pool(B, 32, C, torch.Generator().manual_seed(0))
        out.append(section(f"Record influence: your step {spec}", _guarded(
            step_released_sum(factory, G, C, B), B, C, spec)))
    audits = {}
    for name, build in coupling.COUPLING.items():
        model, loss, x, y, c = build()
        audits[name] = audit_record_influence(naive_released_sum(model, loss, x, y, c),
                                              coupling.N, max_grad_norm=c, name=name,
                                              relations=("add/remove",))
    out.append(section("Record influence: a naive step on each coupled loss must be caught",
                       CouplingSuite(audits), part=SELF_CHECK))
    return out


def _guarded(released, n, C, name):
    try:
        return audit_record_influence(released, n, max_grad_norm=C, name=name)
    except Exception as err:  # noqa: BLE001  (the code under audit raised: a finding)
        return Crashed(err)


__all__ = ["CouplingSuite", "influence_sections"]
