"""Noise calibration: the σ found spends between target - tolerance and the target."""

import math

import pytest

from workbench.accounting import epsilon, get_noise_multiplier, steps_from_epochs

CASES = [(2.0, 1e-5, 0.01, 1000), (8.0, 1e-5, 256 / 60_000, 14_063), (1.0, 1e-6, 0.004, 10_000),
         (0.5, 1e-5, 0.001, 5000), (10.0, 1e-5, 0.1, 50), (3.0, 1e-3, 0.5, 20)]


@pytest.mark.parametrize("target, delta, q, steps", CASES)
def test_rdp_sigma_lands_in_the_tolerance_band(target, delta, q, steps):
    sigma = get_noise_multiplier(target, delta, q, steps=steps)
    assert target - 0.01 <= epsilon(q, sigma, steps, delta) <= target


@pytest.mark.parametrize("target, delta, q, steps", CASES[:2])
def test_pld_sigma_lands_in_the_band_and_needs_less_noise(target, delta, q, steps):
    sigma = get_noise_multiplier(target, delta, q, steps=steps, accountant="pld", tolerance=0.05)
    assert target - 0.05 <= epsilon(q, sigma, steps, delta, "pld") <= target
    assert sigma < get_noise_multiplier(target, delta, q, steps=steps)


def test_epochs_mean_ceil_of_epochs_over_q():
    assert steps_from_epochs(10, 0.01) == 1000  # 10 / 0.01 = 1000.0000000000001 in floats
    assert steps_from_epochs(1, 0.3) == 4
    a = get_noise_multiplier(2.0, 1e-5, 0.01, epochs=10)
    assert a == get_noise_multiplier(2.0, 1e-5, 0.01, steps=1000)


def test_nothing_released_needs_no_noise():
    assert get_noise_multiplier(1.0, 1e-5, 0.0, steps=100) == 0.0
    assert get_noise_multiplier(1.0, 1e-5, 0.1, steps=0) == 0.0


def test_unreachable_target_is_a_clear_error():
    with pytest.raises(ValueError, match="target_epsilon=0.001 is unreachable.*orders"):
        get_noise_multiplier(0.001, 1e-5, 0.01, steps=100)


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=10, epochs=1), "exactly one of steps and epochs"),
    (dict(), "exactly one of steps and epochs"),
    (dict(steps=10, tolerance=0), "tolerance must be a finite number > 0"),
    (dict(steps=10, accountant="gdp"), "accountant must be one of"),
    (dict(steps=-1), "steps must be a non-negative integer"),
    (dict(epochs=-2), "epochs must be a finite number > 0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_noise_multiplier(2.0, 1e-5, 0.01, **kwargs)


@pytest.mark.crosscheck
@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
@pytest.mark.parametrize("target, delta, q, steps", CASES)
def test_agrees_with_opacus(target, delta, q, steps):
    utils = pytest.importorskip("opacus.accountants.utils",
                                reason="Opacus not installed (pip install opacus)")
    theirs = utils.get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q,
                                        steps=steps, accountant="rdp", epsilon_tolerance=0.01)
    ours = get_noise_multiplier(target, delta, q, steps=steps)
    # both land anywhere in a 0.01-wide ε band, and Opacus tries fewer orders (up to 63)
    assert math.isclose(ours, theirs, rel_tol=0.02)
