"""The PLD accountant: discretisation, FFT composition and read-off against their slow twins.

- One step: the discrete δ(ε) must lie above the exact δ(ε) of the continuous pair (pld.py,
  Eqs. 1-2, closed form through Gaussian CDFs) and close to it.
- Composition: the FFT result equals repeated np.convolve to round-off (~1e-15 per point).
- Whole runs: never above RDP, and within 1% of dp-accounting's PLDAccountant at the same grid.
"""

import math

import numpy as np
import pytest
from scipy.stats import norm

from workbench.accounting import epsilon, epsilon_curve, history_epsilon
from workbench.accounting.compose import compose
from workbench.accounting.pld import (
    AUTO_GRID_POINTS,
    DiscretePLD,
    _g_inv,
    delta_for_epsilon,
    epsilon_for_delta,
    grid_step,
    loss_range,
    sgm_pld,
)


def exact_delta(q, sigma, eps, direction):
    """δ(ε) of one step of the continuous sampled Gaussian pair, pld.py Eq. (1)-(2)."""
    if direction == "remove":  # P = μ1, Q = μ0, {L > ε} = {x > x_ε}
        x = _g_inv(q, sigma, eps)
        p = (1 - q) * norm.sf(x / sigma) + q * norm.sf((x - 1) / sigma)
        return p - math.exp(eps) * norm.sf(x / sigma)
    x = _g_inv(q, sigma, -eps)  # add: P = μ0, Q = μ1, {L > ε} = {x < x'}
    if x == -np.inf:
        return 0.0
    return norm.cdf(x / sigma) - math.exp(eps) * (
        (1 - q) * norm.cdf(x / sigma) + q * norm.cdf((x - 1) / sigma))


@pytest.mark.parametrize("q, sigma", [(0.01, 1.0), (0.2, 0.8), (1.0, 2.0)])
@pytest.mark.parametrize("direction", ["remove", "add"])
def test_one_step_is_a_tight_upper_bound(q, sigma, direction):
    pld = sgm_pld(q, sigma, 1e-4, direction)
    assert pld.pmf.min() >= 0 and pld.pmf.sum() + pld.inf_mass == pytest.approx(1, abs=1e-12)
    assert np.dot(pld.pmf, np.exp(-pld.losses)) <= 1 + 1e-12  # E_P[e^-L] = Q-mass <= 1
    for eps in [0.0, 0.01, 0.1, 0.5, 1.0, 2.0]:
        exact, discrete = exact_delta(q, sigma, eps, direction), delta_for_epsilon(pld, eps)
        assert exact - 1e-15 <= discrete <= exact * (1 + 1e-4) + 1e-12, eps


def convolve_slowly(parts):
    """Composition the obvious way: np.convolve once per step. Returns (offset, pmf)."""
    offset, pmf = 0, np.array([1.0])
    for pld, t in parts:
        for _ in range(t):
            offset, pmf = offset + pld.offset, np.convolve(pmf, pld.pmf)
    return offset, pmf


def test_fft_composition_matches_repeated_convolution():
    a, b = sgm_pld(0.1, 1.0, 1e-2, "remove"), sgm_pld(0.3, 2.0, 1e-2, "remove")
    parts = [(a, 5), (b, 3)]
    fast = compose(parts)
    offset, slow = convolve_slowly(parts)
    window = slow[fast.offset - offset: fast.offset - offset + fast.pmf.size]
    assert np.abs(fast.pmf - window).max() < 1e-14
    assert slow.sum() - window.sum() < 1e-14  # the window holds all but the tails' mass
    assert fast.inf_mass == pytest.approx(1 - (1 - a.inf_mass) ** 5 * (1 - b.inf_mass) ** 3,
                                          abs=2e-15)


def test_read_off_inverts():
    pld = compose([(sgm_pld(0.01, 1.0, 1e-4, "remove"), 1000)])
    for delta in [1e-3, 1e-5, 1e-8]:
        eps = epsilon_for_delta(pld, delta)
        assert delta_for_epsilon(pld, eps) == pytest.approx(delta, rel=1e-9)
    point = DiscretePLD(h=0.5, offset=2, pmf=np.array([1.0]))  # L = 1 surely
    assert delta_for_epsilon(point, 0.0) == pytest.approx(1 - math.exp(-1))
    assert epsilon_for_delta(point, 1e-9) == pytest.approx(1.0)
    assert epsilon_for_delta(DiscretePLD(1e-3, 0, np.array([0.9]), 0.1), 0.05) == np.inf


@pytest.mark.parametrize("direction", ["remove", "add"])
def test_grid_is_refined_only_for_narrow_losses(direction):
    assert grid_step(1e-4, 0.01, 1.0, direction) == 1e-4
    assert 1e-6 <= grid_step(1e-4, 0.001, 3.0, direction) < 2e-5  # sd(L) ~ 3.4e-4 here
    assert grid_step(1e-4, 0.001, 3.0, direction, max_refine=1) == 1e-4
    lo, hi = loss_range(1e-6, 0.1, direction)  # narrow loss, long tail: refinement capped
    points = (hi - lo) / grid_step(1e-4, 1e-6, 0.1, direction)
    assert points <= max(AUTO_GRID_POINTS, (hi - lo) / 1e-4) + 1


def test_oversized_grids_are_refused_with_advice():
    with pytest.raises(ValueError, match="Use a larger discretization, or the RDP accountant"):
        sgm_pld(0.01, 0.5, 1e-8, "remove")


SETTINGS = [(0.01, 1.0, 1000, 1e-5), (256 / 60_000, 1.1, 3000, 1e-5), (0.1, 0.8, 100, 1e-6),
            (0.001, 3.0, 20_000, 1e-5), (1e-4, 1.0, 50_000, 1e-6)]


@pytest.mark.parametrize("q, sigma, steps, delta", SETTINGS)
def test_pld_is_never_above_rdp(q, sigma, steps, delta):
    assert epsilon(q, sigma, steps, delta, "pld") <= epsilon(q, sigma, steps, delta, "rdp")


def test_curve_matches_single_points_and_heterogeneous_history():
    steps = [0, 10, 300, 1000]
    curve = epsilon_curve(0.02, 1.2, steps, 1e-5, "pld")
    assert curve[0] == 0
    for t, e in zip(steps[1:], curve[1:]):
        assert e == pytest.approx(epsilon(0.02, 1.2, t, 1e-5, "pld"), rel=1e-9)
    split = history_epsilon([(1.2, 0.02, 400), (1.2, 0.02, 600)], 1e-5, "pld")
    assert split == pytest.approx(curve[-1], rel=1e-9)


@pytest.mark.crosscheck
@pytest.mark.parametrize("q, sigma, steps, delta", SETTINGS[:3])
def test_matches_dp_accounting(q, sigma, steps, delta):
    dpa = pytest.importorskip("dp_accounting",
                              reason="dp-accounting not installed (pip install dp-accounting)")
    accountant = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
    accountant.compose(dpa.SelfComposedDpEvent(event, steps))
    theirs = accountant.get_epsilon(delta)
    ours = epsilon(q, sigma, steps, delta, "pld", discretization=1e-4, max_refine=1)
    assert ours == pytest.approx(theirs, rel=1e-2)


@pytest.mark.crosscheck
def test_close_to_opacus_prv():
    accountants = pytest.importorskip("opacus.accountants",
                                      reason="Opacus not installed (pip install opacus)")
    prv = accountants.PRVAccountant()
    prv.history = [(1.0, 0.01, 1000)]
    # PRV is a different numerical method with its own error bound (eps_error = 0.01)
    assert epsilon(0.01, 1.0, 1000, 1e-5, "pld") == pytest.approx(prv.get_epsilon(1e-5),
                                                                  abs=0.02)


@pytest.mark.parametrize("sigma, steps, delta", [(6324.6, 10**7, 1e-10), (2.0, 3000, 1e-10),
                                                 (10.0, 10**5, 1e-10), (0.8, 1, 1e-5)])
def test_without_sampling_the_pld_is_the_exact_gaussian(sigma, steps, delta):
    """q = 1: the composition is one Gaussian mechanism, whose ε is exact; the FFT's round-off
    put the PLD below it at many steps near the δ floor (3.09793 for 3.09943 at T = 10^7)."""
    from workbench.accounting.accountants.pld import pld_curve, pld_epsilon
    from workbench.accounting.gaussian import gaussian_epsilon

    exact = gaussian_epsilon(sigma, delta, steps)
    assert pld_epsilon([(sigma, 1.0, steps)], delta) == pytest.approx(exact, rel=1e-11)
    assert pld_curve(1.0, sigma, [steps], delta)[0] == pytest.approx(exact, rel=1e-11)
    # two groups of other noise: one Gaussian of the composed noise
    both = pld_epsilon([(sigma, 1.0, steps), (2 * sigma, 1, steps)], delta)
    assert both == pytest.approx(gaussian_epsilon((1.25 * steps / sigma ** 2) ** -0.5, delta),
                                 rel=1e-11)
