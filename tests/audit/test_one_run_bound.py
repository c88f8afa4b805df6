"""The one-run bound (Steinke, Nasr, Jagielski 2023, Thm. 3.1) is sound at every m.

Soundness is checked on mechanisms whose ε is known exactly, with a vectorised simulation
of the guessing game (no training): over many seeds the 95% bound may exceed the true ε in
at most 5% of runs, plus Monte-Carlo slack (the 99.9% quantile of Binomial(seeds, 0.05)).

- randomised response: ε-DP, every guess right with probability e^ε/(1+e^ε) (δ = 0);
- "leaky" randomised response: with probability δ a canary's bit is published, otherwise
  ε-randomised response; exactly (ε, δ)-DP. The auditor guesses the published bits first.
  The δ = 0 bound is not sound for it (the test that the new bound is needed);
- the Gaussian mechanism N(b_j, σ²), σ calibrated to exactly (1, 1e-5)-DP (Balle & Wang 2018),
  guessing the top and bottom r/2 scores, where the privacy loss is largest.
"""

import numpy as np
import pytest
from scipy import optimize, special, stats

from workbench.accounting import gaussian_epsilon
from workbench.audit.one_run_bound import attainable_bound, epsilon_lower_bound, p_value

EPS, DELTA = 1.0, 1e-5


def exceedance(W, r, m, delta):
    """Fraction of runs whose bound exceeds EPS; the bound is computed once per distinct W."""
    bound = {w: epsilon_lower_bound(r, w, 0.95, delta=delta, canaries=m) for w in np.unique(W)}
    return float(np.mean([bound[w] > EPS for w in W]))


def slack(seeds):
    return stats.binom.ppf(0.999, seeds, 0.05) / seeds


@pytest.mark.parametrize("r", [10, 100, 1000])
def test_sound_on_randomised_response(r):
    seeds = 4000
    W = np.random.default_rng(r).binomial(r, special.expit(EPS), seeds)  # ε-DP: W ~ Bin(r, p)
    assert exceedance(W, r, None, 0.0) <= slack(seeds)
    assert exceedance(W, r, 10 * r, DELTA) <= slack(seeds)


def leaky_rr(m, r, seeds, rng):
    """(ε, δ)-DP: Bin(m, δ) canaries published; guess those first, then ε-RR outputs."""
    k = np.minimum(rng.binomial(m, DELTA, seeds), r)
    return k + rng.binomial(r - k, special.expit(EPS))


@pytest.mark.parametrize("m", [10 ** 3, 10 ** 5, 10 ** 6, 10 ** 7])
def test_sound_on_leaky_randomised_response(m):
    seeds, r = 2000, 10
    W = leaky_rr(m, r, seeds, np.random.default_rng(m))
    assert exceedance(W, r, m, DELTA) <= slack(seeds)


def test_ignoring_delta_is_not_sound():
    W = leaky_rr(10 ** 6, 10, 2000, np.random.default_rng(0))
    assert exceedance(W, 10, None, 0.0) > 0.5  # the δ = 0 bound: "95%" fails most runs


def gaussian_game(m, r, sigma, seeds, rng):
    W = np.empty(seeds, dtype=int)
    for s in range(seeds):
        b = rng.random(m) < 0.5  # (m,) secret bits
        score = b + sigma * rng.standard_normal(m)  # (m,) N(b_j, σ²)
        order = np.argpartition(score, [r // 2, m - r // 2 - 1])
        W[s] = (~b[order[:r // 2]]).sum() + b[order[m - r // 2:]].sum()
    return W


@pytest.mark.parametrize("m, seeds", [(10 ** 3, 400), (10 ** 4, 200), (10 ** 5, 40)])
def test_sound_on_the_gaussian_mechanism(m, seeds):
    sigma = optimize.brentq(lambda s: gaussian_epsilon(s, DELTA) - EPS, 0.5, 20)  # (1, 1e-5)
    W = gaussian_game(m, 20, sigma, seeds, np.random.default_rng(m))
    assert exceedance(W, 20, m, DELTA) <= slack(seeds)


@pytest.mark.parametrize("r, v, m", [(400, 260, 1000), (400, 400, 10 ** 5), (50, 45, 10 ** 4)])
def test_bound_is_where_the_p_value_reaches_beta(r, v, m):
    eps = epsilon_lower_bound(r, v, 0.95, delta=DELTA, canaries=m)
    assert eps > 0
    assert p_value(r, v, eps, DELTA, m) == pytest.approx(0.05, rel=1e-6)
    assert p_value(r, v, 0.99 * eps, DELTA, m) < 0.05 < p_value(r, v, 1.01 * eps, DELTA, m)


def test_p_value_matches_its_definition():
    r, v, m, eps = 30, 25, 500, 1.3
    p = special.expit(eps)
    f = [stats.binom.sf(k - 1, r, p) for k in range(v + 1)]  # f(k) = P[Bin >= k]
    alpha = max((f[v - i] - f[v]) / i for i in range(1, v + 1))
    assert p_value(r, v, eps, DELTA, m) == pytest.approx(f[v] + 2 * m * DELTA * alpha,
                                                         rel=1e-10)


def test_delta_costs_more_with_more_canaries():
    values = [attainable_bound(400, delta=DELTA, canaries=m) for m in (400, 10 ** 4, 10 ** 5)]
    assert attainable_bound(400) > values[0] > values[1] > values[2] > 0
    assert attainable_bound(400, delta=DELTA, canaries=10 ** 6) == 0.0  # 2mδ = 20: hopeless
    tiny = epsilon_lower_bound(400, 260, delta=1e-14, canaries=1000)
    assert tiny == pytest.approx(epsilon_lower_bound(400, 260), abs=1e-8)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="canaries"):
        epsilon_lower_bound(10, 5, delta=1e-5)
    with pytest.raises(ValueError, match="canaries"):
        epsilon_lower_bound(10, 5, delta=1e-5, canaries=5)
    with pytest.raises(ValueError, match="delta"):
        epsilon_lower_bound(10, 5, delta=1.5, canaries=100)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(10, 5, confidence=95)
    with pytest.raises(ValueError, match="correct"):
        p_value(10, 11, 1.0)
