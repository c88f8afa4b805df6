"""RDP of the sampled Gaussian mechanism against its slow twins: quadrature and the binomial sum.

The reference for every order is the definition itself, A_α = E_{z~μ0}[(1 - q + q r(z))^α]
(rdp.py, Eq. 1), integrated with scipy.integrate.quad; A_α - 1 is integrated rather than A_α
so that tiny RDP values keep their relative precision. quad reaches ~1e-12 relative here, and
the series tolerance RTOL = 1e-14 leaves the workbench well inside that, so the bar is 1e-8.
"""

import math
import warnings

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm

from workbench.accounting import DEFAULT_ORDERS, compute_rdp, rdp_to_epsilon

CASES = [(0.01, 1.0), (0.004, 1.1), (0.1, 0.7), (0.5, 1.0), (0.9, 2.0), (0.01, 0.5), (0.001, 4.0)]


def rdp_by_quadrature(q, sigma, alpha):
    """ε(α) = log(A_α) / (α - 1) with A_α - 1 integrated numerically (rdp.py, Eq. 1)."""

    def integrand(z):
        log_ratio = np.logaddexp(np.log1p(-q), np.log(q) + (2 * z - 1) / (2 * sigma**2))
        return norm.pdf(z, scale=sigma) * np.expm1(alpha * log_ratio)

    z0 = sigma**2 * math.log(1 / q - 1) + 0.5  # the integrand changes regime here
    lo, hi = -20 * sigma, 1 + 20 * sigma + alpha * sigma
    points = sorted(z for z in {-10 * sigma, 0.0, 0.5, 1.0, z0, 1 + 10 * sigma} if lo < z < hi)
    with warnings.catch_warnings():  # quad warns that 1e-13 is hard; it still gets ~1e-12
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        a_minus_1, _ = integrate.quad(integrand, lo, hi, points=points, epsabs=0, epsrel=1e-13,
                                      limit=500)
    return math.log1p(a_minus_1) / (alpha - 1)


def rdp_by_binomial_sum(q, sigma, alpha):
    """Integer α: Eq. (2) term by term in Python floats (the obviously correct loop).

    Terms are kept as logarithms and shifted by the largest before summing, only so that
    exp((k² - k) / (2σ²)) does not overflow for small σ.
    """
    logs = [math.log(math.comb(alpha, k)) + (alpha - k) * math.log1p(-q) + k * math.log(q)
            + (k * k - k) / (2 * sigma**2) for k in range(alpha + 1)]
    top = max(logs)
    return (top + math.log(sum(math.exp(t - top) for t in logs))) / (alpha - 1)


@pytest.mark.parametrize("q, sigma", CASES)
@pytest.mark.parametrize("alpha", [1.1, 1.5, 2.5, 4.7, 9.3])
def test_fractional_orders_match_quadrature(q, sigma, alpha):
    expected = rdp_by_quadrature(q, sigma, alpha)
    got = compute_rdp(q, sigma, 1, [alpha])[0]
    assert got == pytest.approx(expected, rel=1e-8, abs=1e-15)


@pytest.mark.parametrize("q, sigma", CASES)
@pytest.mark.parametrize("alpha", [2, 3, 8, 20])
def test_integer_orders_match_binomial_sum_and_quadrature(q, sigma, alpha):
    got = compute_rdp(q, sigma, 1, [alpha])[0]
    assert got == pytest.approx(rdp_by_binomial_sum(q, sigma, alpha), rel=1e-10)
    if alpha <= 8:  # quadrature of the huge integrands of high orders is itself inaccurate
        assert got == pytest.approx(rdp_by_quadrature(q, sigma, alpha), rel=1e-8, abs=1e-15)


def test_rdp_is_linear_in_steps_and_vectorised_over_orders():
    one = compute_rdp(0.02, 1.3, 1, DEFAULT_ORDERS)
    assert np.allclose(compute_rdp(0.02, 1.3, 250, DEFAULT_ORDERS), 250 * one, rtol=1e-13)
    singles = [compute_rdp(0.02, 1.3, 1, [a])[0] for a in DEFAULT_ORDERS[::7]]
    assert np.allclose(one[::7], singles, rtol=1e-12)


def test_rdp_grows_with_the_order():
    for q, sigma in CASES:
        rdp = compute_rdp(q, sigma, 1, DEFAULT_ORDERS)
        assert np.all(np.diff(rdp) >= -1e-12 * rdp[1:]), (q, sigma)


def test_edge_cases():
    orders = [1.5, 2, 10, 64.5]
    assert compute_rdp(0.0, 1.0, 100, orders).tolist() == [0.0] * 4
    assert np.allclose(compute_rdp(1.0, 2.0, 3, orders), 3 * np.array(orders) / 8)
    assert np.isinf(compute_rdp(0.1, 0.0, 1, orders)).all()
    assert compute_rdp(0.1, 0.0, 0, orders).tolist() == [0.0] * 4  # no steps, no loss
    near_one = compute_rdp(1 - 1e-9, 2.0, 1, orders)  # continuous at q -> 1
    assert np.allclose(near_one, np.array(orders) / 8, rtol=1e-6)


def test_default_orders_cover_the_documented_range():
    assert DEFAULT_ORDERS[0] == pytest.approx(1.1) and DEFAULT_ORDERS.max() >= 1024
    assert set(np.round(np.arange(1.1, 11.0, 0.1), 1)) <= set(np.round(DEFAULT_ORDERS, 1))
    assert set(range(11, 64)) <= set(DEFAULT_ORDERS.tolist())
    assert not DEFAULT_ORDERS.flags.writeable


@pytest.mark.crosscheck
@pytest.mark.parametrize("q, sigma", CASES)
def test_matches_opacus(q, sigma):
    analysis = pytest.importorskip("opacus.accountants.analysis.rdp",
                                   reason="Opacus not installed (pip install opacus)")
    ours = compute_rdp(q, sigma, 10, DEFAULT_ORDERS)
    theirs = analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=10,
                                  orders=DEFAULT_ORDERS.tolist())
    # Opacus stops its series at terms below e^-30 (~1e-13 absolute in A_α)
    assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-10)


@pytest.mark.crosscheck
@pytest.mark.parametrize("q, sigma", CASES)
def test_epsilon_matches_dp_accounting_at_integer_orders(q, sigma):
    """Integer orders only: dp-accounting 0.6's fractional-order series is off by up to 7% at
    α = 1.1 (q = 0.01, σ = 1) and gives up for q = 1/2, where quadrature agrees with us."""
    dpa = pytest.importorskip("dp_accounting",
                              reason="dp-accounting not installed (pip install dp-accounting)")
    orders = [a for a in DEFAULT_ORDERS.tolist() if a == int(a)]
    accountant = dpa.rdp.RdpAccountant(orders=orders)
    accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), 500)
    theirs, their_order = accountant.get_epsilon_and_optimal_order(1e-5)
    ours, order = rdp_to_epsilon(orders, compute_rdp(q, sigma, 500, orders), 1e-5)
    assert ours == pytest.approx(theirs, rel=1e-9) and order == their_order


def test_tiny_q_huge_sigma_rounds_to_zero_not_negative():
    from workbench.accounting.rdp import rdp_one_step

    orders = np.array([1.1, 1.5, 2.0, 32.0])
    assert (rdp_one_step(16 / 60000, 9000.0, orders) >= 0).all()
