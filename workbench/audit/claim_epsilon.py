"""ε of a claim recomputed by every accountant at hand: the workbench's and other libraries'.

The workbench's registered accountants (``accounting.ACCOUNTANTS``: RDP, PLD) compute ε of T
steps of the Poisson-sampled Gaussian mechanism under add/remove; dp-accounting (Google; RDP
and PLD, ``NeighboringRelation`` add/remove or replace-one) and Opacus (RDP, PRV) are used
when installed, each figure on its own row, so a claim is judged against more than one
implementation. A library that is absent, or cannot compute this case (Opacus has no
substitution relation), is a row that says why, never a number.

For fixed-size batches (``sampler`` shuffle or deterministic) the Poisson figures do not
apply: ``accounting.epsilon_bounds`` brackets the true ε (Chua et al. 2024's lower bound for
shuffling; the deterministic upper bound). Tuning: k runs compose, ε of k·T steps.
"""

import math

import pandas as pd

from workbench import accounting
from workbench.bench.accounting import have as _installed  # the one "is it importable" check


def _dp_accounting(kind, q, sigma, steps, delta, relation):
    import dp_accounting as dpa

    rel = (dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if relation == "add/remove"
           else dpa.NeighboringRelation.REPLACE_ONE)
    acc = (dpa.rdp.RdpAccountant(neighboring_relation=rel) if kind == "RDP" else
           dpa.pld.PLDAccountant(neighboring_relation=rel, value_discretization_interval=1e-3))
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(
        sigma)), steps))
    return float(acc.get_epsilon(delta))


def _opacus(kind, q, sigma, steps, delta, relation):
    if relation != "add/remove":
        raise NotImplementedError("Opacus accounts add/remove only")
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = RDPAccountant() if kind == "RDP" else PRVAccountant()
    acc.history = [(sigma, q, steps)]
    return float(acc.get_epsilon(delta))


LIBRARIES = {"dp-accounting": ("dp_accounting", _dp_accounting, ("RDP", "PLD")),
             "Opacus": ("opacus", _opacus, ("RDP", "PRV"))}


def epsilon_figures(claim) -> pd.DataFrame:
    """One row per accountant: source, accountant, relation, ε (None with a note if n/a)."""
    q, sigma, delta = claim.q, claim.noise_multiplier, claim.delta
    steps = claim.total_steps * claim.tuning_runs
    rows = []
    for name, spec in accounting.ACCOUNTANTS.items():
        ok = claim.neighbouring == "add/remove"
        rows.append({"source": "workbench", "accountant": spec.label, "key": name,
                     "relation": "add/remove",
                     "epsilon": accounting.epsilon(q, sigma, steps, delta, accountant=name)
                     if ok else None,
                     "note": "" if ok else "add/remove only; the claim is substitution"})
    return pd.DataFrame(rows + library_rows(q, sigma, steps, delta, claim.neighbouring))


def library_rows(q, sigma, steps, delta, relation="add/remove") -> list:
    """One row per other library's accountant: ε, or None with a note (absent, n/a)."""
    rows = []
    for lib, (module, fn, kinds) in LIBRARIES.items():
        for kind in kinds:
            row = {"source": lib, "accountant": kind, "key": "", "relation": relation,
                   "epsilon": None, "note": ""}
            if not _installed(module):
                row["note"] = f"not installed (pip install {lib.lower()})"
            else:
                try:
                    row["epsilon"] = fn(kind, q, sigma, steps, delta, relation)
                except Exception as err:  # noqa: BLE001  (the library cannot do this case)
                    row["note"] = f"not applicable: {type(err).__name__}: {err}"
            rows.append(row)
    return rows


AGREEMENT = 0.03  # relative: RDP implementations agree to rounding; PLD/PRV discretise
SAME_KIND = {"RDP": "rdp", "PLD": "pld", "PRV": "pld"}  # library accountant -> workbench's


def compare_libraries(q, sigma, steps, delta) -> pd.DataFrame:
    """The other libraries' ε beside the workbench's accountant of the same kind (informational:
    ``passed`` when within 3% relative); empty when none is installed."""
    rows = []
    for row in library_rows(q, sigma, steps, delta):
        if row["epsilon"] is None:
            continue
        ours = accounting.epsilon(q, sigma, steps, delta, accountant=SAME_KIND[row["accountant"]])
        rows.append({"library": row["source"], "accountant": row["accountant"], "q": q,
                     "sigma": sigma, "steps": steps, "delta": delta,
                     "epsilon": row["epsilon"], "workbench": ours,
                     "workbench accountant": SAME_KIND[row["accountant"]],
                     "passed": abs(row["epsilon"] - ours) <= AGREEMENT * ours})
    return pd.DataFrame(rows)


def bracket(claim, sampler: str, sensitivity: float = 1.0):
    """``accounting.epsilon_bounds`` for ``sampler`` at the claim's q, σ, epochs (rounded up
    to whole passes), δ and tuning runs (as epochs); ``sensitivity``: of one batch's sum in
    units of C (2 for substitution: the noise multiplier is then σ / 2)."""
    epochs = claim.total_epochs * claim.tuning_runs
    if sampler != "poisson":  # a pass begun is a pass (``round(E + 0.4999)`` dropped one
        # begun by less than 1e-4 of a pass until 2026-12-01: 20001 steps of 20000 a pass)
        epochs = max(1, math.ceil(epochs - 1e-12 * max(1.0, epochs)))
    return accounting.epsilon_bounds(sampler, sample_rate=claim.q,
                                     noise_multiplier=claim.noise_multiplier / sensitivity,
                                     epochs=epochs, delta=claim.delta)


__all__ = [
    "AGREEMENT", "LIBRARIES", "SAME_KIND", "bracket", "compare_libraries", "epsilon_figures",
    "library_rows",
]
