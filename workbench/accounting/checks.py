"""Argument checks shared by the accountants.

Every public function of ``workbench.accounting`` validates its inputs here, so a bad value
fails early with a message that names the argument, the value received and the valid range
(DESIGN.md, style item 10), instead of surfacing later as a NaN or an obscure numpy warning.

Notation: q sample rate, σ noise multiplier, α order, δ target delta, T steps.

>>> check_sample_rate(0.01)
0.01
>>> check_sample_rate(1.5)
Traceback (most recent call last):
    ...
ValueError: sample_rate must be in [0, 1] (the probability that a record is in a batch); got 1.5
"""

import math
import numbers

import numpy as np


def _real(name, value):
    """``value`` as a Python float; a TypeError naming ``name`` for non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be a real number; got {value!r} ({type(value).__name__})")
    return float(value)


def check_sample_rate(sample_rate, name="sample_rate"):
    """q in [0, 1]."""
    q = _real(name, sample_rate)
    if not 0.0 <= q <= 1.0:  # also rejects NaN
        raise ValueError(
            f"{name} must be in [0, 1] (the probability that a record is in a batch); got {q!r}"
        )
    return q


def check_noise_multiplier(noise_multiplier, name="noise_multiplier"):
    """σ >= 0 and finite (σ = 0 is allowed: no noise, ε = inf)."""
    sigma = _real(name, noise_multiplier)
    if not 0.0 <= sigma < math.inf:
        raise ValueError(
            f"{name} must be a finite number >= 0 (noise std / clipping norm); got {sigma!r}"
        )
    return sigma


def check_delta(delta, name="delta"):
    """δ in the open interval (0, 1)."""
    d = _real(name, delta)
    if not 0.0 < d < 1.0:
        raise ValueError(f"{name} must be in (0, 1), e.g. 1e-5 or 1 / dataset size; got {d!r}")
    return d


def check_epsilon(epsilon, name="epsilon"):
    """ε > 0 and finite."""
    e = _real(name, epsilon)
    if not 0.0 < e < math.inf:
        raise ValueError(f"{name} must be a finite number > 0; got {e!r}")
    return e


def check_steps(steps, name="steps"):
    """T a non-negative integer (an integral float such as 100.0 is accepted)."""
    t = _real(name, steps)
    if not (t >= 0 and math.isfinite(t) and t.is_integer()):
        raise ValueError(
            f"{name} must be a non-negative integer (a number of steps); got {steps!r}"
        )
    return int(t)


def check_count(value, name, low=1, high=10**6):
    """An integer in [low, high] (numbers of points, trials, epochs)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]; got {value!r}")
    return int(value)


def check_nonnegative(value, name):
    """A finite number >= 0 (an ε at which to read δ)."""
    v = _real(name, value)
    if not 0.0 <= v < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0; got {v!r}")
    return v


def check_positive(value, name):
    """A finite number > 0 (tolerances, discretisation intervals, epochs)."""
    v = _real(name, value)
    if not 0.0 < v < math.inf:
        raise ValueError(f"{name} must be a finite number > 0; got {v!r}")
    return v


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
