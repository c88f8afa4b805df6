"""Noise calibration: the σ found spends the target ε to within 1e-3 of it and never more (the
default), or, given rtol, is within rtol of the least σ that meets it."""

import math

import numpy as np
import pytest

from workbench.accounting import (
    ACCOUNTANTS,
    DEFAULT_ORDERS,
    calibrate,
    epsilon,
    get_noise_multiplier,
    history_epsilon,
    steps_from_epochs,
    steps_per_epoch,
)

CASES = [(2.0, 1e-5, 0.01, 1000), (8.0, 1e-5, 256 / 60_000, 14_063), (1.0, 1e-6, 0.004, 10_000),
         (0.5, 1e-5, 0.001, 5000), (10.0, 1e-5, 0.1, 50), (3.0, 1e-3, 0.5, 20)]


#: Default orders plus large ones: RDP reaches ε = 1e-3 only with orders near 2 log(1/δ) / ε.
WIDE_ORDERS = np.concatenate([DEFAULT_ORDERS, 2.0 ** np.arange(11, 16)])


def assert_least_sigma(sigma, target, eps, rtol=0.01):
    """ε(σ) meets the target and ε(σ / (1 + rtol)) does not: σ <= (1 + rtol) σ_min, since ε
    falls monotonically in σ."""
    assert eps(sigma) <= target < eps(sigma / (1 + rtol))


def assert_in_band(sigma, target, eps, tau=1e-3):
    """Eq. (1) of calibrate.py: (1 - τ) ε* <= ε(σ) <= ε*."""
    e = eps(sigma)
    assert (1 - tau) * target <= e <= target, (sigma, e, target)


@pytest.mark.parametrize("target, delta, q, steps", CASES)
def test_rdp_sigma_spends_the_target_to_one_in_a_thousand(target, delta, q, steps):
    sigma = get_noise_multiplier(target, delta, q, steps=steps)
    assert_in_band(sigma, target, lambda s: epsilon(q, s, steps, delta))


@pytest.mark.parametrize("target, delta, q, steps", CASES)
def test_rtol_keeps_the_older_stop_on_sigma(target, delta, q, steps):
    sigma = get_noise_multiplier(target, delta, q, steps=steps, rtol=0.01)
    assert_least_sigma(sigma, target, lambda s: epsilon(q, s, steps, delta))


@pytest.mark.parametrize("name", sorted(ACCOUNTANTS))
def test_every_accountant_is_tight_in_epsilon(name):
    # the case: rtol = 1% on σ returned σ = 0.739 whose ε was 2.946, 1.8% below 3.0
    c = calibrate(3.0, 1e-5, 0.004, steps=2500, accountant=name)
    assert_in_band(c.noise_multiplier, 3.0, lambda s: epsilon(0.004, s, 2500, 1e-5, name))
    assert c.epsilon == epsilon(0.004, c.noise_multiplier, 2500, 1e-5, name)
    assert 0 <= c.unspent <= 1e-3 and c.evaluations >= 1
    tight = calibrate(3.0, 1e-5, 0.004, steps=2500, accountant=name, epsilon_tolerance=1e-5)
    assert 0 <= tight.unspent <= 1e-5


@pytest.mark.parametrize("accountant, target", [
    *[(a, t) for a in ("rdp", "pld") for t in (1e-3, 1e-2, 0.05, 1.0, 10.0)], ("rdp", 100.0),
    pytest.param("pld", 100.0, marks=pytest.mark.slow),  # ~10 s: a wide loss, a long grid
])
def test_relative_precision_from_tiny_to_huge_targets(accountant, target):
    steps = 1000
    options = {"orders": WIDE_ORDERS} if accountant == "rdp" else {}
    sigma = get_noise_multiplier(target, 1e-5, 0.01, steps=steps, accountant=accountant,
                                 **options)
    assert_in_band(sigma, target,
                   lambda s: epsilon(0.01, s, steps, 1e-5, accountant, **options))


def test_small_targets_no_longer_get_excess_noise():
    # an absolute tolerance of 0.01 in ε gave 777 here (42% too much noise); the least is ~545
    sigma = get_noise_multiplier(1e-3, 1e-5, 0.01, steps=1000, accountant="pld")
    assert 540 < sigma < 552


@pytest.mark.parametrize("target, delta, q, steps", CASES[:2])
def test_pld_sigma_is_least_and_needs_less_noise(target, delta, q, steps):
    sigma = get_noise_multiplier(target, delta, q, steps=steps, accountant="pld", rtol=0.02)
    assert_least_sigma(sigma, target, lambda s: epsilon(q, s, steps, delta, "pld"), rtol=0.02)
    assert sigma < get_noise_multiplier(target, delta, q, steps=steps)


@pytest.mark.parametrize("q, T", [(0.01, 100), (0.3, 3), (256 / 60_000, 234), (1.0, 1),
                                  (0.7, 1), (0.4, 2), (2 / 7, 4)])
def test_an_epoch_is_round_of_one_over_q_steps(q, T):
    # 1/0.4 = 2.5 -> 2 (half to even); 1/(2/7) = 3.4999999999999996 in floats -> 3.5 -> 4
    assert steps_per_epoch(q) == T
    for epochs in (1, 3, 20):
        assert steps_from_epochs(epochs, q) == epochs * T
    assert steps_from_epochs(2.5, q) == math.ceil(2.5 * T)  # a partial epoch rounds up


def test_epochs_calibrate_like_their_steps():
    assert steps_from_epochs(10, 0.01) == 1000  # 10 / 0.01 = 1000.0000000000001 in floats
    a = get_noise_multiplier(2.0, 1e-5, 0.01, epochs=10)
    assert a == get_noise_multiplier(2.0, 1e-5, 0.01, steps=1000)
    q = 256 / 60_000  # 1/q = 234.375: 20 epochs are 20 x 234 steps, not ceil(20 / q) = 4688
    assert get_noise_multiplier(3.0, 1e-5, q, epochs=20) == get_noise_multiplier(
        3.0, 1e-5, q, steps=4680)


def test_nothing_released_needs_no_noise():
    assert get_noise_multiplier(1.0, 1e-5, 0.0, steps=100) == 0.0
    assert get_noise_multiplier(1.0, 1e-5, 0.1, steps=0) == 0.0


def test_unreachable_target_is_a_clear_error():
    with pytest.raises(ValueError, match="target_epsilon=0.001 is unreachable.*orders"):
        get_noise_multiplier(0.001, 1e-5, 0.01, steps=100)


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=10, epochs=1), "exactly one of steps and epochs"),
    (dict(), "exactly one of steps and epochs"),
    (dict(steps=10, rtol=0), "rtol must be a finite number > 0"),
    (dict(steps=10, epsilon_tolerance=0), "epsilon_tolerance must be a finite number > 0"),
    (dict(steps=10, epsilon_tolerance=0.9), r"epsilon_tolerance must be in \[1e-6, 0.5\]"),
    (dict(steps=10, rtol=2.0), r"rtol must be in \[1e-6, 1\]"),
    (dict(epochs=1, sample_rate=0.0), r"sample_rate must be in \(0, 1\] \(steps per epoch "
                                       r"are 1 / sample_rate"),
    (dict(steps=10, accountant="gdp"), "accountant must be one of"),
    (dict(steps=-1), "steps must be a non-negative integer"),
    (dict(epochs=-2), "epochs must be a finite number > 0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_noise_multiplier(**({"target_epsilon": 2.0, "target_delta": 1e-5,
                                 "sample_rate": 0.01} | kwargs))


@pytest.mark.crosscheck
@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
@pytest.mark.parametrize("target, delta, q, steps", CASES)
def test_agrees_with_opacus(target, delta, q, steps):
    utils = pytest.importorskip("opacus.accountants.utils",
                                reason="Opacus not installed (pip install opacus)")
    theirs = utils.get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q,
                                        steps=steps, accountant="rdp", epsilon_tolerance=0.01)
    ours = get_noise_multiplier(target, delta, q, steps=steps)
    # Opacus lands anywhere in a 0.01-wide ε band, ours within 1% of the least σ (whose ε
    # may be up to ~0.03 below the target at large ε), and Opacus tries fewer orders (up to 63)
    assert math.isclose(ours, theirs, rel_tol=0.02)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibration_after_a_history_meets_the_target_over_the_whole_run(accountant):
    """The σ for new steps after groups already spent: the whole run's ε is in the band
    (it was calibrated for the new steps alone, the run ending at 3.8 for a target of 2,
    until 2026-11-30)."""
    history = [(1.0, 0.1, 10)]
    c = calibrate(5.0, 1e-5, 0.1, steps=30, accountant=accountant, history=history)
    whole = history_epsilon(history + [(c.noise_multiplier, 0.1, 30)], 1e-5, accountant)
    assert whole == c.epsilon and 5.0 * (1 - 1e-3) <= whole <= 5.0
    assert c.noise_multiplier > calibrate(5.0, 1e-5, 0.1, steps=30,
                                          accountant=accountant).noise_multiplier


def test_calibration_after_a_history_that_spent_the_target_is_refused():
    with pytest.raises(ValueError, match=r"target_epsilon=2.0 is already spent.*10 steps"):
        get_noise_multiplier(2.0, 1e-5, 0.1, steps=30, history=[(1.0, 0.1, 10)])


@pytest.mark.parametrize("q", [1e-160, 1e-300, 5e-324])
def test_a_vanishing_sample_rate_calibrates_without_an_overflow(q):
    """T q² underflows below q ≈ 1e-157: the first guess's division raised a bare
    ZeroDivisionError or OverflowError (probe of 2026-12-01). Now the search runs, and its σ
    keeps ε within the target."""
    result = calibrate(1.0, 1e-5, q, steps=10, accountant="rdp")
    assert epsilon(q, result.noise_multiplier, 10, 1e-5) <= 1.0
