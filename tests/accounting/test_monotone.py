"""Properties every accountant must have: ε grows with steps and q and falls with σ.

Hypothesis draws the configurations; example counts are modest so the run stays fast (the PLD
examples use a coarse grid, which keeps them upper bounds, and short runs).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.accounting import epsilon

q_st = st.floats(1e-4, 1.0)
sigma_st = st.floats(0.3, 10.0)
delta_st = st.sampled_from([1e-3, 1e-5, 1e-8])
FAST = settings(max_examples=40, deadline=None)
SLOW = settings(max_examples=8, deadline=None)
TOL = 1e-9  # ε ties (e.g. both 0) and float noise


def pld(q, sigma, steps, delta):
    return epsilon(q, sigma, steps, delta, "pld", discretization=1e-3)


@FAST
@given(q_st, sigma_st, st.integers(1, 10**5), st.integers(1, 10**5), delta_st)
def test_rdp_grows_with_steps(q, sigma, t1, t2, delta):
    lo, hi = sorted((t1, t2))
    assert epsilon(q, sigma, lo, delta) <= epsilon(q, sigma, hi, delta) + TOL


@FAST
@given(q_st, q_st, sigma_st, st.integers(1, 10**4), delta_st)
def test_rdp_grows_with_sample_rate(q1, q2, sigma, steps, delta):
    lo, hi = sorted((q1, q2))
    assert epsilon(lo, sigma, steps, delta) <= epsilon(hi, sigma, steps, delta) + TOL


@FAST
@given(q_st, sigma_st, sigma_st, st.integers(1, 10**4), delta_st)
def test_rdp_falls_with_noise(q, s1, s2, steps, delta):
    lo, hi = sorted((s1, s2))
    assert epsilon(q, hi, steps, delta) <= epsilon(q, lo, steps, delta) + TOL


@SLOW
@given(st.floats(1e-3, 0.3), st.floats(0.6, 4.0), st.integers(1, 500), st.integers(1, 500),
       delta_st)
def test_pld_grows_with_steps(q, sigma, t1, t2, delta):
    lo, hi = sorted((t1, t2))
    assert pld(q, sigma, lo, delta) <= pld(q, sigma, hi, delta) + TOL


@SLOW
@given(st.floats(1e-3, 0.3), st.floats(1e-3, 0.3), st.floats(0.6, 4.0), st.integers(1, 300),
       delta_st)
def test_pld_grows_with_sample_rate(q1, q2, sigma, steps, delta):
    lo, hi = sorted((q1, q2))
    assert pld(lo, sigma, steps, delta) <= pld(hi, sigma, steps, delta) + TOL


@SLOW
@given(st.floats(1e-3, 0.3), st.floats(0.6, 4.0), st.floats(0.6, 4.0), st.integers(1, 300),
       delta_st)
def test_pld_falls_with_noise(q, s1, s2, steps, delta):
    lo, hi = sorted((s1, s2))
    assert pld(q, hi, steps, delta) <= pld(q, lo, steps, delta) + TOL
