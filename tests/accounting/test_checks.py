"""Bad input: a ValueError naming the argument, the value received and the valid range."""

import math

import pytest

from workbench.accounting import (
    PLDAccountant,
    RDPAccountant,
    compute_rdp,
    epsilon,
    epsilon_curve,
    get_noise_multiplier,
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
