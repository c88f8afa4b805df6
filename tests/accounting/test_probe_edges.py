"""Accounting edges a probe found (2026-11-30), each checked against what it must equal.

- The Poisson sampler drew float32 uniforms: a record was in a batch with probability
  ⌈q 2²⁴⌉ / 2²⁴, not q (6x at q = 1e-8), while the accountant charged q.
- The shuffle lower bound put a bin whose probability underflowed at infinite loss: an
  infinite "lower bound" where the upper bound is finite; at σ = 0.001 its grid asked for
  77 GiB.
- ``explore_budget`` gave the shuffle bracket a σ below SIGMA_FLOOR raw (a NaN error).
- ``RDPAccountant.get_epsilon_and_order`` summed 0 x inf for a group of no steps (NaN) where
  ``get_epsilon`` skips it."""

import math

import pytest
import torch

import workbench.accounting as A
from workbench.accounting.accountants.rdp import RDPAccountant
from workbench.accounting.gaussian import gaussian_epsilon
from workbench.accounting.shuffle import shuffle_lower_epsilon
from workbench.dpsgd.sampling import PoissonBatchSampler


def test_the_poisson_sampler_draws_at_the_rate_it_is_charged():
    """q = 2^-27: float32 draws include a record with probability 2^-24 (8 q): over 2^28
    draws about 16 records, against 2 expected at q (P(>= 8 | 2) = 1e-3)."""
    q, N, steps = 2.0 ** -27, 2 ** 21, 128
    sampler = PoissonBatchSampler(N, q, steps=steps, generator=torch.Generator().manual_seed(0))
    drawn = sum(len(batch) for batch in sampler)
    assert drawn < 8, drawn


@pytest.mark.parametrize("sigma", [1e-10, 0.01, 0.1, 0.5])
def test_the_shuffle_lower_bound_is_finite_and_below_the_upper_one(sigma):
    lower = shuffle_lower_epsilon(100, sigma, 1, 1e-5)
    assert math.isfinite(lower)
    assert lower <= gaussian_epsilon(sigma, 1e-5, 1)


def test_the_shuffle_bracket_at_little_noise_fits_in_memory():
    bounds = A.epsilon_bounds("shuffle", sample_rate=0.01, noise_multiplier=0.001, epochs=1,
                              delta=1e-5)
    assert bounds.lower <= bounds.upper < math.inf


def test_the_explorer_takes_a_sigma_below_the_floor():
    result = A.explore_budget(60000, 256, 1e-60, 5, 1e-5)
    assert result.epsilon_shuffle == (math.inf, math.inf)


def test_get_epsilon_and_order_skips_a_group_of_no_steps():
    acc = RDPAccountant()
    acc.load_state_dict({"name": "rdp", "history": [[0.0, 0.1, 0], [1.0, 0.01, 100]],
                         "orders": list(A.DEFAULT_ORDERS)})
    eps, order = acc.get_epsilon_and_order(1e-5)
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12) and order is not None
    none = RDPAccountant()
    none.step(noise_multiplier=0.0, sample_rate=0.1)
    assert none.get_epsilon_and_order(1e-5) == (math.inf, None) and none.get_epsilon(1e-5) \
        == math.inf


@pytest.mark.parametrize("call", [
    lambda T: A.epsilon(0.01, 1.0, T, 1e-5),
    lambda T: gaussian_epsilon(1.0, 1e-5, T),
    lambda T: A.compute_rdp(0.01, 1.0, T, [2.0]),
    lambda T: RDPAccountant().step(noise_multiplier=1.0, sample_rate=0.01, steps=T),
])
def test_a_step_count_beyond_float64_is_named_not_an_overflow(call):
    """steps = 10**400 raised a bare "OverflowError: int too large to convert to float" from
    the RDP sum until 2026-12-02 (probe AG): the count is checked against MAX_STEPS, named."""
    with pytest.raises(ValueError, match="steps must be at most 10\\^18"):
        call(10 ** 400)
    assert math.isfinite(float(A.epsilon(0.01, 1.0, 10 ** 18, 1e-5)))  # the largest count


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("target", [1e-20, 1e-150, 1e-300, 5e-324])
def test_a_target_below_every_accountants_floor_is_named(target, accountant):
    """Probe AJ (2026-12-02): ε targets below about 1e-162 raised a bare "math domain error"
    (ρ² underflowed in the starting guess), and PLD returned σ up to 3.5e50 for 1e-150 (a
    start far above the documented SIGMA_MAX). Now every such target is refused by name."""
    from workbench.accounting.calibrate import get_noise_multiplier
    with pytest.raises(ValueError, match="target") as err:
        get_noise_multiplier(target, 1e-5, 0.01, steps=100, accountant=accountant)
    assert "math domain" not in str(err.value)
