"""The foundations of differential privacy before DP-SGD: the on-ramp (notebook 00b).

The order and the ideas follow C. Dwork and A. Roth, *The Algorithmic Foundations of
Differential Privacy* (2014), Sections 2-3, and J. Near and C. Abuah, *Programming
Differential Privacy* (2021-), chapters 3-8; the code and wording are the workbench's own.

A randomised algorithm M is (ε, δ)-DP if for all neighbouring data sets x, x' and all sets S
of outcomes  P[M(x) ∈ S] <= e^ε P[M(x') ∈ S] + δ                                 (D&R Def. 2.4)

- Randomised response (D&R §3.2): answer truthfully with probability p, otherwise give a
  uniformly random answer. P[yes | yes] = (1 + p)/2, P[yes | no] = (1 - p)/2, so
  ε = ln((1 + p)/(1 - p)).                                                             (1)
- Laplace mechanism (D&R Def. 3.3, Thm 3.6): f(x) + Lap(b) with b = Δ₁/ε is ε-DP, where the
  L1 sensitivity Δ₁ = max over neighbours ||f(x) - f(x')||₁.                            (2)
- Sensitivity of a sum of values clipped to [lo, hi]: max(|lo|, |hi|) when a neighbour adds
  or removes one record, hi - lo when it replaces one (DP-SGD's C versus 2C).           (3)
- Basic composition (D&R Thm 3.16): k mechanisms (εᵢ, δᵢ) give (Σεᵢ, Σδᵢ).               (4)
- Advanced composition (Dwork, Rothblum, Vadhan 2010; D&R Thm 3.20): k (ε, δ) mechanisms
  give (ε', kδ + δ') with ε' = sqrt(2k ln(1/δ')) ε + k ε (e^ε - 1).                   (5)
- Post-processing (D&R Prop. 2.1): any function of an (ε, δ)-DP output is (ε, δ)-DP; e.g.
  the debiased estimate of the true fraction from randomised answers,
  π̂ = (f - (1 - p)/2) / p for an observed fraction f of "yes".                       (6)
- Group privacy (D&R Thm 2.2 for δ = 0; with δ, chaining k neighbour steps): for data sets
  that differ in k records an (ε, δ)-DP mechanism is (kε, k e^{(k-1)ε} δ)-DP.          (7)
"""

import math

import numpy as np

from workbench.checks import (
    check_count,
    check_delta,
    check_epsilon,
    check_positive,
    check_real,
)


def randomized_response_epsilon(p):
    """ε of randomised response that tells the truth with probability p, Eq. (1)."""
    check_real(p, "p", 0.0, 1.0)
    if p == 1:
        return math.inf
    return math.log((1 + p) / (1 - p))


def randomized_response(truth, p, rng):
    """Each boolean in ``truth`` answered truthfully with probability p, else a fair coin."""
    check_real(p, "p", 0.0, 1.0)
    truth = np.asarray(truth, dtype=bool)
    honest = rng.random(truth.shape) < p
    return np.where(honest, truth, rng.random(truth.shape) < 0.5)


def randomized_response_estimate(fraction_yes, p):
    """Unbiased estimate of the true fraction of "yes" from randomised answers, Eq. (6)."""
    check_real(fraction_yes, "fraction_yes", 0.0, 1.0)
    check_real(p, "p", 0.0, 1.0)
    check_positive(p, "p", "with p = 0 the answers carry no information")
    return (fraction_yes - (1 - p) / 2) / p


def laplace_scale(sensitivity, epsilon):
    """The Laplace scale b = Δ₁/ε that makes a query of L1 sensitivity Δ₁ ε-DP, Eq. (2)."""
    check_positive(sensitivity, "sensitivity")
    check_epsilon(epsilon)
    return sensitivity / epsilon


def laplace_mechanism(value, sensitivity, epsilon, rng):
    """``value`` + Lap(Δ₁/ε) noise (elementwise): the Laplace mechanism, Eq. (2)."""
    return np.asarray(value, dtype=float) + rng.laplace(
        0.0, laplace_scale(sensitivity, epsilon), np.shape(value))


def sum_sensitivity(lower, upper, neighbours="add/remove"):
    """L1 sensitivity of a sum of values clipped to [lower, upper], Eq. (3)."""
    check_real(lower, "lower")
    check_real(upper, "upper")
    if not lower < upper:
        raise ValueError(f"lower={lower} must be below upper={upper}: they are the clipping "
                         "range [lower, upper] of each value")
    if neighbours == "add/remove":
        return max(abs(lower), abs(upper))
    if neighbours == "substitute":
        return upper - lower
    raise ValueError(f"neighbours={neighbours!r}: use 'add/remove' (one record more or less) "
                     "or 'substitute' (one record replaced)")


def basic_composition(epsilons, deltas):
    """(Σεᵢ, Σδᵢ) for mechanisms run one after another on the same data, Eq. (4)."""
    epsilons, deltas = list(epsilons), list(deltas)
    if len(epsilons) != len(deltas):
        raise ValueError(f"{len(epsilons)} epsilons but {len(deltas)} deltas: give one "
                         "(ε, δ) pair per mechanism")
    for e in epsilons:
        check_real(e, "epsilons", 0.0)
    for d in deltas:
        check_delta(d, "deltas", zero_ok=True)
    return float(sum(epsilons)), float(sum(deltas))


def advanced_composition(epsilon, delta, k, delta_prime):
    """(ε', kδ + δ') for k runs of an (ε, δ) mechanism, Eq. (5) (Dwork-Rothblum-Vadhan)."""
    check_real(epsilon, "epsilon", 0.0)
    check_delta(delta, "delta", zero_ok=True)
    check_count(k, "k", low=1)
    check_delta(delta_prime, "delta_prime")
    eps = math.sqrt(2 * k * math.log(1 / delta_prime)) * epsilon \
        + k * epsilon * math.expm1(epsilon)
    return eps, k * delta + delta_prime


def group_privacy(epsilon, delta, k):
    """(kε, k e^{(k-1)ε} δ): what (ε, δ)-DP says about data sets k records apart, Eq. (7)."""
    check_real(epsilon, "epsilon", 0.0)
    check_delta(delta, "delta", zero_ok=True)
    check_count(k, "k", low=1)
    return k * epsilon, k * math.exp((k - 1) * epsilon) * delta


__all__ = [
    "advanced_composition", "basic_composition", "group_privacy", "laplace_mechanism",
    "laplace_scale", "randomized_response", "randomized_response_epsilon",
    "randomized_response_estimate", "sum_sensitivity",
]
