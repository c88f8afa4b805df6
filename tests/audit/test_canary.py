"""One-run canary audit: sound on correct steps, ε_lower > ε_upper on steps that leak.

Setting for every case: d = m = 1000 canaries, 400 guesses, T = 10 steps, q = 0.5, claimed
σ = 4 (ε_upper ≈ 1.83 at δ = 1e-5), confidence 0.95, fixed seeds. Correct steps give
ε_lower ≈ 0.4-0.5; the leaking ones get (almost) every guess right, ε_lower ≈ 4.1-4.9.
The soundness of the bound itself is in tests/audit/test_one_run_bound.py.
"""

import matplotlib
import numpy as np
import pytest
import torch
from scipy import stats

from workbench.audit import bug_zoo
from workbench.audit.canary import audit_canaries, epsilon_lower_bound, guess
from workbench.audit.dpsgd_step import workbench_step
from workbench.audit.one_run_bound import p_value

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RUN = dict(dim=1000, steps=10, sample_rate=0.5, max_grad_norm=1.0, noise_multiplier=4.0,
           canaries=1000, guesses=400)


def _audit(factory, seed=0, **overrides):
    return audit_canaries(factory, **{**RUN, **overrides},
                          generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("factory", [bug_zoo.correct_step, workbench_step],
                         ids=["correct_step", "workbench_step"])
def test_correct_steps_pass(factory):
    a = _audit(factory)
    assert a.passed and 0 <= a.epsilon_lower <= a.epsilon_upper
    assert a.epsilon_upper == pytest.approx(1.832, abs=1e-3)
    assert a.epsilon_lower < a.epsilon_attainable == a.table.epsilon_attainable[0]


def _sigma_over_10(C, sigma, B, generator=None):
    return bug_zoo.correct_step(C, sigma / 10, B, generator)  # claims σ, adds σ/10


@pytest.mark.parametrize("factory, overrides", [
    (bug_zoo.no_noise, {}),
    (bug_zoo.noise_std_sigma_not_sigma_c, {"max_grad_norm": 10.0}),  # std σ = σC/10
    (_sigma_over_10, {}),
    (bug_zoo.noise_for_mean_applied_to_sum, {}),
], ids=["no_noise", "sigma_not_sigma_c", "sigma_over_10", "mean_noise_on_sum"])
def test_leaking_steps_fail(factory, overrides):
    a = _audit(factory, **overrides)
    assert not a.passed and a.epsilon_lower > a.epsilon_upper + 1.0


def test_no_noise_gets_every_guess_right_and_reaches_the_attainable_bound():
    a = _audit(bug_zoo.no_noise, seed=1)
    assert a.table.correct[0] == 400
    assert a.epsilon_lower == a.epsilon_attainable
    p = np.exp(a.epsilon_lower) / (1 + np.exp(a.epsilon_lower))
    assert p_value(400, 400, a.epsilon_lower, 1e-5, 1000) == pytest.approx(0.05, rel=1e-6)
    pure = np.log(0.05 ** (1 / 400) / (1 - 0.05 ** (1 / 400)))  # δ = 0: p^r = β
    assert p ** 400 < 0.05 and 4.8 < a.epsilon_lower < pure  # the δ term costs a little


@pytest.mark.parametrize("r, v", [(400, 260), (400, 399), (50, 40), (10, 10)])
def test_lower_bound_inverts_the_binomial_tail(r, v):
    eps = epsilon_lower_bound(r, v, 0.95)
    p = np.exp(eps) / (1 + np.exp(eps))
    assert stats.binom.sf(v - 1, r, p) == pytest.approx(0.05, rel=1e-6)  # P[W >= v] = β


def test_lower_bound_is_zero_at_chance():
    assert epsilon_lower_bound(400, 200) == 0.0 and epsilon_lower_bound(400, 0) == 0.0


def test_guess_counts_and_ties():
    g = guess(np.zeros(10), 3, 4, torch.Generator().manual_seed(0))
    assert (g == 1).sum() == 3 and (g == -1).sum() == 4 and (g == 0).sum() == 3
    g = guess(np.arange(10.0), 2, 2)
    assert list(g) == [-1, -1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_table_plot_and_html():
    a = _audit(bug_zoo.correct_step, seed=3, dim=200, canaries=200, guesses=100)
    row = a.table.iloc[0]
    assert (row.canaries, row.guesses) == (200, 100) and 0 <= row.correct <= 100
    assert "top 50 -> in" in row["decision rule"]
    fig, ax = plt.subplots()
    artists = a.plot(ax)
    assert len(artists) == 80 + 2 and ax.get_legend() is not None  # 2 × 40 bins, 2 thresholds
    plt.close(fig)
    assert "Canary audit passed" in a._repr_html_() and "can show" in a._repr_html_()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="canaries"):
        _audit(bug_zoo.correct_step, canaries=2000)
    with pytest.raises(ValueError, match="guesses"):
        _audit(bug_zoo.correct_step, guesses=0)
    with pytest.raises(ValueError, match="shape"):
        _audit(lambda C, s, B, g: (lambda G: G.sum()), dim=10, canaries=10, guesses=4)
