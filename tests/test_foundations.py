"""workbench.foundations against first principles (likelihood ratios, simulation, algebra)."""

import math

import numpy as np
import pytest

from workbench import foundations as F


@pytest.mark.parametrize("p", [0.0, 0.25, 0.5, 0.9])
def test_randomized_response_epsilon_is_the_worst_likelihood_ratio(p):
    yes_if_yes, yes_if_no = p + (1 - p) / 2, (1 - p) / 2
    worst = max(yes_if_yes / yes_if_no, (1 - yes_if_no) / (1 - yes_if_yes))
    assert math.isclose(F.randomized_response_epsilon(p), math.log(worst), rel_tol=1e-12)


def test_randomized_response_simulated_and_debiased():
    rng = np.random.default_rng(0)
    truth = rng.random(200_000) < 0.3
    answers = F.randomized_response(truth, 0.5, rng)
    assert abs(answers[truth].mean() - 0.75) < 0.01 and abs(answers[~truth].mean() - 0.25) < 0.01
    assert abs(F.randomized_response_estimate(answers.mean(), 0.5) - 0.3) < 0.01


def test_laplace_mechanism_density_ratio_is_bounded_by_e_to_the_epsilon():
    b = F.laplace_scale(2.0, 0.5)
    z = np.linspace(-30, 30, 1001)  # f(x) = 0, f(x') = 2 (sensitivity apart)
    log_ratio = (-np.abs(z) + np.abs(z - 2.0)) / b
    assert math.isclose(log_ratio.max(), 0.5, rel_tol=1e-12)
    noisy = F.laplace_mechanism(np.zeros(100_000), 2.0, 0.5, np.random.default_rng(1))
    assert abs(noisy.std() - math.sqrt(2) * b) < 0.05 * b


def test_sum_sensitivity_by_brute_force():
    values = np.array([-2.0, -0.5, 0.3, 1.0])
    data = np.array([1.0, -1.0, 0.2])
    add = max(abs((data.sum() + v) - data.sum()) for v in values)
    sub = max(abs(data.sum() - data[0] + v - (data.sum() - data[0] + w))
              for v in values for w in values)
    assert F.sum_sensitivity(-2.0, 1.0, "add/remove") == add
    assert F.sum_sensitivity(-2.0, 1.0, "substitute") == sub
    with pytest.raises(ValueError, match="neighbours"):
        F.sum_sensitivity(0, 1, "swap")
    with pytest.raises(ValueError, match="lower"):
        F.sum_sensitivity(1, 0)


def test_compositions():
    assert F.basic_composition([0.5, 1.0], [1e-6, 0.0]) == (1.5, 1e-6)
    eps, delta = F.advanced_composition(0.1, 1e-7, 100, 1e-5)
    assert math.isclose(eps, math.sqrt(200 * math.log(1e5)) * 0.1 + 10 * math.expm1(0.1))
    assert math.isclose(delta, 100 * 1e-7 + 1e-5)
    # with many small steps advanced composition beats basic (sqrt(k) against k)
    assert F.advanced_composition(0.01, 0.0, 10_000, 1e-6)[0] < 0.01 * 10_000 / 10
    with pytest.raises(ValueError, match="2 epsilons but 1 deltas"):
        F.basic_composition([1.0, 1.0], [0.0])


def test_group_privacy_is_k_chained_neighbour_steps():
    assert F.group_privacy(0.5, 1e-6, 1) == (0.5, 1e-6)
    eps, delta = F.group_privacy(0.5, 1e-6, 3)
    # chain: (ε, δ) then twice more: δ_k = δ_{k-1} e^ε + δ  (k = 3: δ(e^{2ε} + e^ε + 1))
    chained = 1e-6 * (math.exp(1.0) + math.exp(0.5) + 1)
    assert eps == 1.5 and chained <= delta <= 3 * math.exp(1.0) * 1e-6
    with pytest.raises(ValueError, match="k"):
        F.group_privacy(0.5, 1e-6, 0)
