"""Plots of the audit report: gradients, the noise of a DP step, clipping, the bug zoo.

``plot_x(ax, result)`` draws on the axes it is given and returns the artists (no figure, no
``plt.show()``). Results: ``GradientSuite``, ``BugZooSuite``, ``ClippingCheck``
(``workbench.audit.report_suites``), ``GradientAudit`` (``workbench.audit.gradients``) and
``MechanismAudit`` (``workbench.audit.mechanism``), ``InfluenceAudit``
(``workbench.audit.influence``).
The canary and accountant plots are in ``viz/audit_privacy.py``.

Noise variance: with residuals r of T calls on d coordinates of 3 batches, Σ r²/s² ~ χ²(k),
k = 3·d·(T-1), so the ratio observed/claimed variance = χ²/k has the two-sided band
[χ²_k(a/2)/k, χ²_k(1-a/2)/k] at the check's level a (the threshold in the audit's table).

Notation: s = σC/B the claimed noise std, T trials, d coordinates, a per-check significance.
"""

import numpy as np
from scipy import stats

FLOOR = 1e-18  # exact agreement (error 0) is drawn here on a log axis


def plot_gradient_errors(ax, suite):
    """Relative error per (model, parameter), one column per method, log scale, tolerance.

    A row without a number (the method raised) has no height: it is drawn as the word
    "raised" in a strip along the top (red for a failure, grey where another library cannot
    run the model: "n/a"), never as a point at an invented error."""
    rows = suite.rows
    methods = list(dict.fromkeys(rows["method"]))
    err = rows[["max_rel_error", "norm_rel_error"]].max(axis=1, skipna=True)  # worst per row
    has = err.notna().to_numpy()
    shown = err.clip(lower=FLOOR).to_numpy()
    top = np.nanmax(np.where(has, shown, np.nan), initial=suite.tolerance)
    x = rows["method"].map({m: i for i, m in enumerate(methods)}).to_numpy()
    jitter = np.random.default_rng(0).uniform(-0.18, 0.18, len(x))  # fixed: same figure
    ok = rows["passed"].to_numpy(bool)
    artists = [ax.scatter(x[ok & has] + jitter[ok & has], shown[ok & has], s=14,
                          color="tab:green", label="parameter (passed)")]
    if (~ok & has).any():
        artists.append(ax.scatter(x[~ok & has] + jitter[~ok & has], shown[~ok & has], s=22,
                                  marker="x", color="tab:red", label="parameter (FAILED)"))
    na = suite._na(rows).to_numpy(bool) if hasattr(suite, "_na") else np.zeros(len(x), bool)
    strip = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for i, m in enumerate(methods):
        raised, skipped = (x == i) & ~has & ~na, (x == i) & ~has & na
        if raised.any():
            artists.append(ax.text(i, 0.96, f"raised ({int(raised.sum())})", color="tab:red",
                                   ha="center", va="top", fontsize="x-small", transform=strip))
        if skipped.any():
            artists.append(ax.text(i, 0.88, f"n/a ({int(skipped.sum())})", color="0.4",
                                   ha="center", va="top", fontsize="x-small", transform=strip))
    artists.append(ax.axhline(suite.tolerance, color="k", linestyle="--",
                              label=f"tolerance {suite.tolerance:.0e}"))
    ax.set_xticks(range(len(methods)), methods, rotation=20 if len(methods) > 4 else 0)
    ax.set_yscale("log")
    ax.set_ylim(FLOOR / 10, max(1.0, 1e4 * top))  # headroom for the "raised" strip
    ax.set_ylabel("relative error vs micro-batching")
    ax.set_title(f"per-sample gradients, every parameter of {len(suite.audits)} model(s); "
                 f"0 drawn at {FLOOR:.0e}", fontsize="small")
    ax.legend(loc="center left", fontsize="small")
    return artists


def plot_gradient_audit(ax, result):
    """One bar per method of its worst relative error (a ``GradientAudit``), log scale, with
    the tolerance line; exact agreement drawn at FLOOR."""
    worst = result.worst()
    shown = worst.fillna(0).clip(lower=FLOOR)
    ok = result.table.groupby("method", sort=False)["passed"].all()[worst.index]
    colors = np.where(ok.to_numpy(), "tab:green", "tab:red")
    bars = ax.bar(list(worst.index), shown.to_numpy(), color=colors)
    line = ax.axhline(result.tolerance, color="k", linestyle="--",
                      label=f"tolerance {result.tolerance:.0e}")
    ax.set_yscale("log")
    ax.set_ylabel(f"max relative error vs {result.reference}")
    ax.legend(loc="upper left")
    return [*bars, line]


def plot_noise_histogram(ax, result, bins: int = 60):
    """Histogram of a MechanismAudit's standardised noise against the N(0, 1) pdf."""
    z = result.standardised_noise
    _, _, patches = ax.hist(z, bins=bins, density=True, alpha=0.6, label="(step - mean) / s")
    x = np.linspace(-4.5, 4.5, 200)
    (line,) = ax.plot(x, stats.norm.pdf(x), "k-", label="N(0, 1)")
    ax.set_xlabel("standardised noise")
    ax.set_title(f"DP step audit: {'passed' if result.passed else 'FAILED'}")
    ax.legend()
    return [*patches, line]


def noise_variance(result):
    """(observed/claimed variance, band low, band high) from a MechanismAudit, or None when
    the claim is σ = 0 (no variance test)."""
    row = result.table.set_index("check").loc["noise variance"]
    if np.isnan(row["p_value"]):
        return None
    k = result.standardised_noise.size * (result.trials - 1) / result.trials  # χ² dof
    a = row["threshold"]
    return row["statistic"], stats.chi2.ppf(a / 2, k) / k, stats.chi2.isf(a / 2, k) / k


def plot_noise_variance(ax, result):
    """The observed noise variance over the claimed (σC/B)², with the test's band."""
    v = noise_variance(result)
    if v is None:
        return [ax.text(0.5, 0.5, "σ = 0: no noise claimed", ha="center",
                        transform=ax.transAxes)]
    ratio, lo, hi = v
    ok = lo <= ratio <= hi
    band = ax.axvspan(lo, hi, color="tab:green", alpha=0.25, label="accepted band")
    claim = ax.axvline(1.0, color="k", linestyle="--", label="claimed (σC/B)²")
    dot = ax.plot([ratio], [0.5], "o", color="tab:green" if ok else "tab:red", markersize=10,
                  label=f"observed {ratio:.4f}")[0]
    span = max(hi - 1, 1 - lo, abs(ratio - 1)) * 1.6
    ax.set_xlim(1 - span, 1 + span)
    ax.set_yticks([])
    ax.set_xlabel("observed / claimed noise variance")
    ax.legend(loc="upper left", fontsize="small")
    return [band, claim, dot]


def plot_noise_qq(ax, result, points: int = 400):
    """QQ plot of the standardised noise (step - mean)/s against N(0, 1)."""
    z = np.sort(result.standardised_noise)
    idx = np.unique(np.linspace(0, z.size - 1, min(points, z.size)).astype(int))
    theory = stats.norm.ppf((idx + 0.5) / z.size)
    dots = ax.plot(theory, z[idx], ".", markersize=3, label="standardised noise")[0]
    lim = max(4.0, float(np.abs(z[idx]).max()) if z.size else 4.0)
    line = ax.plot([-lim, lim], [-lim, lim], "k--", linewidth=1, label="N(0, 1)")[0]
    ax.set_xlabel("N(0, 1) quantile")
    ax.set_ylabel("observed quantile")
    ax.legend(loc="upper left", fontsize="small")
    return [dots, line]


def plot_clipping(ax, check):
    """Observed σ = 0 step against the expected Σ clip_C(g_i)/B, every coordinate."""
    artists = []
    for i, (name, mu) in enumerate(check.expected.items()):
        artists.append(ax.scatter(mu, check.observed[name], s=12 + 6 * i, alpha=0.7,
                                  label=name.removeprefix("mean · ")))
    allv = np.concatenate([*check.expected.values(), *check.observed.values()])
    lo, hi = float(allv.min()), float(allv.max())
    artists.append(ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="observed = expected")[0])
    ax.set_xlabel("expected Σ clip_C(g_i) / B")
    ax.set_ylabel("observed step (σ = 0)")
    ax.legend(loc="upper left", fontsize="x-small")
    return artists


def plot_bug_zoo(ax, suite):
    """Which checks fail for which wrong step. One colour meaning everywhere: green = good (the
    check caught the bug), light grey = this check did not see it, red = no check caught the
    bug (a row the audit missed)."""
    from matplotlib.colors import ListedColormap

    names = list(suite.audits)
    checks = list(next(iter(suite.audits.values())).table["check"])
    grid = np.array([[not ok for ok in suite.audits[n].table["passed"]] for n in names], float)
    missed = ~grid.astype(bool).any(axis=1)
    grid[missed] = 2.0  # a whole row red
    cmap = ListedColormap(["#eeeeee", "#2ca02c", "#d62728"])
    image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, aspect="auto")
    ax.set_yticks(range(len(names)), names, fontsize="x-small")
    ax.set_xticks(range(len(checks)), [c.replace("mean · ", "mean: ") for c in checks],
                  rotation=35, ha="right", fontsize="x-small")
    ax.set_title("green: this check caught the bug · grey: not seen by it · red: missed by "
                 "all", fontsize="small")
    return [image]


def plot_record_influence(ax, result):
    """||S(A) - S(A')|| / C per record for each neighbouring relation (an ``InfluenceAudit``),
    with the bound (1 for add/remove, 2 for substitution): green within, red above."""
    t = result.table
    relations = list(dict.fromkeys(t["relation"]))
    width = 0.8 / len(relations)
    artists = []
    for k, rel in enumerate(relations):
        rows = t[t["relation"] == rel]
        x = rows["record"].to_numpy() + (k - (len(relations) - 1) / 2) * width
        colors = np.where(rows["passed"].to_numpy(bool), "tab:green", "tab:red")
        artists.append(ax.bar(x, rows["change_over_C"], width, color=colors,
                              alpha=1.0 if k == 0 else 0.55, label=rel))
        bound = float(rows["bound"].iloc[0])
        artists.append(ax.axhline(bound, color="k", linestyle="--" if k == 0 else ":",
                                  linewidth=1, label=f"bound {bound:g} C ({rel})"))
    ax.set_xlabel("record removed / replaced")
    ax.set_ylabel("change of the released sum / C")
    ax.set_title(f"largest: {result.worst(relations[0]):.6g} C ({relations[0]})",
                 fontsize="small")
    ax.set_ylim(0, 1.3 * max(2.0, float(t["change_over_C"].max())))  # room for the legend
    ax.legend(loc="upper left", fontsize="x-small", ncol=2)
    return artists


__all__ = [
    "FLOOR", "noise_variance", "plot_bug_zoo", "plot_clipping", "plot_gradient_audit",
    "plot_gradient_errors", "plot_noise_histogram", "plot_noise_qq", "plot_noise_variance",
    "plot_record_influence",
]
