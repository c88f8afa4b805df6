"""epsilon_bounds: the sampler-aware bracket, against exact and independent computations."""

import math

import pytest

from workbench.accounting import epsilon, gaussian_delta, gaussian_epsilon
from workbench.accounting.accountant import make_accountant
from workbench.accounting.bounds import SAMPLERS, epsilon_bounds
from workbench.accounting.registry import ACCOUNTANTS


def bounds(sampler, q=0.01, sigma=1.0, epochs=2, delta=1e-5):
    return epsilon_bounds(sampler, sample_rate=q, noise_multiplier=sigma, epochs=epochs,
                          delta=delta)


@pytest.mark.parametrize("sigma, epochs", [(0.8, 1), (1.0, 4), (3.0, 10)])
def test_deterministic_is_the_exact_gaussian_mechanism_with_sigma_over_sqrt_e(sigma, epochs):
    b = bounds("deterministic", sigma=sigma, epochs=epochs)
    assert b.lower == b.upper == gaussian_epsilon(sigma / math.sqrt(epochs), 1e-5)
    assert gaussian_delta(sigma / math.sqrt(epochs), b.upper) == pytest.approx(1e-5, rel=1e-8)
    assert b.steps == epochs * 100


def test_one_batch_per_epoch_shuffle_lower_bound_is_nearly_exact():
    # q = 1: shuffling is the Gaussian mechanism, so the binned lower bound must nearly meet it
    b = bounds("shuffle", q=1.0, sigma=1.0, epochs=3)
    assert b.upper == gaussian_epsilon(1.0, 1e-5, 3)
    assert 0.99 * b.upper <= b.lower <= b.upper


@pytest.mark.parametrize("q, sigma, epochs", [(0.01, 0.8, 1), (0.01, 1.0, 3), (0.1, 2.0, 2)])
def test_shuffle_bracket_is_ordered_and_below_no_amplification(q, sigma, epochs):
    b = bounds("shuffle", q=q, sigma=sigma, epochs=epochs)
    assert 0 < b.lower <= b.upper == bounds("deterministic", q, sigma, epochs).upper


@pytest.mark.parametrize("q, sigma, epochs", [(0.01, 1.0, 2), (0.1, 2.0, 3)])
def test_poisson_bracket_holds_the_pld_and_sits_below_rdp(q, sigma, epochs):
    b = bounds("poisson", q=q, sigma=sigma, epochs=epochs)
    steps = round(epochs / q)
    assert b.steps == steps and b.upper == epsilon(q, sigma, steps, 1e-5, "pld")
    assert 0.9 * b.upper <= b.lower <= b.upper <= epsilon(q, sigma, steps, 1e-5, "rdp")


@pytest.mark.crosscheck
def test_poisson_bracket_holds_dp_accounting():
    dpa = pytest.importorskip("dp_accounting", reason="dp-accounting not installed")
    from dp_accounting.pld import pld_privacy_accountant
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0)), 200)
    theirs = acc.get_epsilon(1e-5)
    b = bounds("poisson", q=0.01, sigma=1.0, epochs=2)
    assert b.lower <= theirs * 1.001 and theirs <= b.upper * 1.001


def test_no_noise_is_infinite_epsilon_and_str_names_the_methods():
    assert bounds("shuffle", sigma=0.0).upper == math.inf
    assert "Chua" in str(bounds("shuffle")) and "exact" in str(bounds("deterministic"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(sampler="fixed"), "sampler must be one of"),
    (dict(sampler="shuffle", epochs=1.5), r"epochs must be a positive integer \(with "
                                          r"sampler='shuffle' each epoch is one pass"),
    (dict(q=0.0), r"sample_rate must be in \(0, 1\] \(q = B / N"),
    (dict(delta=1e-12), r"below 1e-10.*accounting.epsilon\(\.\.\., accountant='rdp'\)"),
    (dict(sigma=math.nan), "noise_multiplier must be"),
])
def test_bad_arguments(kwargs, match):
    args = dict(sampler="poisson", q=0.01, sigma=1.0, epochs=2, delta=1e-5) | kwargs
    with pytest.raises(ValueError, match=match):
        bounds(args.pop("sampler"), **args)


def test_registry_names_every_accountant_and_sampler():
    assert set(SAMPLERS) == {"poisson", "shuffle", "deterministic"}
    assert list(ACCOUNTANTS) == ["rdp", "pld", "prv"]  # fast first: the explorer's legend order
    for name, spec in ACCOUNTANTS.items():
        acc = make_accountant(name)
        assert type(acc) is spec.accountant_class and acc.state_dict()["name"] == name
    with pytest.raises(ValueError, match="accountant must be one of"):
        make_accountant("gdp")


@pytest.mark.parametrize("sampler", ["shuffle", "deterministic"])
def test_batches_per_epoch_is_the_loaders_own(sampler):
    """N = 100, B = 30: the loader runs ceil(100 / 30) = 4 batches, round(1 / q) is 3."""
    own = epsilon_bounds(sampler, sample_rate=0.3, noise_multiplier=1.0, epochs=2, delta=1e-5,
                         batches_per_epoch=4)
    default = epsilon_bounds(sampler, sample_rate=0.3, noise_multiplier=1.0, epochs=2,
                             delta=1e-5)
    assert (own.steps, default.steps) == (8, 6)
    assert own.upper == default.upper  # no amplification: E passes, whatever T
    if sampler == "shuffle":  # Chua et al.'s lower bound for T = 4 batches, not 3
        from workbench.accounting.shuffle import shuffle_lower_epsilon

        assert own.lower == min(shuffle_lower_epsilon(4, 1.0, 2, 1e-5), own.upper)
        assert own.lower != default.lower
    with pytest.raises(ValueError, match="batches_per_epoch"):
        epsilon_bounds(sampler, sample_rate=0.3, noise_multiplier=1.0, epochs=2, delta=1e-5,
                       batches_per_epoch=2.5)


@pytest.mark.parametrize("sampler", ["shuffle", "deterministic"])
def test_the_fixed_size_brackets_hold_below_the_pld_floor(sampler):
    """Closed forms and quadrature, no FFT: refused below δ = 1e-10 until 2026-11-30, with
    advice (accountant='rdp') this function does not take. Deterministic batches are the
    Gaussian mechanism over the passes, exactly."""
    from workbench.accounting import gaussian_epsilon
    for delta in (1e-12, 1e-30):
        b = bounds(sampler, q=0.01, sigma=1.0, epochs=2, delta=delta)
        assert 0 < b.lower <= b.upper
        assert b.upper == pytest.approx(gaussian_epsilon(1.0 / math.sqrt(2), delta), rel=1e-9)
