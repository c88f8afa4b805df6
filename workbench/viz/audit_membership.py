"""The ROC of a membership-inference attack on log-log axes, DP against non-DP.

Carlini et al. 2022 (arXiv 2112.03570), Sec. III-B: plot TPR against FPR on logarithmic axes,
so the low-FPR tail, where an attack is confidently right about a few records, is visible;
the diagonal TPR = FPR is a guess. ``plot_membership_roc(ax, result)`` draws a
``MembershipAudit`` (``workbench.audit.membership``) and its ``reference`` (the same attack on
the same recipe without DP, when present), and returns the artists.
"""

import numpy as np


def _curve(ax, result, floor):
    keep = result.fpr > 0  # log axes: the (0, 0) corner and FPR = 0 points cannot be drawn
    name = (f"DP, claimed ε {result.epsilon_claimed:.2g}" if np.isfinite(result.epsilon_claimed)
            else "non-DP")
    label = f"{name}: AUC {result.auc:.2f}, TPR {result.tpr_at[1e-3]:.2g} at FPR 1e-3"
    (line,) = ax.plot(result.fpr[keep], np.maximum(result.tpr[keep], floor), label=label)
    return line


def plot_membership_roc(ax, result, *others):
    """Log-log ROC of ``result``, its ``reference`` and any ``others``; the chance diagonal."""
    results = [result, *([result.reference] if result.reference is not None else []), *others]
    n = max(int(r.members.size) for r in results)
    floor = 0.5 / n  # below one trial: where TPR = 0 is drawn
    artists = [_curve(ax, r, floor) for r in results]
    (diag,) = ax.plot([floor, 1], [floor, 1], "k--", linewidth=0.8, label="chance (TPR = FPR)")
    artists.append(diag)
    for alpha in (1e-3, 1e-2):
        artists.append(ax.axvline(alpha, color="grey", linewidth=0.5, linestyle=":"))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(floor, 1)
    ax.set_ylim(floor, 1)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title("membership inference (LiRA): ROC")
    ax.legend(fontsize="small", loc="lower right")
    return artists


__all__ = ["plot_membership_roc"]
