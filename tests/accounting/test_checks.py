"""Bad input: a ValueError naming the argument, the value received and the valid range."""

import math

import numpy as np
import pytest

from workbench.accounting import (
    PLDAccountant,
    RDPAccountant,
    compute_rdp,
    epsilon,
    epsilon_curve,
    gaussian_delta,
    gaussian_epsilon,
    get_noise_multiplier,
    steps_from_epochs,
)

GOOD = dict(sample_rate=0.01, noise_multiplier=1.0, steps=100, delta=1e-5)
BAD = [
    ("sample_rate", -0.1, r"sample_rate must be in \[0, 1\].*got -0.1"),
    ("sample_rate", 1.01, r"sample_rate must be in \[0, 1\].*got 1.01"),
    ("sample_rate", math.nan, r"sample_rate must be in \[0, 1\].*got nan"),
    ("noise_multiplier", -0.5, r"noise_multiplier must be a finite number >= 0.*got -0.5"),
    ("noise_multiplier", math.nan, r"noise_multiplier must be .*got nan"),
    ("noise_multiplier", math.inf, r"noise_multiplier must be .*got inf"),
    ("delta", 0.0, r"delta must be in \(0, 1\).*got 0.0"),
    ("delta", 1.0, r"delta must be in \(0, 1\).*got 1.0"),
    ("delta", math.nan, r"delta must be in \(0, 1\).*got nan"),
    ("steps", -3, r"steps must be a non-negative integer.*got -3"),
    ("steps", 2.5, r"steps must be a non-negative integer.*got 2.5"),
    ("steps", math.nan, r"steps must be a non-negative integer.*got nan"),
]


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("name, value, match", BAD)
def test_epsilon(accountant, name, value, match):
    with pytest.raises(ValueError, match=match):
        epsilon(**(GOOD | {name: value}), accountant=accountant)


@pytest.mark.parametrize("name, value, match", [b for b in BAD if b[0] != "delta"])
def test_compute_rdp(name, value, match):
    args = {k: v for k, v in (GOOD | {name: value}).items() if k != "delta"}
    with pytest.raises(ValueError, match=match):
        compute_rdp(**args, orders=[2.0, 3.5])


@pytest.mark.parametrize("name, value, match", [b for b in BAD if b[0] != "noise_multiplier"])
def test_get_noise_multiplier(name, value, match):
    args = {"target_epsilon": 2.0, "target_delta": GOOD["delta"],
            "sample_rate": GOOD["sample_rate"], "steps": GOOD["steps"]}
    key = {"delta": "target_delta"}.get(name, name)
    match = match.replace("delta must", "target_delta must")
    with pytest.raises(ValueError, match=match):
        get_noise_multiplier(**(args | {key: value}))


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_target_epsilon(value):
    with pytest.raises(ValueError, match="target_epsilon must be a finite number > 0"):
        get_noise_multiplier(value, 1e-5, 0.01, steps=10)


@pytest.mark.parametrize("cls", [RDPAccountant, PLDAccountant])
@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, math.nan])
def test_accountant_delta(cls, delta):
    acc = cls()
    acc.step(noise_multiplier=1.0, sample_rate=0.01)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        acc.get_epsilon(delta)


def test_other_arguments():
    with pytest.raises(ValueError, match="accountant must be one of"):
        epsilon(0.01, 1.0, 10, 1e-5, accountant="moments")
    with pytest.raises(ValueError, match="orders must all be finite and > 1.*got 0.5"):
        compute_rdp(0.01, 1.0, 10, orders=[2.0, 0.5])
    with pytest.raises(ValueError, match="discretization must be a finite number > 0"):
        epsilon(0.01, 1.0, 10, 1e-5, accountant="pld", discretization=0)
    with pytest.raises(ValueError, match="steps must be a non-negative integer"):
        epsilon_curve(0.01, 1.0, [10, -1], 1e-5)
    with pytest.raises(TypeError, match="sample_rate must be a real number; got '0.1'"):
        epsilon("0.1", 1.0, 10, 1e-5)
    with pytest.raises(ValueError, match="discretization"):
        PLDAccountant(discretization=-1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(epsilon=math.nan), "epsilon must be a finite number >= 0; got nan"),
    (dict(epsilon=-1.0), "epsilon must be a finite number >= 0; got -1.0"),
    (dict(epsilon=math.inf), "epsilon must be a finite number >= 0; got inf"),
    (dict(noise_multiplier=math.nan), "noise_multiplier must be .*got nan"),
    (dict(steps=-1), "steps must be a non-negative integer"),
])
def test_gaussian_delta(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gaussian_delta(**(dict(noise_multiplier=1.0, epsilon=1.0) | kwargs))


@pytest.mark.parametrize("noise_multiplier", [math.nan, -1.0])
def test_gaussian_epsilon(noise_multiplier):
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        gaussian_epsilon(noise_multiplier, 1e-5)


@pytest.mark.parametrize("orders, match", [
    ([2.0, 1e9], r"orders must be <= 100000 each .*got max 1e\+09"),
    (np.arange(2, 3000), r"sum to <= 2e\+06.*sum 4.49"),
])
def test_orders_are_bounded(orders, match):
    with pytest.raises(ValueError, match=match):
        compute_rdp(0.01, 1.0, 10, orders)
    with pytest.raises(ValueError, match=match):
        RDPAccountant(orders=orders)


@pytest.mark.parametrize("delta", [1e-11, 1e-15, 1e-16])
def test_pld_refuses_delta_below_its_round_off_floor(delta):
    # δ <= 1e-15 gave inf silently; between 1e-13 and 1e-15 an ε above RDP's
    with pytest.raises(ValueError, match=r"below 1e-10.*use accountant='rdp'"):
        epsilon(0.01, 1.0, 1000, delta, "pld")
    with pytest.raises(ValueError, match=r"below 1e-10"):
        epsilon_curve(0.01, 1.0, [10, 1000], delta, "pld")
    acc = PLDAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=10)
    with pytest.raises(ValueError, match=r"below 1e-10"):
        acc.get_epsilon(delta)
    assert epsilon(0.01, 1.0, 1000, delta, "rdp") < math.inf  # RDP answers at any δ


def test_pld_at_its_floor_matches_the_exact_gaussian():
    # q = 1: the composed Gaussian mechanism has an exact ε (Balle & Wang 2018)
    assert epsilon(1.0, 2.0, 10, 1e-10, "pld") == pytest.approx(gaussian_epsilon(2.0, 1e-10, 10),
                                                                rel=1e-5)


def test_steps_from_epochs():
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\] \(steps per epoch"):
        steps_from_epochs(1, 0.0)
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\].*got nan"):
        steps_from_epochs(1, math.nan)
