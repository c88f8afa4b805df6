"""workbench.checks: every validator, its boundaries, bad types and the one message style."""

import math

import numpy as np
import pytest
import torch

from workbench.checks import (
    check_count,
    check_delta,
    check_epsilon,
    check_max_grad_norm,
    check_noise_multiplier,
    check_probability,
    check_sample_rate,
    check_steps,
)

# (validator, keyword options, accepted values, refused values): boundaries on both sides
CASES = [
    (check_sample_rate, {}, [0.0, 1e-9, 1.0], [-1e-12, 1.0 + 1e-12]),
    (check_sample_rate, {"positive": True}, [1e-12, 1.0], [0.0, -0.1]),
    (check_sample_rate, {"positive": True, "below_one": True}, [0.5], [0.0, 1.0]),
    (check_noise_multiplier, {}, [0.0, 1e-12, 1e6], [-1e-12]),
    (check_noise_multiplier, {"positive": True}, [1e-12], [0.0]),
    (check_max_grad_norm, {}, [1.01e-12, 1e-6, 1e6], [0.0, -1.0, 1e-12, 1e-26]),
    (check_delta, {}, [1e-300, 1 - 1e-12], [0.0, 1.0]),
    (check_delta, {"zero_ok": True}, [0.0], [1.0, -1e-12]),
    (check_epsilon, {}, [1e-12, 1e3], [0.0, -1.0]),
]
NAMES = {check_sample_rate: "sample_rate", check_noise_multiplier: "noise_multiplier",
         check_max_grad_norm: "max_grad_norm", check_delta: "delta", check_epsilon: "epsilon"}


@pytest.mark.parametrize("check, options, good, bad", CASES)
def test_boundaries(check, options, good, bad):
    for value in good:
        assert check(value, **options) == value
    for value in bad:
        with pytest.raises(ValueError, match=rf"^{NAMES[check]} must be .*; got {value!r}$"):
            check(value, **options)


@pytest.mark.parametrize("check", list(NAMES))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_never_pass(check, value):
    with pytest.raises(ValueError, match=f"got {value!r}"):
        check(value)


@pytest.mark.parametrize("check", list(NAMES))
@pytest.mark.parametrize("value, shown", [
    (True, "True"), ("0.5", "'0.5'"), (None, "None"), ([0.5], r"\[0.5\]"), (0.5j, r"0.5j"),
    (np.bool_(True), r"np.True_ \(bool\)"),
])
def test_non_numbers_are_type_errors_naming_the_argument(check, value, shown):
    with pytest.raises(TypeError, match=rf"^{NAMES[check]} must be a real number; got {shown}"):
        check(value)


@pytest.mark.parametrize("check", list(NAMES))
def test_numpy_scalars_and_0d_tensors_are_numbers(check):
    for value in (np.float64(0.5), np.float32(0.5), torch.tensor(0.5, dtype=torch.float64),
                  torch.tensor(0.5, requires_grad=True)):
        out = check(value)
        assert out == 0.5 and type(out) is float
    with pytest.raises(ValueError, match=r"; got -2.0$"):  # shown as a float, not np.float64
        check(np.float64(-2.0))


@pytest.mark.parametrize("value", [torch.ones(2), torch.ones(1), torch.tensor(True),
                                   torch.tensor(1 + 1j)])
def test_tensors_that_are_not_one_real_number(value):
    with pytest.raises(TypeError, match=r"noise_multiplier must be a real number; got a Tensor"):
        check_noise_multiplier(value)


def test_message_names_argument_range_meaning_and_value():
    with pytest.raises(ValueError) as e:
        check_noise_multiplier(-1, name="sigma")
    assert str(e.value) == ("sigma must be a finite number >= 0 (σ, the noise std in units of "
                            "max_grad_norm; accounting.get_noise_multiplier finds σ for a target "
                            "ε); got -1.0")
    with pytest.raises(ValueError, match=r"^q must be in \(0, 1\) \(why\); got 1.0$"):
        check_sample_rate(1, name="q", positive=True, below_one=True, note="why")
    with pytest.raises(ValueError, match=r"^alpha must be in \(0, 1\); got 0.0$"):
        check_probability(0, "alpha")


@pytest.mark.parametrize("value", [0, 1, 5, 5.0, np.int64(5), np.float64(5.0), torch.tensor(5)])
def test_count_accepts_integral_numbers(value):
    out = check_count(value, "epochs", low=0, high=5)
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value, low, high, high_name, rule", [
    (0, 1, None, "", "a positive integer"),
    (-1, 0, None, "", "a non-negative integer"),
    (19, 20, None, "", "an integer >= 20"),
    (2.5, 1, None, "", "a positive integer"),
    (math.nan, 1, None, "", "a positive integer"),
    (math.inf, 1, None, "", "a positive integer"),
    (11, 1, 10, "", r"an integer in \[1, 10\]"),
    (11, 1, 10, "dataset_size", r"an integer in \[1, dataset_size=10\]"),
])
def test_count_refuses_with_its_range(value, low, high, high_name, rule):
    with pytest.raises(ValueError, match=rf"^n must be {rule}; got {value!r}$"):
        check_count(value, "n", low, high, high_name=high_name)


@pytest.mark.parametrize("value", [True, "3", None, torch.ones(3)])
def test_count_refuses_non_numbers(value):
    with pytest.raises(TypeError, match="^n must be an integer; got"):
        check_count(value, "n")


def test_steps_allow_zero_and_integral_floats():
    assert check_steps(0) == 0 and check_steps(100.0) == 100
    with pytest.raises(ValueError, match=r"^steps must be a non-negative integer \(a number of "
                                         r"steps\); got -1$"):
        check_steps(-1)
