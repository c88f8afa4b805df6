"""The PRV accountant (Gopi et al. 2021) against exact cases, the PLD accountant, dp-accounting
and Opacus: its interval [lower, upper] (prv.py, Eq. 3) must hold the true ε, and upper (what
the engine uses) must never fall below it."""

import math

import numpy as np
import pytest

from workbench.accounting import ACCOUNTANTS, epsilon, epsilon_curve, gaussian_epsilon
from workbench.accounting.accountant import make_accountant
from workbench.accounting.accountants.prv import (
    PRVAccountant,
    prv_curve,
    prv_epsilon,
    prv_epsilon_bounds,
)

GRID = [(1.0, 0.01, 1000, 1e-5), (0.8, 0.004, 2500, 1e-5), (2.0, 0.1, 100, 1e-6),
        (0.6, 0.02, 500, 1e-5), (5.0, 1.0, 10, 1e-5)]


@pytest.mark.parametrize("sigma, steps", [(1.0, 1), (5.0, 10), (20.0, 400)])
def test_q_one_holds_the_exact_gaussian_epsilon(sigma, steps):
    # q = 1: T Gaussian steps of σ are one Gaussian step of σ / √T, whose ε is exact
    exact = gaussian_epsilon(sigma / math.sqrt(steps), 1e-5)
    b = prv_epsilon_bounds([(sigma, 1.0, steps)], 1e-5)
    assert b.lower <= exact <= b.upper
    assert b.upper - b.lower < 2 * b.eps_error + 0.01


@pytest.mark.parametrize("sigma, q, steps, delta", GRID)
def test_interval_holds_the_pld_accountants_epsilon(sigma, q, steps, delta):
    # the PLD accountant is a tight upper bound (pessimistic grid): the truth is at most it,
    # and within its grid error of it, so PRV's lower end is below it and its upper end above
    # it less the PLD's own slack (1e-3 relative at these grids)
    b = prv_epsilon_bounds([(sigma, q, steps)], delta)
    pld = epsilon(q, sigma, steps, delta, "pld")
    assert b.lower <= pld <= b.upper + 1e-3 * pld
    assert b.lower <= b.estimate <= b.upper


def test_heterogeneous_history_and_the_stateful_class():
    history = [(1.0, 0.01, 300), (0.8, 0.02, 200)]
    acc = PRVAccountant()
    for s, q, t in history:
        acc.step(noise_multiplier=s, sample_rate=q, steps=t)
    b = acc.get_epsilon_bounds(1e-5)
    assert acc.get_epsilon(1e-5) == pytest.approx(b.upper) == prv_epsilon(history, 1e-5)
    assert b.lower <= epsilon(0.01, 1.0, 300, 1e-5, "pld") + 10  # sanity: finite
    pld = ACCOUNTANTS["pld"].epsilon(history, 1e-5)
    assert b.lower <= pld <= b.upper + 1e-3 * pld
    restored = PRVAccountant(eps_error=0.5)
    restored.load_state_dict(acc.state_dict())
    assert restored.history == acc.history and restored.eps_error == 0.01
    assert PRVAccountant().get_epsilon_bounds(1e-5).upper == 0.0  # nothing released yet


def test_curve_equals_pointwise_epsilon():
    steps = [100, 400, 1000]
    curve = prv_curve(0.01, 1.0, steps, 1e-5)
    points = [prv_epsilon([(1.0, 0.01, t)], 1e-5) for t in steps]
    # the curve uses the largest count's (finer) mesh for all: a different grid, same bound
    assert np.allclose(curve, points, atol=2e-3)
    assert np.all(np.diff(curve) > 0)
    assert np.allclose(epsilon_curve(0.01, 1.0, steps, 1e-5, "prv"), curve)


def test_registered_and_made_by_name():
    assert "prv" in ACCOUNTANTS and ACCOUNTANTS["prv"].slow
    assert isinstance(make_accountant("prv", eps_error=0.05), PRVAccountant)
    assert make_accountant("prv", eps_error=0.05).eps_error == 0.05


@pytest.mark.parametrize("kwargs, match", [
    (dict(delta_error=1e-5), "delta_error=1e-05 must be below delta"),
    (dict(eps_error=0), "eps_error must be a finite number > 0"),
    (dict(eps_error=1e-7), "grid points for one step"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prv_epsilon_bounds([(1.0, 0.01, 1000)], 1e-5, **kwargs)


@pytest.mark.crosscheck
@pytest.mark.parametrize("sigma, q, steps, delta", GRID)
def test_agrees_with_opacus_prv(sigma, q, steps, delta):
    prv = pytest.importorskip("opacus.accountants.prv", reason="Opacus not installed")
    theirs = prv.PRVAccountant()
    theirs.history = [(sigma, q, steps)]
    # the same algorithm and defaults: the remove direction dominates at these settings
    assert prv_epsilon([(sigma, q, steps)], delta) == pytest.approx(
        theirs.get_epsilon(delta), rel=1e-3)


@pytest.mark.crosscheck
@pytest.mark.parametrize("sigma, q, steps, delta", GRID[:3])
def test_upper_end_is_above_dp_accountings_optimistic_epsilon(sigma, q, steps, delta):
    dp = pytest.importorskip("dp_accounting", reason="dp-accounting not installed")
    optimistic = dp.pld.privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=q, pessimistic_estimate=False, value_discretization_interval=1e-4)
    low = optimistic.self_compose(steps).get_epsilon_for_delta(delta)  # never above the truth
    b = prv_epsilon_bounds([(sigma, q, steps)], delta)
    assert b.upper >= low  # upper >= truth >= optimistic: never below the true ε


def test_the_stated_interval_holds_the_truth_where_the_fft_round_off_is_near_delta():
    """q = 1e-5, σ = 0.6, T = 300,000 at δ = 1e-10: ~1.5M grid points whose FFT round-off
    adds ~1e-10 of mass; the interval stated was [1.42, 1.44] for a true ε at most 0.93
    (dp_accounting's pessimistic PLD) until 2026-11-30 (the accounting probe's U4)."""
    from dp_accounting.pld import privacy_loss_distribution as P
    truth_at_most = P.from_gaussian_mechanism(
        0.6, sampling_prob=1e-5, pessimistic_estimate=True,
        value_discretization_interval=1e-3).self_compose(300_000).get_epsilon_for_delta(1e-10)
    b = prv_epsilon_bounds([(0.6, 1e-5, 300_000)], 1e-10)
    assert b.lower <= truth_at_most
