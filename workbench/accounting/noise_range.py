"""The noise multipliers the accountants compute with, and the pessimistic answer outside them.

ε(δ) of the sampled Gaussian mechanism never grows with σ: for each order α its RDP falls with σ
(Mironov, Talwar, Zhang 2019, arXiv:1908.10530, §3.3), and so does the hockey-stick divergence
δ(ε) of its privacy-loss distribution (more noise is a post-processing of less: add independent
N(0, σ'² - σ²) to the output). Every accountant here returns an upper bound on the true ε, so an
accountant evaluated at any σ' <= σ is an upper bound on ε at σ too:                     (1)

    ε(σ) <= ε(σ') <= accountant(σ')        for σ' <= σ.

Float64 gives out at the two ends, with crashes and, worse, plausible numbers: σ² overflows
beyond ~1e154 (OverflowError), and beyond ~1e16 one step's privacy loss log(1 - q + q e^(...))
rounds to exactly 0, so the PLD grid collapses to a point and reported ε = inf at σ = 1e17
(and 0 a decade earlier); below ~1e-150 the 1/(2σ²) terms overflow and the RDP series stops
converging, and from ~1e-99 the PLD's grid overflows. So the accountants see

    σ' = min(σ, SIGMA_CEILING)    and     σ' = 0 (ε = inf) where 0 < σ < SIGMA_FLOOR,

both pessimistic by (1). At σ = SIGMA_CEILING = 1e8 one step moves the output by 1e-8 of the
noise: even 1e12 steps at q = 1 are one Gaussian mechanism with σ = 100, whose ε(1e-5) is 0.05,
while below 1e8 every accountant was checked against dp-accounting (tests/accounting/
test_extremes.py). At σ < SIGMA_FLOOR = 1e-50 one unsampled step has ε(δ) >= 1/(2σ²) -
sqrt(2 log(1/δ))/σ > 1e99; a sampled one can have far less (ε = 0 once q T <= δ, since the
total variation is at most q T), so there inf is a loose but sound answer.

Notation: σ noise multiplier, q sample rate, δ target delta.
"""

SIGMA_CEILING = 1e8
SIGMA_FLOOR = 1e-50


def accounted_sigma(sigma: float) -> float:
    """σ' of Eq. (1) for a validated σ >= 0: the σ every accountant computes with."""
    if sigma < SIGMA_FLOOR:
        return 0.0  # ε = inf: σ = 0, or so little noise that ε > 1e99
    return min(sigma, SIGMA_CEILING)


def accounted_history(history):
    """[(σ', q, T), ...] of validated groups [(σ, q, T), ...], Eq. (1)."""
    return [(accounted_sigma(s), q, t) for s, q, t in history]


__all__ = ["SIGMA_CEILING", "SIGMA_FLOOR", "accounted_history", "accounted_sigma"]
