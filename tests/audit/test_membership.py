"""Membership inference: statistics against slow twins, soundness of ε_lower, power without DP.

Soundness (issue 26's "Done when"): on models trained with DP-SGD, ε_lower at 95% never
exceeds the accountant's ε, over several seeds; and, for the statistics alone, on a Gaussian
mechanism of known μ, ε_lower exceeds the true ε in at most ~β of many seeds (while the point
estimate, which has no confidence margin, does exceed it often: the test can fail).
Power: a non-private, overfit digits MLP is attacked well above chance.
"""

import math

import matplotlib
import numpy as np
import pytest
import torch
from scipy import stats
from scipy.special import log_softmax

from workbench import accounting
from workbench.audit import membership_stats as ms
from workbench.audit.membership import calibration_scores, membership_inference, shadow_masks
from workbench.audit.membership_train import Recipe, digits_task, gpt_task, train_model

matplotlib.use("Agg")

NON_DP = Recipe(epochs=20, batch_size=25, lr=0.02, optimizer="adam")
DP = Recipe(epochs=4, batch_size=25, lr=0.2, noise_multiplier=1.5)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- statistics against their slow twins -----------------------------------------------------

def test_logit_confidence_is_log_odds_of_the_label():
    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(7, 5)) * 3, rng.integers(0, 5, size=7)
    p = np.exp(log_softmax(z, axis=1))[np.arange(7), y]
    np.testing.assert_allclose(ms.logit_confidence(z, y), np.log(p / (1 - p)), rtol=1e-9)


def test_gaussian_fits_match_a_loop_over_records():
    rng = np.random.default_rng(1)
    phi, masks = rng.normal(size=(6, 5)), shadow_masks(6, 5, rng)
    fit = ms.fit_gaussians(phi, masks, "per_record")
    for i in range(5):
        inside, outside = phi[masks[:, i], i], phi[~masks[:, i], i]
        assert fit["mu_in"][i] == pytest.approx(inside.mean(), rel=1e-12)
        assert fit["sd_out"][i] == pytest.approx(outside.std(ddof=1), rel=1e-12)
    pooled = ms.fit_gaussians(phi, masks, "global")["sd_in"][0]
    resid = np.concatenate([phi[masks[:, i], i] - phi[masks[:, i], i].mean() for i in range(5)])
    assert pooled == pytest.approx(np.sqrt((resid ** 2).sum() / (masks.sum() - 5)), rel=1e-12)
    with pytest.raises(ValueError, match="never IN"):
        ms.fit_gaussians(phi, np.zeros_like(masks))


def test_roc_auc_and_tpr_match_brute_force_thresholds():
    rng = np.random.default_rng(2)
    y = rng.random(300) < 0.5
    s = np.round(rng.normal(size=300) + y, 1)  # ties on purpose
    fpr, tpr = ms.roc_curve(s, y)
    for tau in np.unique(s)[::7]:
        tp, pos, fp, neg = ms.counts_at(s, y, tau)
        assert np.any(np.isclose(fpr, fp / neg) & np.isclose(tpr, tp / pos))
    mann_whitney = np.mean([(a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y]])
    assert ms.auc(fpr, tpr) == pytest.approx(mann_whitney, rel=1e-12)
    best = max(tp / pos for tau in np.unique(s)
               for tp, pos, fp, neg in [ms.counts_at(s, y, tau)] if fp / neg <= 0.05)
    assert ms.tpr_at_fpr(fpr, tpr, 0.05) == pytest.approx(best)


def test_epsilon_from_rates_inverts_the_hypothesis_testing_region():
    for tpr, fpr, delta in [(0.6, 0.01, 1e-5), (0.999, 0.5, 0.0), (0.3, 0.2, 1e-3)]:
        eps = ms.epsilon_from_rates(tpr, fpr, delta)
        assert tpr <= math.exp(eps) * fpr + delta + 1e-12  # (HT), both lines hold at ε
        assert 1 - fpr <= math.exp(eps) * (1 - tpr) + delta + 1e-12
        assert tpr > math.exp(eps * 0.99) * fpr + delta or \
            1 - fpr > math.exp(eps * 0.99) * (1 - tpr) + delta  # and fail just below it
    assert ms.epsilon_from_rates(0.5, 0.5, 0.0) == 0.0
    assert ms.epsilon_from_rates(1, 0, 0) == math.inf


def test_leave_one_out_calibration_fits_without_the_scored_shadow():
    rng = np.random.default_rng(3)
    phi, masks = rng.normal(size=(6, 8)), shadow_masks(6, 8, rng)
    cal = calibration_scores(phi, masks, "offline", "global")
    fit = ms.fit_gaussians(phi[1:], masks[1:], "global")
    np.testing.assert_allclose(cal[0], ms.lira_scores(phi[0], fit, "offline"), rtol=1e-12)


def test_bound_is_sound_on_a_gaussian_mechanism_of_known_epsilon():
    """μ-GDP scores: ε_lower > ε(μ, δ) in <= 5% of seeds (+3 binomial sd); the point estimate
    exceeds it far more often, so a bound without its confidence margin would fail here."""
    mu, delta, n, seeds = 2.0, 1e-3, 4000, 300
    eps_true = accounting.gaussian_epsilon(1 / mu, delta)
    taus = np.linspace(-1, 4, 501)
    tau = taus[np.argmax([ms.epsilon_from_rates(stats.norm.sf(t - mu), stats.norm.sf(t), delta)
                          for t in taus])]  # the test closest to the GDP curve, fixed in advance
    rng = np.random.default_rng(4)
    over_lower = over_point = 0
    for _ in range(seeds):
        y = rng.random(n) < 0.5
        s = rng.normal(size=n) + mu * y
        b = ms.epsilon_bounds_at(s, y, tau, delta, confidence=0.95)
        over_lower += b["epsilon_lower"] > eps_true
        over_point += b["epsilon_estimate"] > eps_true
    assert over_lower <= seeds * (0.05 + 3 * math.sqrt(0.05 * 0.95 / seeds))
    assert over_point > 4 * over_lower + 5


def test_one_run_bound_counts_top_and_bottom_guesses():
    from workbench.audit.one_run_bound import epsilon_lower_bound

    y = np.arange(400) % 2 == 0
    s = y + 0.01 * np.arange(400)  # membership and index mixed: some guesses wrong
    b = ms.one_run_bound(s, y, 0.1, 1e-5, 0.95)  # r = 0.1·m = 40: top 20, bottom 20
    top, bottom = np.argsort(s)[-20:], np.argsort(s)[:20]
    v = int(y[top].sum() + (~y[bottom]).sum())
    assert (b["guesses"], b["correct"]) == (40, v)
    assert b["epsilon_lower_one_run"] == epsilon_lower_bound(40, v, 0.95, delta=1e-5,
                                                             canaries=400)


# --- the attack on trained models ------------------------------------------------------------

def test_power_non_private_model_is_attacked_well_above_chance():
    r = membership_inference("digits", NON_DP, shadows=8, targets=2, pool_size=200, seed=0,
                             progress=False)
    assert r.auc > 0.6
    assert r.tpr_at[1e-2] > 3 * 1e-2  # TPR at low FPR well above FPR
    assert r.epsilon_lower > 0.5 and r.passed  # no claim (ε = inf) to refute
    assert r.scores.shape == r.members.shape == (2, 200) and r.risk.shape == (200,)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_soundness_dp_models_never_exceed_the_accountant(seed):
    r = membership_inference("digits", DP, shadows=4, targets=2, pool_size=200, seed=seed,
                             attack="offline", progress=False)
    assert math.isfinite(r.epsilon_claimed) and r.epsilon_claimed > 0
    assert r.epsilon_lower <= r.epsilon_claimed and r.passed
    assert r.epsilon_lower_one_run <= r.epsilon_claimed
    assert r.epsilon_interval[0] == r.epsilon_lower <= r.epsilon_estimate


def test_dp_training_spends_what_the_accountant_says_and_q_ignores_the_mask():
    task = digits_task(pool_size=40, seed=0)
    small, large = np.arange(40) < 12, np.arange(40) < 28
    recipe = Recipe(epochs=2, batch_size=5, lr=0.2, noise_multiplier=1.5)
    _, eps_small = train_model(task, small, recipe, seed=0)
    _, eps_large = train_model(task, large, recipe, seed=0)
    q = 5 / 20  # B / (N/2), whatever the mask
    steps = accounting.steps_from_epochs(recipe.epochs, q)
    assert eps_small == eps_large == pytest.approx(
        accounting.epsilon(q, recipe.noise_multiplier, steps, recipe.delta))
    with pytest.raises(ValueError, match="batch_size"):
        train_model(task, small, Recipe(batch_size=25, noise_multiplier=1.0), seed=0)


def test_plot_and_report_section_draw_dp_against_non_dp():
    from matplotlib.figure import Figure

    import workbench.audit.report_more_kinds  # noqa: F401  (registers the MembershipAudit kind)
    from workbench.audit.report import section
    from workbench.viz.audit_membership import plot_membership_roc

    r = membership_inference("digits", DP, shadows=4, targets=1, pool_size=64, seed=0,
                             reference=Recipe(epochs=2, batch_size=16, lr=0.01,
                                              optimizer="adam"), progress=False)
    artists = plot_membership_roc(Figure().add_subplot(), r)
    assert len(artists) == 2 + 1 + 2  # two ROCs, the diagonal, two FPR markers
    s = section("membership", r)
    assert s.label == "passed" and len(s.figures) == 1 and len(s.table) == 2


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="even"):
        membership_inference("digits", DP, shadows=5, pool_size=40, progress=False)
    with pytest.raises(ValueError, match="task must be one of"):
        membership_inference("mnist", DP, progress=False)
    with pytest.raises(ValueError, match="attack must be"):
        ms.lira_scores(np.zeros(2), {"mu_out": 0, "sd_out": 1}, "both")


@pytest.mark.slow
def test_tiny_gpt_sequence_membership_runs_with_and_without_dp():
    common = dict(shadows=4, targets=1, pool_size=64, seed=0, progress=False)
    base = Recipe(epochs=20, batch_size=16, lr=3e-3, optimizer="adam")
    r = membership_inference("tiny_gpt", base, **common)
    assert r.auc > 0.55 and r.passed
    dp = membership_inference(gpt_task(pool_size=64), Recipe(
        epochs=2, batch_size=16, lr=3e-3, optimizer="adam", noise_multiplier=1.0), shadows=4,
        targets=1, seed=0, progress=False)
    assert dp.epsilon_lower <= dp.epsilon_claimed and dp.passed
