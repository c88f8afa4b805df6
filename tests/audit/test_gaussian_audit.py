"""The tight Gaussian-step audit: sound on correct steps, near the claim, and it catches half noise.

Setting: σ = 2 (the exact per-step ε at δ = 1e-5 is 1.993; PLD reports the same), C = 1.5,
B = 8, d = 500 canaries per call, 100 calls (5·10⁴ scores), fixed seeds.
"""

import matplotlib
import numpy as np
import pytest
import torch
from scipy import stats

from workbench.audit import bug_zoo
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.gaussian_audit import audit_gaussian_step, mu_lower_bound

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

C, SIGMA, B, DIM, CALLS = 1.5, 2.0, 8, 500, 100


def _audit(factory, sigma_used=SIGMA, seed=0):
    step = factory(C, sigma_used, B, torch.Generator().manual_seed(seed + 1))
    return audit_gaussian_step(step, DIM, B, C, SIGMA, calls=CALLS,
                               generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("factory", [
    bug_zoo.correct_step, pytest.param(workbench_step, marks=pytest.mark.slow)],
    ids=["correct_step", "workbench_step"])
def test_correct_step_passes_and_reaches_half_the_claim(factory):
    a = _audit(factory)
    row = a.table.iloc[0]
    assert a.passed and row.observations == DIM * CALLS
    assert row.epsilon_upper == pytest.approx(1.993, abs=1e-3)
    assert 0.5 * row.epsilon_upper <= row.epsilon_lower <= row.epsilon_upper
    assert abs(row.mu_estimate - 0.5) < 0.03  # μ = 1/σ


def test_half_the_noise_exceeds_the_claim():
    a = _audit(bug_zoo.correct_step, sigma_used=SIGMA / 2)  # claims σ, adds σ/2: μ = 1
    assert not a.passed and a.table.epsilon_lower[0] > a.table.epsilon_upper[0] + 1.0
    assert "FAILED" in a.summary


def test_mu_lower_bound_is_sound_over_seeds():
    """Counts of a correct step are exactly binomial: FP ~ Bin(n, Φ̄(½/σ)), FN ~ Bin(n, Φ(-½/σ)).
    Over 5000 seeds μ_lower exceeds the true μ = 1/σ in at most 5% (+ slack) of them."""
    rng, n, seeds = np.random.default_rng(0), 20000, 5000
    rate = stats.norm.sf(0.5 / SIGMA)  # both error rates at the midpoint threshold
    fp, fn = rng.binomial(n, rate, seeds), rng.binomial(n, rate, seeds)
    over = np.mean([mu_lower_bound(a, n, b, n) > 1 / SIGMA for a, b in zip(fp, fn)])
    assert over <= stats.binom.ppf(0.999, seeds, 0.05) / seeds


def test_mu_lower_bound_inverts_clopper_pearson():
    fp, n0, fn, n1 = 3000, 10000, 2500, 10000
    mu = mu_lower_bound(fp, n0, fn, n1, 0.9)
    fpr_hi = stats.beta.ppf(0.95, fp + 1, n0 - fp)
    assert stats.binom.cdf(fp, n0, fpr_hi) == pytest.approx(0.05, rel=1e-6)  # P[FP <= fp]
    fnr_hi = stats.norm.cdf(stats.norm.isf(fpr_hi) - mu)
    assert stats.binom.cdf(fn, n1, fnr_hi) == pytest.approx(0.05, rel=1e-6)
    assert mu_lower_bound(n0, n0, n1, n1) == 0.0  # every guess wrong: nothing learnt


def test_table_plot_and_html():
    a = audit_gaussian_step(bug_zoo.correct_step(C, SIGMA, B), 50, B, C, SIGMA, calls=10)
    assert {"mu_lower", "epsilon_lower", "epsilon_upper", "passed"} <= set(a.table.columns)
    assert a.summary in a._repr_html_()
    fig, ax = plt.subplots()
    assert len(a.plot(ax, bins=20)) == 41
    plt.close(fig)


def test_bad_arguments_name_the_argument():
    step = bug_zoo.correct_step(C, SIGMA, B)
    with pytest.raises(ValueError, match="noise_multiplier"):
        audit_gaussian_step(step, 50, B, C, 0.0)
    with pytest.raises(ValueError, match="dim"):
        audit_gaussian_step(step, 1, B, C, SIGMA)
    with pytest.raises(ValueError, match="confidence"):
        audit_gaussian_step(step, 50, B, C, SIGMA, confidence=95)
    with pytest.raises(ValueError, match="shape"):
        audit_gaussian_step(lambda G: G.sum(), 50, B, C, SIGMA, calls=2)
