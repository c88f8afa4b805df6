"""The budget explorer's compute step: curves, solve mode, and the coarse PLD grid's accuracy."""

import numpy as np
import pytest

from workbench import accounting
from workbench.accounting import epsilon, explore_budget


def test_curves_follow_the_configuration():
    r = explore_budget(60_000, 256, 1.1, 60, 1e-5, points=30, pld_points=6)
    assert r.sample_rate == 256 / 60_000 and r.steps == 14_040  # 60 epochs x round(1 / q)
    assert r.rdp_epochs.shape == r.rdp_epsilon.shape == (30,)
    assert r.pld_epochs.shape == r.pld_epsilon.shape == (6,)
    assert r.rdp_epochs[-1] == r.pld_epochs[-1] == 60
    assert np.all(np.diff(r.rdp_epsilon) > 0) and np.all(np.diff(r.pld_epsilon) > 0)
    assert r.epsilon_rdp == pytest.approx(epsilon(r.sample_rate, 1.1, r.steps, 1e-5))
    assert r.epsilon_pld < r.epsilon_rdp


@pytest.mark.parametrize("n, b, sigma, epochs", [(60_000, 256, 1.1, 60), (50_000, 512, 0.8, 20),
                                                  (1000, 100, 1.0, 50), (60_000, 60, 3.0, 30)])
def test_coarse_pld_grid_is_an_upper_bound_within_one_percent(n, b, sigma, epochs):
    r = explore_budget(n, b, sigma, epochs, 1e-5, points=2, pld_points=1)
    fine = epsilon(b / n, sigma, r.steps, 1e-5, "pld")
    assert fine - 1e-9 <= r.epsilon_pld <= fine * 1.01


def test_solve_mode_hits_the_target():
    r = explore_budget(60_000, 256, 99.0, 60, 1e-5, mode="solve", target_epsilon=3.0)
    assert r.epsilon_rdp <= 3.0 < epsilon(r.sample_rate, r.noise_multiplier / 1.01, r.steps, 1e-5)
    assert r.epsilon_pld < 3.0
    assert r.noise_multiplier != 99.0 and r.target_epsilon == 3.0


def test_shuffle_bracket_is_epsilon_bounds_on_a_coarser_loss_grid():
    # N = 60,000, B = 256 (T_b = 234 batches per epoch): the lower bound is far above Poisson's
    r = explore_budget(60_000, 256, 1.1, 60, 1e-5, points=2, pld_points=1, shuffle_points=3)
    assert r.shuffle_epochs.tolist() == [20, 40, 60]
    for e, lower, upper in zip(r.shuffle_epochs, r.shuffle_lower, r.shuffle_upper):
        b = accounting.epsilon_bounds("shuffle", sample_rate=256 / 60_000, noise_multiplier=1.1,
                                      epochs=int(e), delta=1e-5)
        assert upper == b.upper and 0.99 * b.lower <= lower <= b.lower  # coarse: still below
    assert r.epsilon_shuffle[0] > 4 * r.epsilon_pld  # measured: 10.8 vs 2.38
    assert explore_budget(60_000, 256, 1.1, 0.5, 1e-5).epsilon_shuffle is None  # < 1 epoch
    off = explore_budget(60_000, 256, 1.1, 60, 1e-5, shuffle=False)
    assert off.shuffle_epochs.size == off.shuffle_lower.size == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), r"batch_size must be an integer in \[1, dataset_size=1000\]; got 0"),
    (dict(batch_size=1001), r"batch_size must be an integer in \[1, dataset_size=1000\]"),
    (dict(dataset_size=0), "dataset_size must be a positive integer; got 0"),
    (dict(epochs=0), "epochs must be a finite number > 0"),
    (dict(mode="solve"), "target_epsilon must be a real number"),
    (dict(mode="guess"), "mode must be one of"),
    (dict(points=0), r"points must be an integer in \[1, 1000000\]; got 0"),
    (dict(pld_points=2.5), r"pld_points must be an integer in \[1, 1000000\]; got 2.5"),
    (dict(shuffle_points=0), r"shuffle_points must be an integer in \[1, 1000000\]; got 0"),
])
def test_bad_input(kwargs, match):
    args = dict(dataset_size=1000, batch_size=100, noise_multiplier=1.0, epochs=5, delta=1e-5)
    with pytest.raises((ValueError, TypeError), match=match):
        explore_budget(**(args | kwargs))
