"""The exact privacy profile of the Gaussian mechanism (no subsampling).

Balle & Wang (2018), "Improving the Gaussian Mechanism for Differential Privacy: Analytical
Calibration and Optimal Denoising", arXiv:1805.06530, Theorem 8. Adding N(0, σ²) to a query of
sensitivity 1 is (ε, δ)-DP exactly when                                                  (1)

    δ >= Φ(1/(2σ) - εσ) - e^ε Φ(-1/(2σ) - εσ).

T such steps compose to one Gaussian mechanism with noise σ / sqrt(T): the privacy loss of each
is N(1/(2σ²), 1/σ²), and T of them add up to N(T/(2σ²), T/σ²) (Dong, Roth, Su 2019, "Gaussian
Differential Privacy", arXiv:1905.02383). So full-batch DP-SGD (q = 1) has an exact ε to
compare every accountant with: each must report at least this much.

Notation: σ noise multiplier, ε, δ, T steps, Φ standard normal CDF.
"""

import math

from workbench.checks import (
    check_delta,
    check_noise_multiplier,
    check_nonnegative,
    check_steps,
)


def gaussian_delta(noise_multiplier, epsilon, steps=1):
    """Exact δ(ε) of ``steps`` Gaussian mechanism steps with noise σ, Eq. (1).

    >>> round(gaussian_delta(1.0, 1.0), 6)
    0.126937
    """
    from scipy.special import erfcx, ndtr  # lazy: scipy only where used
    epsilon = check_nonnegative(epsilon, "epsilon")
    sigma = check_noise_multiplier(noise_multiplier) / math.sqrt(check_steps(steps) or 1)
    if steps == 0:
        return 0.0
    if sigma == 0:
        return 1.0
    a, b = 1 / (2 * sigma), epsilon * sigma
    # Eq. (1)'s second term e^ε Φ(-a-b), with ε - (a+b)²/2 = -(a-b)²/2 (as 2ab = ε), is
    # φ(a-b) √(π/2) erfcx((a+b)/√2) = e^{-(a-b)²/2} erfcx((a+b)/√2) / 2: no exponent of
    # size 1/(2σ²) cancels (ε + log Φ(-a-b) lost every digit at σ <= 1e-9, where δ at the
    # reported ε was 0.19 until 2026-12-01)
    z = a - b
    if a + b < 1:  # σ > 1/2, εσ < 1: δ is the difference of two numbers near 1/2; as
        # P(-a-b < Z < a-b) - (e^ε - 1) Φ(-a-b) it keeps its digits (5e-8 relative at σ = 1e8)
        inside = (math.erf(z / math.sqrt(2)) + math.erf((a + b) / math.sqrt(2))) / 2
        return float(max(inside - math.expm1(epsilon) * float(ndtr(-a - b)), 0.0))
    second = math.exp(-z * z / 2) / 2 * float(erfcx((a + b) / math.sqrt(2)))
    return float(max(ndtr(z) - second, 0.0))


def gaussian_epsilon(noise_multiplier, delta, steps=1):
    """Exact ε(δ) of ``steps`` Gaussian mechanism steps: Eq. (1) solved for ε (>= 0).

    >>> round(gaussian_epsilon(1.0, 1e-5), 4)
    4.3772
    """
    from scipy.optimize import brentq  # lazy: scipy only where used
    delta = check_delta(delta)
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    if gaussian_delta(noise_multiplier, 0.0, steps) <= delta:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    hi = 1.0
    while gaussian_delta(noise_multiplier, hi, steps) > delta:
        hi *= 2
        if hi > 1e300:  # σ/√T below ~1e-150: ε > 1e300, beyond float64's reach
            return math.inf
    found = brentq(lambda e: gaussian_delta(noise_multiplier, e, steps) - delta, 0.0, hi,
                   xtol=1e-13, rtol=1e-13)
    # the root lies within xtol + rtol·ε of ``found``: step up to the side where δ holds (at
    # σ = 1e-12, ε ~ 5e23, brentq's side below had δ 3.6% over the target until 2026-12-01)
    while gaussian_delta(noise_multiplier, found, steps) > delta:
        found += 1e-13 + 1e-13 * found
    return found


__all__ = ["gaussian_delta", "gaussian_epsilon"]
