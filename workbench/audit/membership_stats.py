"""The statistics of a membership-inference attack: LiRA scores, the ROC, and the ε it implies.

LiRA: N. Carlini, S. Chien, M. Nasr, S. Song, A. Terzis, F. Tramèr (2022), "Membership
Inference Attacks From First Principles", IEEE S&P, arXiv 2112.03570, Sec. IV, Algorithm 1.
A record's *logit-scaled confidence* φ (Eq. (4) for a classifier: φ = log(p_y / (1 − p_y)) =
z_y − logsumexp_{j≠y} z_j on the logits z; for a language model the window's negative mean
token loss) is close to Gaussian over training runs, once among runs that trained on it (IN)
and once among runs that did not (OUT). Shadow models give per-record means μ_in, μ_out and
variances σ²_in, σ²_out (pooled over records, "global", when shadows are few: Sec. VI-A), and

    online   Λ = log N(φ; μ_in, σ²_in) − log N(φ; μ_out, σ²_out)          (Alg. 1, line 13)
    offline  Λ = log Φ((φ − μ_out) / σ_out)                  (Sec. VI-C: 1 − Pr[Z > φ], log)

"IN" is guessed when Λ ≥ τ. The ROC is (FPR(τ), TPR(τ)) over all τ, read on a log scale at low
FPR (Sec. III-B: TPR at FPR 10⁻³ is the number to report, AUC alone hides the tail).

The ε a test implies: for an (ε, δ)-DP mechanism every test of IN against OUT satisfies
(Kairouz, Oh, Viswanath 2015, arXiv 1311.0776, Thm. 2.1; used for auditing by Jagielski,
Ullman, Oprea 2020, arXiv 2006.07709, and Nasr et al. 2021, arXiv 2101.04535)

    TPR ≤ e^ε FPR + δ,        1 − FPR ≤ e^ε (1 − TPR) + δ,                             (HT)

so ε ≥ max(log((TPR − δ) / FPR), log((1 − FPR − δ) / (1 − TPR))). With the one-sided
Clopper-Pearson limits TPR_lo and FPR_hi (β/2 each, Bonferroni) at a threshold τ fixed
*before* looking at the counts, ε_lower = ε(TPR_lo, FPR_hi) exceeds the true ε with
probability at most β. ``epsilon_interval`` mirrors it with (TPR_hi, FPR_lo): a two-sided
interval of level 1 − 2β for the ε of this attack's operating point.

The binomial limits treat the K·N (target, record) trials as independent, which trials of one
target model are not. ``one_run_bound`` gives a bound that is sound without that assumption,
Steinke, Nasr, Jagielski 2023 (arXiv 2305.08846), Thm. 3.1, at the price of looseness.

Notation: φ logit-scaled confidence, Λ the attack's score, τ threshold, S shadow models,
N records, β = 1 − confidence, δ the claim's δ.
"""

import numpy as np
import torch
from scipy import stats
from scipy.special import logsumexp

NO_SHADOW = ("record {i} is never {side} among the shadow models: each record needs at least "
             "one IN and one OUT shadow for the Gaussian fits; use more shadows (>= 4, even)")


def logit_confidence(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """φ = z_y − logsumexp_{j≠y} z_j = log(p_y / (1 − p_y)), stable: (n, K), (n,) -> (n,)."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels)
    z_y = z[np.arange(len(y)), y]  # (n,)
    others = z.copy()
    others[np.arange(len(y)), y] = -np.inf
    return z_y - logsumexp(others, axis=1)  # (n,)  Eq. (4)


def fit_gaussians(phi: np.ndarray, masks: np.ndarray, variance: str = "global") -> dict:
    """Per-record μ_in, μ_out (N,) and σ_in, σ_out from shadow φ (S, N) and IN masks (S, N)."""
    phi, masks = np.asarray(phi, dtype=np.float64), np.asarray(masks, dtype=bool)
    fit = {}
    for side, m in (("in", masks), ("out", ~masks)):
        count = m.sum(0)  # (N,)
        if (count == 0).any():
            raise ValueError(NO_SHADOW.format(i=int(np.argmin(count)), side=side.upper()))
        mu = (phi * m).sum(0) / count  # (N,)
        resid = np.where(m, phi - mu, 0.0)  # (S, N)
        if variance == "global":  # pooled over records, one mean per record estimated
            dof = max(int(count.sum() - len(count)), 1)
            sd = np.full(len(count), np.sqrt((resid ** 2).sum() / dof))
        elif variance == "per_record":
            sd = np.sqrt((resid ** 2).sum(0) / np.maximum(count - 1, 1))
        else:
            raise ValueError(f"variance must be 'global' (few shadows) or 'per_record'; got "
                             f"{variance!r}")
        fit[f"mu_{side}"], fit[f"sd_{side}"] = mu, np.maximum(sd, 1e-6)  # σ > 0
    return fit


def lira_scores(phi: np.ndarray, fit: dict, attack: str = "online") -> np.ndarray:
    """Λ for target φ (..., N) from ``fit_gaussians``: larger means "more likely IN"."""
    phi = np.asarray(phi, dtype=np.float64)
    out = stats.norm.logpdf(phi, fit["mu_out"], fit["sd_out"])
    if attack == "online":
        return stats.norm.logpdf(phi, fit["mu_in"], fit["sd_in"]) - out  # Alg. 1, line 13
    if attack == "offline":
        return stats.norm.logcdf((phi - fit["mu_out"]) / fit["sd_out"])  # one-sided test
    raise ValueError(f"attack must be 'online' (IN and OUT shadows) or 'offline' (OUT only); "
                     f"got {attack!r}")


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every distinct threshold, from (0, 0) to (1, 1); "IN" when score ≥ τ."""
    s, y = np.ravel(scores), np.ravel(labels).astype(bool)
    if y.all() or not y.any():
        raise ValueError("labels must contain both members (True) and non-members (False)")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]  # last index of each distinct score
    tps, fps = np.cumsum(y)[last], np.cumsum(~y)[last]
    return np.r_[0.0, fps / (~y).sum()], np.r_[0.0, tps / y.sum()]


def auc(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """Area under the ROC (trapezoids): 0.5 is chance, 1 a perfect attack."""
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, alpha: float) -> float:
    """Highest TPR among thresholds with FPR ≤ alpha (LiRA's Table/Fig. convention)."""
    return float(tpr[fpr <= alpha].max())


def clopper_pearson(k: int, n: int, beta: float, side: str) -> float:
    """One-sided Clopper-Pearson limit for a binomial rate: ``side`` 'lower' or 'upper'."""
    if side == "lower":
        return 0.0 if k == 0 else float(stats.beta.ppf(beta, k, n - k + 1))
    return 1.0 if k == n else float(stats.beta.ppf(1 - beta, k + 1, n - k))


def epsilon_from_rates(tpr: float, fpr: float, delta: float) -> float:
    """The smallest ε ≥ 0 that (HT) allows for a test with these rates (inf if none)."""
    def term(num, den):
        if num <= 0:
            return 0.0
        return np.inf if den <= 0 else float(np.log(num / den))
    return max(0.0, term(tpr - delta, fpr), term(1 - fpr - delta, 1 - tpr))


def counts_at(scores, labels, tau) -> tuple[int, int, int, int]:
    """(true positives, members, false positives, non-members) of "IN when score ≥ τ"."""
    s, y = np.ravel(scores), np.ravel(labels).astype(bool)
    said_in = s >= tau
    return int((said_in & y).sum()), int(y.sum()), int((said_in & ~y).sum()), int((~y).sum())


def epsilon_bounds_at(scores, labels, tau: float, delta: float, confidence: float) -> dict:
    """ε_lower (confidence), the point estimate and the mirrored upper end at one threshold."""
    tp, pos, fp, neg = counts_at(scores, labels, tau)
    b = (1 - confidence) / 2  # β/2 to TPR, β/2 to FPR
    lo = epsilon_from_rates(clopper_pearson(tp, pos, b, "lower"),
                            clopper_pearson(fp, neg, b, "upper"), delta)
    hi = epsilon_from_rates(clopper_pearson(tp, pos, b, "upper"),
                            clopper_pearson(fp, neg, b, "lower"), delta)
    return {"threshold": tau, "tpr": tp / pos, "fpr": fp / neg, "true_positives": tp,
            "members": pos, "false_positives": fp, "non_members": neg, "epsilon_lower": lo,
            "epsilon_estimate": epsilon_from_rates(tp / pos, fp / neg, delta),
            "epsilon_upper_end": hi}


def choose_threshold(scores, labels, delta: float, confidence: float,
                     candidates: int = 200) -> float:
    """τ maximising ε_lower on calibration data (the shadows), among score quantiles."""
    s = np.ravel(scores)
    taus = np.unique(np.quantile(s, np.linspace(0.0, 1.0, candidates)))
    bounds = [epsilon_bounds_at(s, labels, t, delta, confidence)["epsilon_lower"] for t in taus]
    return float(taus[int(np.argmax(bounds))])


# --- the same attack under the one-run theorem: sound although trials share a training run ---

ONE_RUN_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.4, 1.0)  # r / m tried on the shadows


def one_run_bound(scores, labels, fraction: float, delta: float, confidence: float) -> dict:
    """Steinke, Nasr, Jagielski 2023 (arXiv 2305.08846), Thm. 3.1 on the targets' trials.

    Every (target, record) membership is an independent fair coin and changes one target's
    training set only, so the K·N trials are m = K·N canaries of one (ε, δ)-DP "run" (the K
    independent trainings). The top r/2 scores are guessed IN, the bottom r/2 OUT
    (``canary.guess``; r = fraction·m), and ``one_run_bound.epsilon_lower_bound`` turns the
    v correct guesses into ε_lower, sound under the dependence the binomial limits ignore.
    """
    from workbench.audit.canary import guess
    from workbench.audit.one_run_bound import epsilon_lower_bound

    s, y = np.ravel(scores), np.ravel(labels).astype(bool)
    m = len(s)
    r = max(2, int(round(fraction * m / 2)) * 2)
    g = guess(s, r // 2, r // 2, torch.Generator().manual_seed(0))  # ties: a fixed shuffle
    v = int(((g == 1) & y).sum() + ((g == -1) & ~y).sum())
    eps = epsilon_lower_bound(r, v, confidence, delta=delta, canaries=m)
    return {"guesses": r, "correct": v, "epsilon_lower_one_run": eps}


def choose_fraction(scores, labels, delta: float, confidence: float) -> float:
    """The guess fraction r/m that gives the highest one-run bound on calibration data."""
    bounds = [one_run_bound(scores, labels, f, delta, confidence)["epsilon_lower_one_run"]
              for f in ONE_RUN_FRACTIONS]
    return ONE_RUN_FRACTIONS[int(np.argmax(bounds))]


__all__ = [
    "NO_SHADOW", "ONE_RUN_FRACTIONS", "auc", "choose_fraction", "choose_threshold",
    "clopper_pearson", "counts_at", "epsilon_bounds_at", "epsilon_from_rates", "fit_gaussians",
    "lira_scores", "logit_confidence", "one_run_bound", "roc_curve", "tpr_at_fpr",
]
