"""The PLD accountant's ε is an upper bound including the FFT's round-off (``compose.py`` Eq. (3)).

Reference values: the exact Gaussian ε of a run's q = 1 part (a lower bound on the whole run),
and the same pessimistic PLD composed in long double at ever finer grids, which converges to the
truth from above (probe of 2026-11-30, /work/runs/probeQ R1-R3); float64 composition without the
bound came out below both.
"""

import numpy as np
import pytest

from workbench.accounting import epsilon, gaussian_epsilon, history_epsilon
from workbench.accounting.compose import compose
from workbench.accounting.pld import epsilon_for_delta, grid_step, sgm_pld


@pytest.mark.slow  # ~40 s each: the narrow group refines the grid shared with the wide one
@pytest.mark.parametrize("history, delta", [
    ([(1000.0, 1.0, 10**6), (1e4, 0.5, 1)], 1e-8),  # was 5.7759254 < 5.7760984
    ([(1000.0, 1.0, 10**6), (1e4, 0.5, 1)], 1e-10),  # was 6.5420264 < 6.5479241
    ([(50.0, 1.0, 10**5), (5.0, 0.001, 1000)], 1e-8),  # was 54.7788900 < 54.7790323
])
def test_mixed_q1_history_not_below_exact_gaussian(history, delta):
    s, _, t = history[0]
    lower = gaussian_epsilon(s, delta, t)
    eps = history_epsilon(history, delta, "pld")
    assert lower <= eps <= lower * (1 + 1e-4)


def test_mixed_q1_history_fast():
    """R1 on a grid that needs no refinement: the q = 1 group is merged into one exact step."""
    history = [(1000.0, 1.0, 10**6), (1.0, 0.5, 1)]
    assert history_epsilon(history, 1e-8, "pld") >= gaussian_epsilon(1000.0, 1e-8, 10**6)


def test_composed_q1_steps_not_below_exact():
    """The composition itself, q = 1 on the FFT path (no merging): float64 gave 5.77592 at
    h = 1e-5 (exact 5.77610); the bound of Eq. (3) must keep the reading above."""
    one = sgm_pld(1.0, 1000.0, 1e-5, "remove")
    pld = compose([(one, 10**6)])
    assert epsilon_for_delta(pld, 1e-8) >= gaussian_epsilon(1000.0, 1e-8, 10**6)


def test_float64_error_within_its_bound():
    """The measured side of Eq. (3): the float64 composition's actual l1 error (against long
    double) stays below the bound evaluated for float64 (measured 1/400-1/160 of it)."""
    q, s, T = 0.5, 1000.0, 10**6
    one = sgm_pld(q, s, grid_step(1e-4, q, s, "remove"), "remove")
    f64, ld = compose([(one, T)], dtype=np.float64), compose([(one, T)])
    err = np.abs(f64.pmf - ld.pmf).sum()
    assert 1e-13 < err < f64.roundoff + ld.roundoff
    assert ld.roundoff < 1e-3 * f64.roundoff


def test_qlt1_not_below_long_double_converged():
    """R2: q = 0.5, σ = 1000, T = 10^6, δ = 1e-10: was 3.0980534; the long-double compositions
    at h/1, h/2, h/4 give 3.1001258, 3.0996123, 3.0994772 (from above)."""
    eps = epsilon(0.5, 1000.0, 10**6, 1e-10, "pld")
    assert 3.0994772 <= eps <= 3.13


@pytest.mark.slow
def test_typical_qlt1_not_below_long_double_converged():
    """R3: q = 0.01, σ = 1, T = 10^5, δ = 1e-10: was 34.608935; long double at h = 1e-4, 5e-5,
    2.5e-5 gives 34.617241, 34.617072, 34.617044."""
    eps = epsilon(0.01, 1.0, 10**5, 1e-10, "pld")
    assert 34.617044 <= eps <= 34.617044 * 1.002


@pytest.mark.parametrize("steps, before", [(10**4, 1.97797495), (10**5, 7.27109693)])
def test_typical_settings_not_looser(steps, before):
    """q = 256/60000, σ = 1.1, δ = 1e-5: the bound costs nothing material (< 1e-6 relative)."""
    eps = epsilon(256 / 60000, 1.1, steps, 1e-5, "pld")
    assert eps == pytest.approx(before, rel=1e-6)


def test_roundoff_eating_delta_defers_to_rdp():
    """Where the bound is most of δ the answer is RDP's, with a warning saying so."""
    with pytest.warns(RuntimeWarning, match="round-off bound"):
        eps = epsilon(0.5, 1000.0, 10**7, 1e-10, "pld")
    assert eps == epsilon(0.5, 1000.0, 10**7, 1e-10, "rdp")
