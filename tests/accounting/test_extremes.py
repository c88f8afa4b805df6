"""Accounting at the edges: σ beyond float64's reach, malformed histories and states, targets
no calibration can honour. Each answer is an upper bound on the true ε or a clear error that
names the argument (``noise_range.py``, ``curve.check_history``, ``calibrate.py``)."""

import math
import re

import numpy as np
import pytest

from workbench import accounting as A
from workbench.accounting.accountants.prv import PRVAccountant
from workbench.accounting.noise_range import SIGMA_CEILING

ACCOUNTANTS = ("rdp", "pld", "prv")


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
@pytest.mark.parametrize("sigma", [1e-300, 1e-60])
def test_almost_no_noise_is_infinite_epsilon(accountant, sigma):
    """Was: RuntimeError (series did not converge), OverflowError, or a grid refusal."""
    assert A.epsilon(0.01, sigma, 100, 1e-5, accountant) == math.inf
    assert A.epsilon(1.0, sigma, 1, 1e-5, accountant) == math.inf


@pytest.mark.parametrize("accountant, q", [("rdp", 1e-6), ("rdp", 0.5), ("pld", 1e-6),
                                           ("pld", 0.01), ("pld", 0.5), ("prv", 0.01)])
def test_huge_noise_is_no_worse_than_the_ceiling(accountant, q):
    """Was: ε = inf from PLD at σ = 1e17 (its loss rounds to 0 and the grid collapses), an
    OverflowError from every accountant at σ = 1e160. ε falls with σ, so at most ε(1e8)."""
    at_ceiling = A.epsilon(q, SIGMA_CEILING, 100, 1e-5, accountant)
    assert at_ceiling < 0.02
    for sigma in (1e17, 1e160, 1e300):
        assert A.epsilon(q, sigma, 100, 1e-5, accountant) == at_ceiling
    curve = A.epsilon_curve(q, 1e300, [0, 100], 1e-5, accountant)
    assert curve[0] == 0 and curve[1] == at_ceiling


def test_extreme_noise_in_every_entry_point():
    assert np.isinf(A.compute_rdp(0.1, 1e-300, 10, [2, 3.5])).all()
    assert np.isfinite(A.compute_rdp(0.1, 1e300, 10, [2, 3.5])).all()
    assert A.gaussian_epsilon(1e-300, 1e-5) == math.inf  # was: "epsilon must be finite"
    acc = A.RDPAccountant()
    acc.step(noise_multiplier=1e300, sample_rate=0.1)
    assert acc.get_epsilon(1e-5) < 0.01
    for sampler in A.SAMPLERS:
        b = A.epsilon_bounds(sampler, sample_rate=0.01, noise_multiplier=1e300, epochs=1,
                             delta=1e-5)
        assert b.lower == 0 and b.upper < 0.01, b
        b = A.epsilon_bounds(sampler, sample_rate=0.01, noise_multiplier=1e-300, epochs=1,
                             delta=1e-5)
        assert b.lower == b.upper == math.inf, b


def test_pld_is_never_above_rdp_even_where_its_grid_is_too_coarse():
    """q = 1, σ = 1e8, 1e12 steps: one Gaussian with σ = 100 (exact ε 0.0272). The PLD's
    finest grid swamped the loss (ε = 0.33, above RDP's 0.031): the registry promises PLD <= RDP
    and the calibration starts from it."""
    exact = A.gaussian_epsilon(100.0, 1e-5)
    rdp = A.epsilon(1.0, 1e8, 10**12, 1e-5, "rdp")
    pld = A.epsilon(1.0, 1e8, 10**12, 1e-5, "pld")
    assert exact <= pld <= rdp < 1.2 * exact
    assert A.epsilon_curve(1.0, 1e8, [10**12], 1e-5, "pld")[0] == pld


def test_prv_bounds_with_a_noise_free_group():
    """Was: OverflowError (the σ = 0 group went into the PRV grid)."""
    acc = PRVAccountant()
    acc.step(noise_multiplier=0.0, sample_rate=0.1, steps=10)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=10)
    b = acc.get_epsilon_bounds(1e-5)
    assert b.lower == b.estimate == b.upper == math.inf == acc.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="delta"):
        acc.get_epsilon_bounds(0.0)


@pytest.mark.parametrize("history, error, match", [
    ([(1.0, 0.1)], ValueError, r"triples.*group 0"),
    ("abc", TypeError, "triples"),
    (None, TypeError, "triples"),
    ([(1.0, 0.1, 5), (1.0, 0.1, -1)], ValueError, r"history\[1\] steps"),
    ([(float("nan"), 0.1, 5)], ValueError, r"history\[0\] noise_multiplier"),
])
def test_malformed_history_names_what_is_wrong(history, error, match):
    """Was: 'not enough values to unpack', 'NoneType object is not iterable'."""
    with pytest.raises(error, match=match):
        A.history_epsilon(history, 1e-5)
    acc = A.RDPAccountant()
    with pytest.raises(error, match=match):
        acc.load_state_dict({**acc.state_dict(), "history": history})


@pytest.mark.parametrize("name, bad", [("rdp", {"orders": [1.0, 2.0]}),
                                       ("prv", {"delta_error": -1.0})])
def test_a_refused_state_leaves_the_accountant_as_it_was(name, bad):
    """Was: the history was replaced before the options were refused (a half-loaded state)."""
    acc = A.make_accountant(name)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=7)
    before = acc.state_dict()
    state = {**before, "history": [[2.0, 0.5, 3]], **bad}
    with pytest.raises(ValueError):
        acc.load_state_dict(state)
    assert acc.state_dict() == before


def test_resumed_accountant_equals_the_uninterrupted_one():
    schedule = [(1.0, 0.01, 40), (0.8, 0.02, 30), (0.0, 0.0, 5), (1.2, 0.5, 3), (1.0, 0.01, 7)]
    for name in ("rdp", "pld"):
        full, first = A.make_accountant(name), A.make_accountant(name)
        for i, (s, q, t) in enumerate(schedule):
            for _ in range(t):
                full.step(noise_multiplier=s, sample_rate=q)
            if i < 2:
                first.step(noise_multiplier=s, sample_rate=q, steps=t)
        resumed = A.make_accountant(name)
        resumed.load_state_dict(first.state_dict())
        for s, q, t in schedule[2:]:
            resumed.step(noise_multiplier=s, sample_rate=q, steps=t)
        assert resumed.state_dict() == full.state_dict()
        assert resumed.get_epsilon(1e-5) == full.get_epsilon(1e-5)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("target", [1e6, 1e300, 1000.5])
def test_calibration_refuses_a_huge_target_by_name(accountant, target):
    """Was: σ = 0.023 for ε = 1e6 (RDP), a PLD grid error naming no argument, and a
    RuntimeError from the RDP series at 1e300."""
    with pytest.raises(ValueError, match="target_epsilon must be <= 1000"):
        A.get_noise_multiplier(target, 1e-5, 0.01, steps=1000, accountant=accountant)


def test_calibration_names_the_target_when_the_accountant_refuses_on_the_way():
    with pytest.raises(ValueError, match=r"target_epsilon=1.0 with accountant='pld'.*delta"):
        A.get_noise_multiplier(1.0, 1e-12, 0.01, steps=100, accountant="pld")


def test_calibration_where_no_noise_is_needed_returns_a_valid_sigma():
    """q T = 1e-6 <= δ: ε = 0 at every σ. PLD calibration shrank σ until its grid refused
    (a ValueError); now the least σ it computes, whose ε is within the target."""
    c = A.calibrate(1.0, 1e-5, 1e-6, steps=1, accountant="pld", discretization=0.05)
    assert c.noise_multiplier > 0
    assert A.epsilon(1e-6, c.noise_multiplier, 1, 1e-5, "pld", discretization=0.05) \
        == c.epsilon <= 1.0


@pytest.mark.parametrize("q, sigma, steps", [(1.0, 0.02, 1), (0.01, 0.02, 10), (0.5, 0.03, 3)])
def test_pld_of_a_loss_beyond_exp_overflow(q, sigma, steps):
    """σ = 0.02: one step's loss reaches ~1/(2σ²) = 1250, past e^709. The PLD's masses became
    NaN ('cannot convert float NaN to integer'); now an upper bound, below RDP's."""
    eps = A.epsilon(q, sigma, steps, 1e-5, "pld", discretization=0.05)
    assert eps <= A.epsilon(q, sigma, steps, 1e-5, "rdp")
    if q == 1.0:
        exact = A.gaussian_epsilon(sigma, 1e-5, steps=steps)
        assert exact <= eps <= exact * (1 + 1e-4)


@pytest.mark.parametrize("sigma, steps", [(0.5, 1), (10.0, 10)])
def test_full_batch_is_never_below_the_exact_gaussian(sigma, steps):
    """q = 1: T steps are one Gaussian mechanism with σ/√T (Balle & Wang 2018): every
    accountant's ε is at least the exact one, and not far above it."""
    for delta in (1e-5, 0.5):
        exact = A.gaussian_epsilon(sigma, delta, steps=steps)
        for accountant in ACCOUNTANTS:
            eps = A.epsilon(1.0, sigma, steps, delta, accountant)
            assert exact - 1e-9 <= eps, (accountant, delta, eps, exact)
            if accountant != "rdp":  # RDP's conversion is loose at large δ (0.19 for 0)
                assert eps <= exact + 0.02, (accountant, delta, eps, exact)


def test_prv_refuses_a_delta_below_its_fft_floor():
    """Was (q = 1, σ = 5, T = 10): a lower bound above the exact ε from δ ≈ 7e-15, inf at
    1e-16, a bare ZeroDivisionError at 5e-324. As the PLD accountant: refused below 1e-10."""
    for delta in (1e-13, 1e-16, 5e-324):
        with pytest.raises(ValueError, match="PRV accountant's FFT round-off"):
            A.epsilon(1.0, 5.0, 10, delta, "prv")
    assert A.epsilon(1.0, 5.0, 10, 1e-10, "prv") > 0


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_calibration_to_a_tiny_target_is_a_named_error(accountant):
    """Was: a bare ZeroDivisionError in the starting guess (ε ≈ 1e-16: the two roots
    cancelled), and with PLD a "please report this case" RuntimeError at 1e-12."""
    for target in (1e-16, 1e-12):
        try:  # (PLD resolves 1e-12 here since its search starts at SIGMA_MAX: 2026-12-02)
            sigma = A.get_noise_multiplier(target, 1e-5, 0.01, steps=100,
                                           accountant=accountant)
        except ValueError as err:
            assert re.search("target_epsilon|noise calibration", str(err)), err
        else:
            assert accountant == "pld" and target == 1e-12, sigma
            assert A.epsilon(0.01, sigma, 100, 1e-5, accountant="pld") <= target


def test_pld_refines_a_narrow_group_only_as_far_as_a_wide_one_fits():
    """Was: "discretization=1e-06 would need 3.47e+07 grid points" for the default 1e-4 (the
    narrow group's refinement applied to the wide group). Each group alone, and the pair,
    are upper bounds of RDP's size or below."""
    history = [(20.0, 1e-4, 1000), (0.3, 0.5, 10)]
    both = A.history_epsilon(history, 1e-5, "pld")
    wide = A.history_epsilon(history[1:], 1e-5, "pld")
    assert wide <= both <= A.history_epsilon(history, 1e-5, "rdp")
    assert both <= wide * 1.001 + 1e-3  # the narrow group adds almost nothing


def test_engine_bounds_before_any_step_are_zero():
    """Was: 'inf <= epsilon <= inf (1 steps; no noise)': no step read as one step without
    noise. Nothing released: 0 <= ε <= 0, as get_epsilon's 0."""
    import warnings

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import workbench as wb

    for poisson in (True, False):
        model = nn.Linear(5, 2)
        engine = wb.PrivacyEngine()
        loader = DataLoader(TensorDataset(torch.randn(100, 5), torch.randint(0, 2, (100,))),
                            batch_size=10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                        lr=0.1),
                                data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                poisson_sampling=poisson)
        bounds = engine.epsilon_bounds(1e-5)
        assert (bounds.lower, bounds.upper, bounds.steps) == (0.0, 0.0, 0)
        assert engine.get_epsilon(1e-5) == 0.0


@pytest.mark.parametrize("q", [1e-10, 1e-8, 1e-4, 0.5])
@pytest.mark.parametrize("sigma", [0.7, 1.0, 100.0])
def test_integer_order_rdp_is_exact_however_small(q, sigma):
    """Against a 60-digit sum of Eq. (2). Was: at q = 1e-8, σ = 1 order 4 was 5% low and order
    2 42% high (the k = 0, 1 terms cancelled against 1 in float64); at q = 1e-10, σ = 100
    order 2 was 1.6e7 times too high."""
    import mpmath as mp

    mp.mp.dps = 60
    orders = [2, 3, 4, 16, 128]
    got = A.compute_rdp(q, sigma, 1, orders)
    for a, g in zip(orders, got):
        qq, s = mp.mpf(q), mp.mpf(sigma)
        total = mp.fsum(mp.binomial(a, k) * (1 - qq) ** (a - k) * qq ** k
                        * mp.e ** (mp.mpf(k * k - k) / (2 * s * s)) for k in range(a + 1))
        want = float(mp.log(total) / (a - 1))
        assert abs(g - want) <= 1e-10 * want, (a, g, want)


@pytest.mark.parametrize("sigma", [1e-12, 1e-10, 1e-9, 1e-6, 1e-3, 0.3, 1.0, 50.0, 1e8])
def test_the_exact_gaussian_delta_keeps_its_digits_at_any_sigma(sigma):
    """Against a 60-digit Eq. (1), at ε around the one of δ = 1e-5 (where ε is ~1/(2σ²) for a
    tiny σ). Was: e^ε Φ(-a-b) taken as exp(ε + log Φ(-a-b)) cancelled two numbers of size
    1/(2σ²): at σ = 1e-10 the reported ε had a true δ of 0.19; σ <= 1e-12 gave δ = 0."""
    import mpmath as mp

    mp.mp.dps = 60
    base = A.gaussian_epsilon(sigma, 1e-5)
    tol = 1e-8 + 1e-15 / sigma  # (a - εσ, of two numbers ~1/(2σ), holds 1e-16/σ of rounding:
    # the float inputs' own condition, ~ one ulp of ε)
    for eps in (0.0, base * 0.5, base, base * 1.5):
        s, e = mp.mpf(sigma), mp.mpf(eps)
        a, b = 1 / (2 * s), e * s
        want = float(mp.ncdf(a - b) - mp.e ** e * mp.ncdf(-a - b))
        got = A.gaussian_delta(sigma, eps)
        assert abs(got - want) <= tol * want + 1e-300, (eps, got, want)
    truth = mp.ncdf(1 / (2 * mp.mpf(sigma)) - mp.mpf(base) * sigma) \
        - mp.e ** mp.mpf(base) * mp.ncdf(-1 / (2 * mp.mpf(sigma)) - mp.mpf(base) * sigma)
    assert float(truth) <= 1e-5 * (1 + tol)  # the ε reported holds δ
