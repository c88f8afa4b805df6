"""Plots of the audit report's privacy sections: canary scores and bounds, ε curves.

``plot_x(ax, result)`` draws on the axes it is given and returns the artists. Results:
``CanaryAudit`` (``workbench.audit.canary``), ``GaussianAudit``
(``workbench.audit.gaussian_audit``) and ``AccountantCheck`` (``workbench.audit.report_suites``).

Canary decision rule (Steinke, Nasr, Jagielski 2023, arXiv 2305.08846): the top k₊ scores are
guessed "in", the bottom k₋ "out", the rest abstain; the two score thresholds are the k₊-th
highest and the k₋-th lowest score.
"""

import numpy as np

# The canary result's field for the highest ε_lower its configuration could reach (all guesses
# right), read when present; older results do not have it.
ATTAINABLE_FIELDS = ("epsilon_attainable", "epsilon_max", "highest_attainable")


def attainable_bound(result):
    for name in ATTAINABLE_FIELDS:
        value = getattr(result, name, None)
        if value is not None:
            return float(value)
    return None


def canary_thresholds(result):
    """(score above which canaries are guessed in, score below which out)."""
    r = int(result.table["guesses"].iloc[0])
    s = np.sort(result.scores)
    k_in, k_out = (r + 1) // 2, r // 2
    return s[len(s) - k_in], (s[k_out - 1] if k_out else -np.inf)


def plot_canary_scores(ax, result, bins: int = 40):
    """Scores of included and excluded canaries with the two decision thresholds."""
    edges = np.histogram_bin_edges(result.scores, bins=bins)
    _, _, p_in = ax.hist(result.scores[result.included], bins=edges, alpha=0.6, label="in")
    _, _, p_out = ax.hist(result.scores[~result.included], bins=edges, alpha=0.6, label="out")
    hi, lo = canary_thresholds(result)
    lines = [ax.axvline(hi, color="k", linestyle="--", label="guess 'in' above")]
    if np.isfinite(lo):
        lines.append(ax.axvline(lo, color="k", linestyle=":", label="guess 'out' below"))
    ax.set_xlabel("canary score Σ_t step_t[j]")
    ax.set_ylabel("canaries")
    ax.legend(fontsize="small")
    return [*p_in, *p_out, *lines]


def plot_gaussian_scores(ax, result, bins: int = 60):
    """A GaussianAudit's scores of present (in) and absent (out) canaries, threshold ½."""
    edges = np.histogram_bin_edges(result.scores, bins=bins)
    _, _, p_out = ax.hist(result.scores[~result.bits], bins=edges, alpha=0.6, label="out")
    _, _, p_in = ax.hist(result.scores[result.bits], bins=edges, alpha=0.6, label="in")
    line = ax.axvline(0.5, color="k", linestyle="--", label="threshold ½")
    ax.set_xlabel("score x_j = step_j · B / C")
    ax.set_title(result.summary.split(":")[0])
    ax.legend()
    return [*p_out, *p_in, line]


def plot_canary_bounds(ax, result):
    """ε_lower (the audit) beside ε_upper (the accountant) and, when known, the highest
    ε_lower this configuration could reach."""
    bars = {"ε_lower (audit)": result.epsilon_lower, "ε_upper (accountant)": result.epsilon_upper}
    top = attainable_bound(result)
    if top is not None:
        bars["highest attainable ε_lower"] = top
    colors = ["tab:red" if result.epsilon_lower > result.epsilon_upper else "tab:blue",
              "tab:gray", "tab:olive"][:len(bars)]
    drawn = ax.barh(list(bars), list(bars.values()), color=colors)
    texts = [ax.text(v, i, f" {v:.3g}", va="center", fontsize="small")
             for i, v in enumerate(bars.values())]
    ax.set_xlim(0, 1.25 * max(max(bars.values()), 1e-3))
    ax.invert_yaxis()
    ax.set_xlabel("ε")
    return [*drawn, *texts]


def plot_epsilon_curves(ax, check):
    """ε(δ) of every accountant in ``check.labels`` against steps for the first setting."""
    c = check.curve
    q, sigma = c["q"].iloc[0], c["sigma"].iloc[0]
    markers = "os^vDP*X"
    lines = [ax.plot(c["steps"], c[f"eps_{name}"], f"{markers[k % len(markers)]}-",
                     label=label)[0] for k, (name, label) in enumerate(check.labels.items())]
    ax.set_xscale("log")
    ax.set_xlabel("steps")
    ax.set_ylabel(f"ε (δ = {check.delta:.0e})")
    rules = "; ".join(f"{check.labels[a]} must not exceed {check.labels[b]}"
                      for a, b in check.pairs)
    ax.set_title(f"q = {q:.3g}, σ = {sigma:g}" + (f": {rules}" if rules else ""),
                 fontsize="small")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    return lines


__all__ = [
    "ATTAINABLE_FIELDS", "attainable_bound", "canary_thresholds", "plot_canary_bounds",
    "plot_canary_scores", "plot_epsilon_curves", "plot_gaussian_scores",
]
