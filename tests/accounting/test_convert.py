"""RDP -> (ε, δ), and both accountants against the exact Gaussian mechanism at q = 1.

One step without subsampling is the Gaussian mechanism, whose exact privacy profile is known
(Balle & Wang 2018, arXiv:1805.06530, Thm. 8): with sensitivity 1 and noise σ,

    δ(ε) = Φ(1/(2σ) - εσ) - e^ε Φ(-1/(2σ) - εσ).

Every valid accountant must report an ε at least this large; RDP is loose by a visible margin,
PLD (an upper bound too) sits within its grid error above it.
"""

import math

import numpy as np
import pytest
from scipy import integrate
from scipy.optimize import brentq
from scipy.stats import norm

from workbench.accounting import (
    DEFAULT_ORDERS,
    compute_rdp,
    epsilon,
    gaussian_delta,
    gaussian_epsilon,
    rdp_to_epsilon,
)


def analytic_gaussian_delta(sigma, eps):
    """Exact δ(ε) of one Gaussian mechanism step (Balle & Wang 2018, Thm. 8)."""
    return (norm.cdf(1 / (2 * sigma) - eps * sigma)
            - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma))


def analytic_gaussian_epsilon(sigma, delta):
    """Exact ε(δ) of one Gaussian mechanism step: the equation above solved for ε."""
    if analytic_gaussian_delta(sigma, 0.0) <= delta:
        return 0.0
    return brentq(lambda e: analytic_gaussian_delta(sigma, e) - delta, 0.0, 500.0, xtol=1e-14)


def test_formula_by_hand():
    alpha, rdp, delta = 8.0, 0.5, 1e-5
    expected = rdp + math.log((alpha - 1) / alpha) - (math.log(delta) + math.log(alpha)) / 7
    eps, order = rdp_to_epsilon([alpha], [rdp], delta)
    assert eps == pytest.approx(expected, rel=1e-14) and order == alpha


def test_best_order_and_vectorised_rows():
    rdp = compute_rdp(0.01, 1.0, 1, DEFAULT_ORDERS)
    steps = np.array([10, 100, 1000, 10000])
    eps, orders = rdp_to_epsilon(DEFAULT_ORDERS, np.outer(steps, rdp), 1e-5)
    for t, e, a in zip(steps, eps, orders):
        assert (e, a) == rdp_to_epsilon(DEFAULT_ORDERS, t * rdp, 1e-5)
    assert np.all(np.diff(eps) > 0) and np.all(np.diff(orders) <= 0)  # more steps: lower α


def test_never_negative_and_infinite_rdp():
    assert rdp_to_epsilon([2.0, 32.0], [0.0, 0.0], 0.5)[0] == 0.0  # formula gives -0.69
    eps, _ = rdp_to_epsilon([2.0, 3.0], [np.inf, np.inf], 1e-5)
    assert eps == np.inf


@pytest.mark.parametrize("bad, match", [
    (dict(orders=[2.0, 3.0], rdp=[0.1]), "one value per order"),
    (dict(orders=[2.0], rdp=[-0.1]), "rdp must be >= 0"),
    (dict(orders=[2.0], rdp=[np.nan]), "rdp must be >= 0"),
    (dict(orders=[1.0], rdp=[0.1]), "orders must all be finite and > 1"),
    (dict(orders=[2.0], rdp=[0.1], delta=0.0), r"delta must be in \(0, 1\)"),
])
def test_bad_input(bad, match):
    args = dict(delta=1e-5) | bad
    with pytest.raises(ValueError, match=match):
        rdp_to_epsilon(args["orders"], args["rdp"], args["delta"])


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-8])
def test_accountants_bound_the_exact_gaussian_mechanism(sigma, delta):
    exact = analytic_gaussian_epsilon(sigma, delta)
    rdp = epsilon(1.0, sigma, 1, delta, accountant="rdp")
    pld = epsilon(1.0, sigma, 1, delta, accountant="pld")
    assert rdp >= exact  # RDP is a valid bound, and visibly loose for one step
    assert exact <= pld <= exact * (1 + 1e-3) + 1e-4  # PLD: an upper bound within its grid


@pytest.mark.parametrize("sigma, eps", [(0.5, 0.5), (1.0, 1.0), (2.0, 0.1), (3.0, 2.0)])
def test_library_gaussian_profile_is_the_hockey_stick_integral(sigma, eps):
    """δ(ε) = ∫ (p1 - e^ε p0)_+ dx for p1 = N(1, σ²), p0 = N(0, σ²), numerically."""

    def integrand(x):
        return max(norm.pdf(x, 1, sigma) - math.exp(eps) * norm.pdf(x, 0, sigma), 0.0)

    cut = eps * sigma**2 + 0.5  # where the integrand becomes positive
    expected, _ = integrate.quad(integrand, cut, cut + 40 * sigma, epsabs=1e-15, epsrel=1e-12)
    assert gaussian_delta(sigma, eps) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert gaussian_epsilon(sigma, expected) == pytest.approx(eps, rel=1e-7)
    assert gaussian_delta(sigma, eps) == pytest.approx(analytic_gaussian_delta(sigma, eps),
                                                       rel=1e-12)


@pytest.mark.parametrize("sigma, steps", [(5.0, 100), (2.0, 10), (20.0, 1000)])
def test_full_batch_pld_matches_the_exact_composed_gaussian(sigma, steps):
    """q = 1: T steps are one Gaussian mechanism with noise σ / sqrt(T) (gaussian.py)."""
    exact = gaussian_epsilon(sigma, 1e-5, steps)
    assert exact == pytest.approx(analytic_gaussian_epsilon(sigma / math.sqrt(steps), 1e-5))
    assert exact - 1e-9 <= epsilon(1.0, sigma, steps, 1e-5, "pld") <= exact * (1 + 1e-5)
    assert epsilon(1.0, sigma, steps, 1e-5, "rdp") > exact
