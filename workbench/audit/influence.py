"""Record influence: does removing (or replacing) one record move the released sum by <= C?

The privacy of DP-SGD rests on one invariant (Abadi et al. 2016, arXiv 1607.00133, Alg. 1):
the released sum is Σ_i clip_C(g_i), each record's contribution its own and of norm <= C, so
for neighbouring batches A ~ A'

    add/remove     A' = A \\ {i}              ||S(A) - S(A')|| = ||clip_C(g_i)|| <= C
    substitution   A' = A with i -> j         ||S(A) - S(A')|| <= 2C

whatever the model, the loss and the randomness. A loss that couples records (class weights
normalised over the batch, a token mean over ``ignore_index`` labels, InfoNCE, logits centred
over the batch) or a model that mixes samples moves the *other* records' contributions too,
and the noise N(0, σ²C²) no longer covers the change.

``audit_record_influence(released_sum, n, max_grad_norm=C)`` measures it on any step, without
noise: ``released_sum(idx)`` returns the noiseless released sum (a Tensor, any shape) of the
records ``idx`` of a pool of n + 1 (the batch is records 0..n-1, record n the substitute).
Record i is put last in both batches, and torch's global RNG is seeded identically before each
call (``torch.random.fork_rng``), so the remaining records see the same dropout masks; the
audit first checks the replay (two calls on one batch must agree exactly) and raises if not.
What a step must provide: no noise (σ = 0, or noise from a generator re-seeded on every call
so that it cancels) and randomness only from torch's global RNG or a re-seeded generator.
Adapters for the engine, a naive step and a ``--step`` factory are in ``influence_steps.py``.

Tolerance: relative, the precision the released sums hold (``per_sample/precision.py``, the
one home of the comparisons' tolerances): the widest ``value_dtype`` of the sums the audit
computed, so a step that computes (or returns) in float32 is compared at float32's 1e-3, a
bfloat16 one at 5e-2, a float64 one at 1e-7. A correct float32 step moves the sum by
1.00000006 C, past the 1e-9 of float64 that every step was held to until 2026-12-01 (the claim
was then refuted, as coupling). The issue's ``ignore_index`` case is 1.005 C: seen in float64
and float32, not in bfloat16 (the summary states the tolerance it compared at).

**Randomness whose draws depend on the batch size.** Re-seeding replays a step exactly at one
batch size (substitution keeps n: always exact). Removing a record changes n, and a layer
whose random draws are not a prefix of the larger batch's (scaled-dot-product attention
dropout on some kernels, any fused dropout that draws per chunk) then gives the remaining
records other masks: S(A) − S(A') also holds the change of their contributions under a
redraw, so the correct engine could exceed C. The audit never calls that coupling: a step is
*stochastic* when two seeds give different sums on one batch, and its removal replays when
the random calls start from the same generator states at both sizes (``influence_replay``:
one Dropout does, two Dropout layers or attention dropout do not). An add/remove row of a
stochastic step that does not replay, above its bound, is compared with the **redraw floor**
F_i = ||S_s(A') − S_{s+1}(A')|| / C (the same batch, other draws): above bound + F_i it is
BROKEN (more than any redraw explains); within it, the step is rerun with every dropout
call the identity (``influence_twin``: dropout never couples records, the data path does):
a deterministic twin above the bound is BROKEN, anything else *inconclusive* (neither
verdict: rerun with dropout off, ``model.eval()`` or p = 0, for an exact one). ``passed``
needs every row to hold; ``broken`` is a verdict of coupling.

Notation: n batch size, C max_grad_norm, S(A) the noiseless released sum over batch A.
"""

import math
from dataclasses import dataclass

import pandas as pd
import torch

from workbench.audit.influence_replay import replays
from workbench.audit.influence_twin import twin
from workbench.audit.result import AuditResult
from workbench.checks import check_count, check_max_grad_norm
from workbench.per_sample.precision import TOLERANCE, tolerance_of, value_dtype, widest

RELATIONS = {"add/remove": 1.0, "substitution": 2.0}  # relation -> bound in units of C


@dataclass
class InfluenceAudit(AuditResult):
    """Per record and relation: ||S(A) - S(A')|| / C against its bound (1 or 2)."""

    table: pd.DataFrame  # record, relation, change_over_C, bound, floor_over_C, verdict, passed
    max_grad_norm: float
    name: str = ""
    tolerance: float = TOLERANCE[torch.float64]  # relative, of ``dtype`` (``tolerance_of``)
    stochastic: bool = False  # random draws that removing a record does not replay
    dtype: str = "float64"  # the precision the released sums hold (``value_dtype``)

    @property
    def passed(self) -> bool:
        return bool(self.table["passed"].all())

    @property
    def broken(self) -> bool:
        return bool((self.table["verdict"] == "BROKEN").any())

    @property
    def not_applicable(self) -> bool:
        """Inconclusive: neither passed nor broken (the report says so, not counted as
        passed and not as a failure)."""
        return not self.passed and not self.broken

    @property
    def reason(self) -> str:
        return self.summary

    def worst(self, relation: str) -> float:
        rows = self.table[self.table["relation"] == relation]
        return float(rows["change_over_C"].max()) if len(rows) else float("nan")

    @property
    def compared(self) -> str:
        """The precision the changes were compared at, in words."""
        return f"{self.dtype}: tolerance {self.tolerance:g} relative"

    @property
    def summary(self) -> str:
        parts = [f"{rel}: largest change {change_text(self.worst(rel), bound)} C (bound "
                 f"{bound:g} C)" for rel, bound in RELATIONS.items()
                 if rel in set(self.table["relation"])]
        verdict = "holds" if self.passed else "BROKEN" if self.broken else "inconclusive"
        text = f"record influence {verdict}: " + "; ".join(parts) + f" ({self.compared})"
        if verdict == "inconclusive":
            floor = float(self.table["floor_over_C"].max())
            text += (f". Stochastic layers draw other random numbers when the batch size "
                     f"changes (a redraw moves the sum by up to {floor:.3g} C), which hides "
                     f"an excess of that size; rerun with dropout off for an exact verdict")
        return text


def change_text(change: float, bound: float) -> str:
    """``change`` with the digits that show how far it is from ``bound``: 1.00000006, not the
    "1" that ``:.6g`` printed beside "bound 1 C" for a refuted claim until 2026-12-01."""
    off = abs(change / bound - 1) if bound else 0.0
    digits = 6 if not 1e-13 < off < 1e-5 else 2 + math.ceil(-math.log10(off))  # (float64's
    # own rounding, ~1e-16, is no excess)
    return f"{change:.{digits}g}"


def _replayed(released_sum, idx, seed, seen=None):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = released_sum(torch.as_tensor(idx, dtype=torch.long))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"released_sum(idx) must return a Tensor (the noiseless released sum); "
                        f"got {type(out).__name__}")
    out = out.detach().to("cpu")
    if seen is not None:  # the precision the sums hold: their tolerance
        seen.add(value_dtype(out))
    return out.to(torch.float64).reshape(-1)


def _twin_verdict(released_sum, first, others, i, seed, C, bound, state, tol) -> str:
    """BROKEN when the dropout-free twin (``influence_twin``) moves by more than the bound
    on removing record i; else inconclusive."""
    if "call" not in state:
        state["call"] = twin(_replayed, released_sum, first)
    call = state["call"]
    if call is None:
        return "inconclusive"
    delta = float((call(others + [i], seed) - call(others, seed)).norm()) / C
    return "BROKEN" if delta > bound * (1 + tol) else "inconclusive"


def audit_record_influence(released_sum, n: int, *, max_grad_norm: float,
                           relations=("add/remove", "substitution"), seed: int = 0,
                           name: str = "") -> InfluenceAudit:
    """Remove (add/remove) or replace (substitution) each record i < n of a pool of n + 1 and
    compare the noiseless released sums; ``passed``: every change <= bound·C (1 + tolerance),
    the tolerance of the precision the sums hold (module doc)."""
    C = check_max_grad_norm(max_grad_norm)
    n = check_count(n, "n", 2)
    unknown = set(relations) - set(RELATIONS)
    if unknown or not relations:
        raise ValueError(f"relations must be some of {sorted(RELATIONS)}; got {relations!r}")
    first, seen = list(range(n)), set()
    base = _replayed(released_sum, first, seed, seen)
    if not torch.equal(base, _replayed(released_sum, first, seed)):
        raise ValueError("released_sum is not reproducible: two calls on the same batch with "
                         "torch's RNG re-seeded differ. Disable the noise (σ = 0) and draw any "
                         "other randomness from torch's global RNG or a generator re-seeded on "
                         "every call, so that the audit can replay it")
    stochastic = not torch.equal(base, _replayed(released_sum, first, seed + 1))
    approximate = stochastic and not replays(released_sum, first, seed)
    changes = []  # (i, relation, others, delta): every sum first, then the tolerance they hold
    for i in range(n):
        others = [j for j in range(n) if j != i]
        full = _replayed(released_sum, others + [i], seed, seen)
        changed = {"add/remove": others, "substitution": others + [n]}
        for rel in relations:
            other = _replayed(released_sum, changed[rel], seed, seen)
            changes.append((i, rel, changed[rel], float((full - other).norm()) / C, other))
    dtype = widest(seen)
    tol = tolerance_of(dtype)
    rows, state = [], {}
    for i, rel, batch, delta, other in changes:
        bound, floor = RELATIONS[rel], 0.0
        verdict = "holds" if delta <= bound * (1 + tol) else "BROKEN"
        if verdict == "BROKEN" and approximate and rel == "add/remove":  # n changed
            floor = float((other - _replayed(released_sum, batch, seed + 1)).norm()) / C
            verdict = "inconclusive" if delta <= (bound + floor) * (1 + tol) else "BROKEN"
            if verdict == "inconclusive":  # the dropout-free twin may still prove it
                verdict = _twin_verdict(released_sum, first, batch, i, seed, C, bound, state,
                                        tol)
        rows.append({"record": i, "relation": rel, "change_over_C": delta, "bound": bound,
                     "floor_over_C": floor, "verdict": verdict, "passed": verdict == "holds"})
    return InfluenceAudit(pd.DataFrame(rows), C, name, tol, approximate,
                          str(dtype).removeprefix("torch."))


__all__ = ["RELATIONS", "InfluenceAudit", "audit_record_influence", "change_text"]
