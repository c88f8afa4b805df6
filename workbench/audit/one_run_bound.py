"""The one-run ε lower bound: how many correct canary guesses an (ε, δ)-DP run allows.

Steinke, Nasr, Jagielski 2023, "Privacy Auditing with One (1) Training Run" (arXiv
2305.08846), Theorem 3.1 (the main theorem, stated for (ε, δ)). m canaries are each included
with probability ½, independently; after one run the auditor makes r = k₊ + k₋ guesses and
abstains on the rest. If the run is (ε, δ)-DP with respect to each canary, the number W of
correct guesses satisfies, for every v,

    P[W >= v] <= f(v) + 2mδ · max_{i = 1..v} (f(v - i) - f(v)) / i,             (Thm. 3.1)
    f(v) = P[Binomial(r, p(ε)) >= v],   p(ε) = e^ε / (1 + e^ε).

The right-hand side is a p-value for the hypothesis "(ε, δ)-DP" given W = v. The bound
reported at confidence 1 - β is the smallest ε that this p-value does not refute:

    ε_lower = min{ε >= 0 : pvalue(ε) >= β}.

Soundness: if the run is (ε*, δ)-DP then ε_lower > ε* only when pvalue(ε*) < β, which has
probability <= β. With δ = 0 the p-value is the binomial tail alone and ε_lower has a closed
form (the one-sided Clopper-Pearson limit, logit of Beta(v, r - v + 1).ppf(β)). With δ > 0
the δ term grows with m, so more canaries do not come for free: the best possible bound (all
r guesses right, ``attainable_bound``) shrinks as 2mδ grows, and is 0 once 2mδ·(its max)
alone exceeds β.

Notation: m canaries, r guesses, v correct guesses, β = 1 - confidence, δ the claim's δ.
"""

import numpy as np
from scipy import optimize, special, stats

from workbench.checks import check_count, check_delta, check_probability


def _check(guesses, correct, confidence, delta, canaries):
    r = check_count(guesses, "guesses")
    v = check_count(correct, "correct", 0, r, high_name="guesses")
    check_probability(confidence, "confidence", note="e.g. 0.95")
    check_delta(delta, zero_ok=True)
    if delta > 0 and (canaries is None or int(canaries) < r):
        raise ValueError(f"with delta={delta!r} > 0 the bound depends on the number of "
                         f"canaries m (Thm. 3.1's 2mδ term): pass canaries >= guesses={r}; "
                         f"got canaries={canaries!r}")
    return r, v


def p_value(guesses: int, correct: int, epsilon: float, delta: float = 0.0,
            canaries: int | None = None) -> float:
    """Thm. 3.1's bound on P[W >= v] for an (ε, δ)-DP run (capped at 1)."""
    r, v = _check(guesses, correct, 0.5, delta, canaries)
    p = special.expit(epsilon)  # p(ε) = e^ε / (1 + e^ε)
    tail = stats.binom.sf(v - 1, r, p)  # f(v) = P[Bin(r, p) >= v]
    if delta == 0 or v == 0:
        return float(min(tail, 1.0))
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))  # (v,) f(v-i) - f(v)
    alpha = np.max(below / np.arange(1, v + 1))  # max_i (f(v - i) - f(v)) / i
    return float(min(tail + 2 * int(canaries) * delta * alpha, 1.0))


def epsilon_lower_bound(guesses: int, correct: int, confidence: float = 0.95, *,
                        delta: float = 0.0, canaries: int | None = None) -> float:
    """ε_lower = min{ε >= 0 : pvalue(ε) >= β}: no (ε, δ) claim below it survives v of r right.

    ``delta = 0`` is the pure ε-DP test (closed form); for an (ε, δ) claim pass its ``delta``
    and the number of ``canaries`` m (required then: the δ term is 2mδ). With δ > 0 the
    p-value is found by bisection (to 1e-10 in ε) and then checked on a 64-point grid below
    the answer; if any grid point is not refuted, the smallest such point is returned, so the
    answer never exceeds the first ε that survives, even if the p-value were not monotone.
    """
    r, v = _check(guesses, correct, confidence, delta, canaries)
    beta = 1.0 - float(confidence)
    if v == 0:
        return 0.0
    if delta == 0:
        p_lo = stats.beta.ppf(beta, v, r - v + 1)  # P[Bin(r, p_lo) >= v] = β
        return float(max(0.0, special.logit(p_lo)))  # 0 below p = ½
    def gap(eps):
        return p_value(r, v, eps, delta, canaries) - beta
    if gap(0.0) >= 0:
        return 0.0
    hi = 1.0
    while gap(hi) < 0:  # p -> 1 as ε -> ∞, and f(v) -> 1 <= pvalue: terminates
        hi *= 2
    eps = optimize.brentq(gap, 0.0, hi, xtol=1e-10)
    grid = np.linspace(0.0, eps, 65)[1:-1]
    survives = [e for e in grid if gap(e) >= 0]
    return float(survives[0] if survives else eps)


def attainable_bound(guesses: int, confidence: float = 0.95, *, delta: float = 0.0,
                     canaries: int | None = None) -> float:
    """The highest ε_lower this configuration can report: every one of the r guesses right."""
    return epsilon_lower_bound(guesses, guesses, confidence, delta=delta, canaries=canaries)


__all__ = ["attainable_bound", "epsilon_lower_bound", "p_value"]
