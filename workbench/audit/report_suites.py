"""Result objects for the report's sections that gather several audits or small checks.

Each is an ``AuditResult`` (``.passed``, ``.table``, ``.summary``; ``workbench.audit.result``):

- ``GradientSuite``: several models' ``GradientAudit``s, restricted to some methods;
- ``BugZooSuite``: the mechanism audit of every wrong step of ``bug_zoo`` (passed = all caught);
- ``ClippingCheck``: a DP step run with σ = 0 on designed batches must return exactly
  μ(G) = Σ_i min(1, C/||g_i||) g_i / B (Abadi et al. 2016, arXiv 1607.00133, Algorithm 1);
- ``AccountantCheck``: ε of every registered accountant side by side (``accounting.ACCOUNTANTS``),
  none above one it is registered as never above (PLD never above RDP).

Notation: C max_grad_norm, B expected batch size, σ noise multiplier, g_i row i of G.
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from workbench import accounting
from workbench.audit.mechanism import design_batches, expected_step, sweep_batches
from workbench.audit.result import AuditResult
from workbench.per_sample.precision import unit_roundoff, value_dtype, widest

CLIPPING_TOLERANCE = 1e-6  # relative, at least: Opacus' C / (norm + 1e-6) over-clips by ~1e-6;
# a clipping bug moves the sum by a sizeable fraction of C/B. A step whose outputs hold fewer
# bits is compared at four of its unit roundoffs (``per_sample/precision.unit_roundoff``: one
# stored result against its exact value): a correct bfloat16 step's "clipped sums differ"
# until 2026-12-01


@dataclass
class GradientSuite(AuditResult):
    """Gradient audits of several models (``audits``: name -> GradientAudit) for ``methods``."""

    audits: dict
    methods: tuple
    what: str = ""  # overrides the kind's "what" (e.g. for another library)
    library: bool = False  # another library: a model it raises on is "not applicable"

    def _na(self, rows) -> pd.Series:
        """Rows another library could not run (it raised): not applicable, not failed."""
        if not self.library or not len(rows):
            return pd.Series(False, index=rows.index)
        return rows["error"] != ""

    @property
    def not_applicable(self) -> bool:
        rows = self.rows
        return bool(len(rows)) and bool(self._na(rows).all())

    @property
    def reason(self) -> str:
        rows = self.rows
        bad = rows[self._na(rows)] if len(rows) else rows
        return "; ".join(dict.fromkeys(f"cannot run {m}: {e}" for m, e in
                                       zip(bad.get("model", []), bad.get("error", []))))

    @property
    def rows(self) -> pd.DataFrame:
        """Every (model, method, parameter) row of the audited methods."""
        parts = [a.table[a.table["method"].isin(self.methods)].assign(model=name)
                 for name, a in self.audits.items()]
        parts = [p for p in parts if len(p)]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    @property
    def table(self) -> pd.DataFrame:
        rows = self.rows
        return rows[["model", *rows.columns.drop("model")]] if len(rows) else rows

    @property
    def passed(self) -> bool:
        rows = self.rows
        rows = rows[~self._na(rows)] if len(rows) else rows
        return bool(len(rows)) and bool(rows["passed"].all())

    @property
    def tolerance(self) -> float:
        return max(a.tolerance for a in self.audits.values())

    @property
    def summary(self) -> str:
        rows = self.rows
        na = self._na(rows)
        models = sorted(set(rows["model"][na])) if len(rows) else []
        if self.not_applicable:
            return f"not applicable: cannot run {', '.join(models)}"
        note = f" (not applicable on {', '.join(models)})" if models else ""
        if self.passed:
            methods = ", ".join(dict.fromkeys(rows["method"]))
            ran = len(self.audits) - len(models)
            return f"{methods} agree with micro-batching on {ran} model(s){note}"
        rows = rows[~na] if len(rows) else rows
        bad = rows[~rows["passed"]] if len(rows) else rows
        where = ", ".join(dict.fromkeys(bad["method"] + " on " + bad["model"])) if len(bad) \
            else "no rows audited"
        return f"disagree or fail: {where}{note}"


def _caught(audit) -> bool:
    """A wrong step is caught when a check failed: an inconclusive run caught nothing."""
    return getattr(audit, "verdict", "passed" if audit.passed else "failed") == "failed"


@dataclass
class BugZooSuite(AuditResult):
    """Mechanism audits of wrong steps (``audits``: name -> MechanismAudit) and what is wrong
    with each (``docs``: name -> one line). ``passed``: the audit caught every one."""

    audits: dict
    docs: dict

    @property
    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{
            "bug": name, "what is wrong": self.docs.get(name, ""), "caught": _caught(a),
            "failed checks": ", ".join(a.table["check"][~a.table["passed"]]),
            "passed": _caught(a)} for name, a in self.audits.items()])

    @property
    def passed(self) -> bool:
        return bool(self.audits) and all(_caught(a) for a in self.audits.values())

    @property
    def summary(self) -> str:
        return f"{int(self.table['caught'].sum())} of {len(self.table)} wrong steps caught"


@dataclass
class ClippingCheck(AuditResult):
    """A σ = 0 step against μ(G) on the designed batches of the mechanism audit."""

    observed: dict  # batch name -> (d,) step output
    expected: dict  # batch name -> (d,) μ(G)
    clipped: dict  # batch name -> (samples clipped, samples)
    max_grad_norm: float
    batch_size: float
    tolerance: float = CLIPPING_TOLERANCE
    dtype: str = "float64"  # the precision the step's sums hold (``value_dtype``)

    @property
    def table(self) -> pd.DataFrame:
        rows = []
        for name, mu in self.expected.items():
            err = float(np.abs(self.observed[name] - mu).max())
            rel = err / max(float(np.abs(mu).max()), 1e-300)
            k, n = self.clipped[name]
            rows.append({"batch": name.removeprefix("mean · "), "samples": n, "clipped": k,
                         "max_abs_error": err, "rel_error": rel, "tolerance": self.tolerance,
                         "passed": rel <= self.tolerance})
        return pd.DataFrame(rows)

    @property
    def passed(self) -> bool:
        return bool(self.table["passed"].all())

    @property
    def summary(self) -> str:
        return "clipped sums match" if self.passed else "clipped sums differ"


def check_clipping(step_factory, max_grad_norm, batch_size, dim, generator=None):
    """Run ``step_factory(C, 0, B, generator)`` once on each designed batch, and on each of
    ``sweep_batches`` (every size to 9, each side of the powers of two to 1024, norms 1e-8 C
    to 1e8 C), reported as one row: the batch of the largest relative error."""
    C, B = float(max_grad_norm), float(batch_size)
    step = step_factory(C, 0.0, B, generator)
    observed, expected, clipped, seen = {}, {}, {}, set()

    def run(G):
        out = step(G.clone()).detach().to("cpu")
        seen.add(value_dtype(out))
        return out.double().numpy()  # (d,)

    for name, G in design_batches(dim, B, C, generator).items():
        observed[name] = run(G)
        expected[name] = expected_step(G, C, B).numpy()  # (d,)
        clipped[name] = (int((G.norm(dim=1) > C).sum()), len(G))
    worst = None
    for name, G in sweep_batches(dim, C, generator).items():
        got = run(G)
        mu = expected_step(G, C, B).numpy()
        rel = float(np.abs(got - mu).max()) / max(float(np.abs(mu).max()), 1e-300)
        if worst is None or not rel <= worst[0]:  # a NaN is the worst
            worst = (rel, name, got, mu, (int((G.norm(dim=1) > C).sum()), len(G)))
    _, name, observed[name], expected[name], clipped[name] = worst
    dtype = widest(seen)
    return ClippingCheck(observed, expected, clipped, C, B,
                         max(CLIPPING_TOLERANCE, 4 * unit_roundoff(dtype)),
                         str(dtype).removeprefix("torch."))


@dataclass
class AccountantCheck(AuditResult):
    """ε(δ) of every registered accountant per setting (``table``, one ``eps_<name>`` column
    each) and along one run (``curve``); ``pairs``: (tighter, looser) names whose order is
    checked, from the registry's ``never_above``."""

    table: pd.DataFrame
    curve: pd.DataFrame = field(repr=False)  # steps and eps_<name> columns for settings[0]
    delta: float = 1e-5
    labels: dict = field(default_factory=dict)  # name -> label, in the registry's order
    pairs: tuple = ()  # ((tighter, looser), ...)

    @property
    def passed(self) -> bool:
        return bool(self.table["passed"].all()) and bool(self.curve["passed"].all())

    def _order(self, a, b):
        return f"{self.labels[a]} ≤ {self.labels[b]}"

    @property
    def summary(self) -> str:
        if self.passed:
            checked = " and ".join(self._order(a, b) for a, b in self.pairs) or "ε computed"
            return f"{checked} in every setting"
        rows = pd.concat([self.table, self.curve])
        return "; ".join(f"{self.labels[a]} exceeds {self.labels[b]}" for a, b in self.pairs
                         if (rows[f"eps_{a}"] > rows[f"eps_{b}"] * (1 + 1e-9)).any())


def _epsilons(q, sigma, steps, delta, pairs, eps=None):
    eps = eps or {name: accounting.epsilon(q, sigma, steps, delta, accountant=name)
                  for name in accounting.ACCOUNTANTS}
    return {"q": q, "sigma": sigma, "steps": steps, "delta": delta,
            **{f"eps_{name}": e for name, e in eps.items()},
            "passed": all(eps[a] <= eps[b] * (1 + 1e-9) for a, b in pairs)}


def check_accountants(settings, delta=1e-5, curve_points=8) -> AccountantCheck:
    """``settings``: [(q, σ, steps)]; the curve follows the first one up to its steps."""
    registered = accounting.ACCOUNTANTS
    pairs = tuple((name, looser) for name, spec in registered.items()
                  for looser in spec.never_above if looser in registered)
    table = pd.DataFrame([_epsilons(q, s, t, delta, pairs) for q, s, t in settings])
    q, sigma, steps = settings[0]
    grid = np.unique(np.geomspace(10, steps, curve_points).astype(int))
    curves = {name: accounting.epsilon_curve(q, sigma, grid, delta, accountant=name)
              for name in registered}  # one curve call each: a slow accountant shares its grid
    curve = pd.DataFrame([_epsilons(q, sigma, int(t), delta, pairs,
                                    {name: float(c[i]) for name, c in curves.items()})
                          for i, t in enumerate(grid)])
    labels = {name: spec.label for name, spec in registered.items()}
    return AccountantCheck(table, curve, delta, labels, pairs)


__all__ = [
    "CLIPPING_TOLERANCE", "AccountantCheck", "BugZooSuite", "ClippingCheck", "GradientSuite",
    "check_accountants", "check_clipping",
]
