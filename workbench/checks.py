"""Argument checks for the quantities of DP-SGD: one function per quantity, one message style.

Every public function of the workbench validates σ, q, C, δ, ε and its counts here, so a bad
value fails early with a message that names the argument, the value received, the valid range
and what the number means or how to get a good one (ARCHITECTURE.md, style item 10), instead of
surfacing later as a NaN, an ε of 0 or an obscure numpy warning. The style, built by one
function (``_fail``)::

    {name} must be {range} ({meaning or fix}); got {value}

Bad *types* (a string, a bool, a tensor of many elements) raise TypeError; bad *values* (out
of range, NaN, inf, a fraction where a count belongs) raise ValueError. Accepted as numbers:
Python and numpy ints and floats and 0-d real tensors (``C = norms.median()``); bool is not
a number here (``True`` as a sample rate is a bug, not 1.0).

**The ranges, decided once** (and where a use needs a narrower one, the keyword that says so):

- q ``sample_rate`` in [0, 1]. q = 0 is legitimate in accounting (a step that reads no data
  costs ε = 0); ``positive=True`` asks for (0, 1] where q divides (steps per epoch = 1 / q)
  or drives a sampler; ``below_one=True`` excludes q = 1 where a test needs randomness.
- σ ``noise_multiplier`` finite, >= 0. σ = 0 is a legitimate non-private run (clipping only,
  ε = inf); ``positive=True`` where σ = 0 leaves nothing to measure (the Gaussian audit).
- C ``max_grad_norm`` finite, > 0 everywhere (C = 0 zeroes every gradient).
- δ ``delta`` in (0, 1); ``zero_ok=True`` where pure ε-DP (δ = 0) has a meaning.
- ε ``epsilon`` finite, > 0 (targets); ``check_nonnegative`` where ε = 0 is a point to read.
- counts (steps, epochs, batch and data set sizes, trials): integers in [low, high]; an
  integral float such as 100.0 is accepted (``epochs / q`` arrives as one), 2.5 is not.

Notation: q sample rate, σ noise multiplier, C clip norm, δ target delta, ε epsilon,
α Rényi order, T steps.

>>> check_sample_rate(0.01)
0.01
>>> check_sample_rate(1.5)  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
ValueError: sample_rate must be in [0, 1] (the probability that a record is ...); got 1.5
"""

import math
import numbers

import numpy as np
import torch


def _fail(name, rule, value, note=""):
    """The one message style: argument, range, meaning or fix, value received."""
    return f"{name} must be {rule}" + (f" ({note})" if note else "") + f"; got {value!r}"


def _scalar(name, value, kind="a real number"):
    """``value`` as a Python number (0-d tensors and numpy scalars unwrapped), or TypeError."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dim() != 0 or value.dtype == torch.bool \
                or value.is_complex():
            raise TypeError(f"{name} must be {kind}; got a Tensor of shape "
                            f"{tuple(value.shape)} and dtype {value.dtype} (pass a number, or "
                            f"a 0-d real tensor: .item() of one element)")
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind}; got {value!r} ({type(value).__name__})")
    return value.item() if isinstance(value, np.generic) else value  # np.float64(2.0) -> 2.0


def _real(name, value):
    """``value`` as a Python float; a TypeError naming ``name`` for non-numbers."""
    return float(_scalar(name, value))


def _interval(low, high, low_open, high_open):
    if high == math.inf:
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_real(value, name, low=-math.inf, high=math.inf, *, low_open=False, high_open=False,
               note=""):
    """A finite float in the interval [low, high] (ends open where asked); NaN never passes."""
    v = _real(name, value)
    inside = (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
    if not (inside and math.isfinite(v)):
        raise ValueError(_fail(name, _interval(low, high, low_open, high_open), v, note))
    return v


def check_sample_rate(sample_rate, name="sample_rate", *, positive=False, below_one=False,
                      note="the probability that a record is in a batch, q = batch_size / "
                           "dataset_size"):
    """q in [0, 1]; (0, 1] with ``positive``, [0, 1) with ``below_one``."""
    return check_real(sample_rate, name, 0.0, 1.0, low_open=positive, high_open=below_one,
                      note=note)


def check_noise_multiplier(noise_multiplier, name="noise_multiplier", *, positive=False,
                           note="σ, the noise std in units of max_grad_norm; "
                                "accounting.get_noise_multiplier finds σ for a target ε"):
    """σ finite and >= 0 (σ = 0: no noise, ε = inf), or > 0 with ``positive``."""
    return check_real(noise_multiplier, name, 0.0, low_open=positive, note=note)


MIN_CLIP_NORM = 1e-12
"""The smallest C accepted. Below about 1e-19 a clipped record's float32 (or widened
bfloat16/float16) squares underflow, its norm reads 0 or too small and it is released
unclipped (measured 2026-11-30: C = 1e-26, a released sum 4.4-46 C from three records);
above 1e-12 a record with ||g|| > C has squares in float32's normal range unless it spreads
over more than 1e14 numbers."""


def check_max_grad_norm(max_grad_norm, name="max_grad_norm"):
    """C finite and > MIN_CLIP_NORM (1e-12)."""
    return check_real(max_grad_norm, name, MIN_CLIP_NORM, low_open=True,
                      note="the clip norm C, e.g. 1.0 or the median per-sample gradient norm; "
                           "below 1e-12 the squared norms underflow: scale the loss up "
                           "instead")


def check_delta(delta, name="delta", *, zero_ok=False):
    """δ in (0, 1), or [0, 1) with ``zero_ok``."""
    return check_real(delta, name, 0.0, 1.0, low_open=not zero_ok, high_open=True,
                      note="e.g. 1e-5, below 1 / dataset size")


def check_epsilon(epsilon, name="epsilon"):
    """ε finite and > 0."""
    return check_real(epsilon, name, 0.0, low_open=True, note="a privacy budget, e.g. 1 to 8")


def check_probability(value, name, note=""):
    """A probability strictly inside (0, 1): a confidence, a significance level."""
    return check_real(value, name, 0.0, 1.0, low_open=True, high_open=True, note=note)


def check_nonnegative(value, name, note=""):
    """A finite number >= 0 (an ε at which to read δ)."""
    return check_real(value, name, 0.0, note=note)


def check_positive(value, name, note=""):
    """A finite number > 0 (tolerances, discretisation intervals, epochs)."""
    return check_real(value, name, 0.0, low_open=True, note=note)


def _count_rule(low, high, high_name):
    if high is not None:
        return f"an integer in [{low}, {high_name + '=' if high_name else ''}{high}]"
    return {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")


def check_count(value, name, low=1, high=None, note="", high_name=""):
    """An integer in [low, high] (``high=None``: no upper end): steps, epochs, sizes, trials.

    ``high_name`` names where the upper end comes from (``dataset_size`` for a batch size).
    An integral float (100.0) is accepted as its integer; 2.5, NaN and inf are not.
    """
    v = _scalar(name, value, "an integer")
    whole = isinstance(v, numbers.Integral) or (math.isfinite(v) and float(v).is_integer())
    if not (whole and low <= v and (high is None or v <= high)):
        raise ValueError(_fail(name, _count_rule(low, high, high_name), v, note))
    return int(v)


#: The most steps an accountant takes: 10^18 (beyond it float64's ε arithmetic overflows;
#: steps = 10**400 raised a bare OverflowError from ``rdp.py`` until 2026-12-02, probe AG).
MAX_STEPS = 10 ** 18


def check_steps(steps, name="steps"):
    """T a non-negative integer up to ``MAX_STEPS`` (a number of steps; 0 cost nothing)."""
    T = check_count(steps, name, low=0, note="a number of steps")
    if T > MAX_STEPS:
        raise ValueError(f"{name} must be at most 10^18 (more steps cannot be accounted in "
                         f"float64); got an integer of {len(str(T))} digits")
    return T


#: Largest Rényi order accepted, and the largest sum of orders (the integer-order sum of
#: ``rdp.py`` holds α + 1 terms per order: this caps its memory near 100 MB).
MAX_ORDER = 1e5
MAX_ORDER_SUM = 2e6


def check_orders(orders, name="orders"):
    """Rényi orders: a non-empty 1-D array of numbers 1 < α <= MAX_ORDER, as float64."""
    a = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of numbers > 1; got {orders!r}")
    bad = a[~(np.isfinite(a) & (a > 1.0))]
    if bad.size:
        raise ValueError(
            f"{name} must all be finite and > 1 (order 1 is the KL limit, not supported); "
            f"got {float(bad[0])!r} among them"
        )
    if a.max() > MAX_ORDER or a.sum() > MAX_ORDER_SUM:
        raise ValueError(
            f"{name} must be <= {MAX_ORDER:g} each and sum to <= {MAX_ORDER_SUM:g} (the RDP sum "
            f"costs memory in proportion to the order); got max {a.max():g}, sum {a.sum():g}. "
            f"Orders beyond ~1e4 only matter for epsilon below ~1e-3."
        )
    return a


def check_choice(value, name, choices):
    """``value`` one of ``choices`` (strings such as the accountant names)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}; got {value!r}")
    return value


__all__ = [
    "MAX_ORDER", "MAX_ORDER_SUM", "MIN_CLIP_NORM", "check_choice", "check_count", "check_delta",
    "check_epsilon", "check_max_grad_norm", "check_noise_multiplier", "check_nonnegative",
    "check_orders", "check_positive", "check_probability", "check_real", "check_sample_rate",
    "check_steps",
]
