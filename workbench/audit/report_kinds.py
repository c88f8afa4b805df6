"""How the report presents each kind of audit: what and why, finding, table, figures.

One ``register_kind`` call per result class (see ``workbench.audit.report``). Tables here drop
what repeats on every row (tolerances, significance levels) into notes stated once, and never
show an unexplained NaN.
"""

import numpy as np
import pandas as pd

from workbench.audit.report import Kind, register_kind
from workbench.viz.audit import (
    noise_variance,
    plot_bug_zoo,
    plot_clipping,
    plot_gradient_errors,
    plot_noise_qq,
    plot_noise_variance,
)
from workbench.viz.audit_privacy import (
    attainable_bound,
    plot_canary_bounds,
    plot_canary_scores,
    plot_epsilon_curves,
)


def _g(v) -> str:
    return "—" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.2g}"


# --- per-sample gradients -------------------------------------------------------------------

def _compared(group) -> str:
    quantity = group["quantity"].iloc[0]
    has_norms = group["norm_rel_error"].notna().any()
    if quantity.startswith("clipped sum"):
        return "norms and clipped sum" if has_norms else "clipped sum only"
    return quantity + (" and norms" if quantity == "per-sample grads" and has_norms else "")


def gradient_table(suite):
    rows = []
    na_rows = suite._na(suite.rows)
    for (model, method), g in suite.rows.groupby(["model", "method"], sort=False):
        worst = g[["max_rel_error", "norm_rel_error"]].max(axis=1, skipna=True)
        at = g["parameter"][worst.idxmax()] if worst.notna().any() else ""
        error = "; ".join(sorted(set(g["error"]) - {""}))
        na = bool(na_rows[g.index].any())
        rows.append({"model": model, "method": method, "compared": _compared(g),
                     "parameters": int((g["parameter"] != "").sum()),
                     "worst relative error": "raised" if error and worst.isna().all()
                     else _g(worst.max()), "at parameter": at or "—",
                     "passed": "not applicable" if na else bool(g["passed"].all()),
                     "error": error})
    table = pd.DataFrame(rows)
    if len(table) and (table["error"] == "").all():
        table = table.drop(columns="error")
    if na_rows.any():
        notes_na = ["Not applicable: the library raised on this model (it cannot run it, e.g. "
                    "a layer it does not know); not a failure of the library, not counted."]
    else:
        notes_na = []
    reason = suite.rows["tolerance_reason"].iloc[0]
    notes = [f"Tolerance for every row: {suite.tolerance:.0e} relative ({reason}).",
             "Relative error: max |g − g_ref| / max |g_ref| over samples and coordinates, per "
             "parameter, and the same for the per-sample norms; the worse of the two is shown."]
    if "bookkeeping" in suite.methods:
        notes.append("Book-keeping materialises neither per-sample gradients nor their norms: "
                     "it is audited on the clipped sum Σ min(1, C/‖g_i‖) g_i only (C = the "
                     "median reference norm, so some samples are clipped), which is why "
                     "report.json has no norm error (null) on its rows. Ghost is audited on its "
                     "norms and the same clipped sum.")
    notes.append("One row per model and method here; report.json has one row per parameter.")
    return table, notes + notes_na


def gradient_summary(suite):
    rows = suite.rows
    worst = rows[["max_rel_error", "norm_rel_error"]].max(axis=1, skipna=True).max()
    key = f"worst rel. error {_g(worst)} (tolerance {suite.tolerance:.0e})"
    errors = (rows["error"] != "") & ~suite._na(rows)  # a library's not-applicable rows apart
    if errors.any():  # a method that raised has no error number: do not show the others'
        key = f"{int(errors.sum())} of {len(rows)} rows raised an error"
    return suite.summary, key


register_kind("GradientSuite", Kind(
    what="Each per-sample gradient method is compared, per parameter and per sample, with "
         "micro-batching (one backward pass per sample, the obviously-correct twin), in float64. "
         "Wrong per-sample gradients make clipping bound the wrong quantity, so every privacy "
         "claim built on them fails silently.",
    summary=gradient_summary, table=gradient_table, figures=(plot_gradient_errors,)))

LIBRARY_WHAT = ("Another implementation's per-sample gradients (the per_sample_gradients "
                "signature) against micro-batching on the same models, float64, the same "
                "tolerance. Only as trustworthy as this agreement: any other library's DP-SGD "
                "clips what it computes here.")


# --- the DP step's mechanism ----------------------------------------------------------------

def mechanism_table(result):
    a = result.table["threshold"].iloc[0]
    t = result.table
    table = pd.DataFrame({
        "check": t["check"],
        "statistic": t["statistic"].map(lambda v: f"{v:.4g}"),
        "p-value": [("— (a bound)" if np.isnan(p) else f"{p:.3g}") for p in t["p_value"]],
        "passes if": [f"≤ {h:.3g}" if np.isnan(p) else f"p ≥ {h:.1e}"
                      for p, h in zip(t["p_value"], t["threshold"])],
        "passed": t["passed"], "what it can and cannot see": t["meaning"]})
    notes = [f"Significance α = {result.alpha:g} for the whole audit, split over {len(t)} checks "
             f"(Bonferroni): each p-value is compared with {a:.2g}; the mean checks further "
             f"split it over coordinates. {result.trials} trials per designed batch.",
             "Sensitivity is a bound, not a test: the distance between the mean steps of two "
             "neighbouring batches must stay below C/B plus the noise floor."]
    return table, notes


def mechanism_summary(result):
    v = noise_variance(result)
    key = ("σ = 0 claimed" if v is None
           else f"variance ratio {v[0]:.4f} (band {v[1]:.3f}–{v[2]:.3f})")
    if result.passed:
        limits = result.limits_text  # what "passed" does not cover
        return (f"mean, sensitivity and noise match the claim ({len(result.table)} checks)"
                + (f"; {limits}" if limits else ""), key)
    if getattr(result, "verdict", "") == "inconclusive":
        return result.summary, key
    scale = result.scale_text
    return ("fails: " + ", ".join(result.table["check"][~result.table["passed"]])
            + (f"; {scale}" if scale else ""), key)


register_kind("MechanismAudit", Kind(
    what="The step is fed designed per-sample gradients (huge, tiny, zero, outlier) many times "
         "and must return (Σ_i clip_C(g_i) + N(0, σ²C²I)) / B in distribution: right mean, "
         "bounded sensitivity, Gaussian, fresh noise of the claimed variance. The accountant's "
         "ε holds only for exactly this mechanism.",
    summary=mechanism_summary, table=mechanism_table,
    figures=(plot_noise_variance, plot_noise_qq)))

register_kind("BugZooSuite", Kind(
    what="Steps with one mistake each, seen in real DP-SGD code, go through the same mechanism "
         "audit; each must fail it. \"Caught\" means at least one check rejected the wrong "
         "step, so the audit would have flagged that mistake in someone's code.",
    summary=lambda s: (s.summary, f"{int(s.table['caught'].sum())}/{len(s.table)} caught"),
    table=lambda s: (s.table.drop(columns="passed"), []), figures=(plot_bug_zoo,),
    figsize=(6.4, 4.2)))


# --- clipping, accountants, canaries --------------------------------------------------------

def clipping_table(check):
    t = check.table
    return t.drop(columns="tolerance").assign(
        max_abs_error=t["max_abs_error"].map(_g), rel_error=t["rel_error"].map(_g)), [
        f"Tolerance: {check.tolerance:.0e} relative, the step's outputs holding "
        f"{check.dtype} (four unit roundoffs, at least 1e-6: Opacus' C / (norm + 1e-6) "
        f"over-clips by ~1e-6; a clipping bug moves the sum by a sizeable fraction of C/B). "
        f"C = {check.max_grad_norm:g}, "
        f"B = {check.batch_size:g}, σ = 0."]


register_kind("ClippingCheck", Kind(
    what="The step is run once with σ = 0 on the designed batches; it must return exactly "
         "Σ_i min(1, C/‖g_i‖) g_i / B. Without noise, any clipping or scaling error is visible "
         "coordinate by coordinate.",
    summary=lambda c: (c.summary,
                       f"rel. error {_g(c.table['rel_error'].max())} (tol. {c.tolerance:.0e})"),
    table=clipping_table, figures=(plot_clipping,)))

def accountant_epsilons(check):
    """ε of the first setting by each accountant, smallest first: "ε 2.38 (PLD) vs 2.6 (RDP)"."""
    first = check.table.iloc[0]
    eps = sorted((first[f"eps_{name}"], label) for name, label in check.labels.items())
    return "ε " + " vs ".join(f"{e:.3g} ({label})" for e, label in eps)


register_kind("AccountantCheck", Kind(
    what="ε of every registered accountant (workbench.accounting.ACCOUNTANTS; RDP is a bound "
         "after conversion, PLD near-exact) for the same DP-SGD runs. One registered as never "
         "above another (PLD: RDP) must not exceed it; if it did, one of the two would be wrong.",
    summary=lambda c: (c.summary, accountant_epsilons(c)),
    figures=(plot_epsilon_curves,)))


def canary_table(result):
    row = result.table.iloc[0].to_dict()
    top = attainable_bound(result)
    if top is not None:
        row["highest attainable epsilon_lower"] = top
    return pd.DataFrame({"quantity": list(row), "value": [
        f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]}), [
        "ε_lower is the one-run bound of Steinke, Nasr, Jagielski 2023 at the stated confidence "
        "(see workbench.audit.canary for how δ enters). ε_upper is the accountant's claim."]


register_kind("CanaryAudit", Kind(
    what="Canary gradients are hidden in a run, each included with probability ½; guessing "
         "from the released steps which were included gives a lower bound on ε. A bound above "
         "the accountant's ε proves the claim false; a bound below it is consistent with it.",
    summary=lambda r: (f"ε_lower {r.epsilon_lower:.3g} {'≤' if r.passed else '>'} ε_upper "
                       f"{r.epsilon_upper:.3g}", f"ε_lower {r.epsilon_lower:.3g}"),
    table=canary_table, figures=(plot_canary_scores, plot_canary_bounds)))


__all__ = [
    "LIBRARY_WHAT", "accountant_epsilons", "canary_table", "clipping_table", "gradient_summary",
    "gradient_table", "mechanism_summary", "mechanism_table",
]
