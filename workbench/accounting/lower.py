"""Lower bounds on ε from a binned pair of output laws: exact post-processing, losses rounded down.

If a mechanism's outputs on adjacent inputs are P and Q, any map f of the output gives laws f(P),
f(Q) whose hockey-stick divergence is no larger (data processing); so is any partition of the
line into bins. For a pair of binned laws (p_k, q_k) and the privacy loss L_k = log(p_k / q_k),
the E-fold composition has                                                              (1)

    δ_low(ε) = E_(k_1..k_E ~ p)[(1 - exp(ε - Σ_e L_(k_e)))_+]  <=  δ_true(ε),

and rounding every L_k *down* to the grid ℓ = j h only lowers (1), so the composed PLD
(``compose.py``, Koskela, Jälkö, Honkela 2020, arXiv:1906.03049) on that grid still gives a
lower bound. Then ε_low(δ) = sup{ε : δ_low(ε) > δ} <= ε_true(δ). This is the optimistic
discretisation of Doroshenko et al. (2022, arXiv:2207.04380), used for shuffling by Chua et
al. (2024, "Scalable DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS, arXiv:2411.04205).

The FFT's window cut (``compose.TAIL_MASS`` per side) could add about 1e-15 to δ_low, and its
round-off at most the composed PLD's ``roundoff`` (``compose.py`` Eq. (3)); we read ε at
δ + ``SLACK`` + roundoff so that they cannot push the bound up.

Notation: p, q bin masses, L privacy loss, h loss grid step, E compositions, δ target delta.
"""

import math

import numpy as np

from workbench.accounting.compose import compose, self_compose_many
from workbench.accounting.pld import (
    DiscretePLD,
    _g_inv,
    _normal_masses,
    epsilon_for_delta,
    grid_step,
    loss_range,
)

SLACK = 1e-12  # added to δ before reading ε off a lower-bound PLD (see the docstring)
H_LOWER = 1e-4  # loss grid step of the lower bounds


LOG_TINY = math.log(math.ulp(0.0))  # -744.4: log of the smallest positive double
MAX_LOWER_BINS = 2 ** 20  # loss bins of one binned PLD: h is coarsened past it


def binned_pld_down(log_p, log_q, h=H_LOWER):
    """DiscretePLD of bins with masses exp(log_p), exp(log_q), losses rounded down, Eq. (1).

    Bins with p = 0 add nothing. A bin with q = 0 < p is one whose q underflowed (the laws
    here, mixtures of Gaussians, give every bin some mass): its loss is taken as log p -
    LOG_TINY, below its true loss, so the bound stays a lower bound (it was put at +inf, an
    infinite "lower bound" at σ = 0.01 where the upper bound is 5425, until 2026-11-30). Where
    the losses span more than ``MAX_LOWER_BINS`` steps of h (small σ), h is coarsened to
    fit: every h > 0 rounds down, so the bound stays sound, only looser (a 77 GiB array at
    σ = 0.001 until then).
    """
    log_p, log_q = np.asarray(log_p, float), np.asarray(log_q, float)
    keep = np.isfinite(log_p)
    loss = log_p[keep] - np.where(np.isfinite(log_q[keep]), log_q[keep], LOG_TINY)
    span = float(loss.max() - loss.min()) if loss.size else 0.0
    h = max(h, span / MAX_LOWER_BINS)
    k = np.floor(loss / h).astype(np.int64)  # L rounded down
    lo = int(k.min())
    pmf = np.bincount(k - lo, weights=np.exp(log_p[keep]))
    return DiscretePLD(h=h, offset=lo, pmf=pmf)


def sgm_pld_down(q, sigma, h, direction):
    """Optimistic PLD of one sampled-Gaussian step: each loss bin's mass at its lower end.

    The same bins as ``pld.sgm_pld`` (x-intervals between g⁻¹(ℓ_k)); the mass below the grid is
    dropped and the mass above it put at the top point, both of which lower δ_low, Eq. (1).
    """
    ell_lo, ell_hi = loss_range(q, sigma, direction)
    k = np.arange(np.floor(ell_lo / h), np.ceil(ell_hi / h) + 1)
    ell = k * h
    x = _g_inv(q, sigma, ell if direction == "remove" else -ell)
    if direction == "add":
        x = x[::-1]
    m0 = _normal_masses(x, 0.0, sigma)  # N(0, σ²) on the x-intervals (n + 2,)
    m1 = (1 - q) * m0 + q * _normal_masses(x, 1.0, sigma)
    p = m1 if direction == "remove" else m0[::-1]  # in increasing loss order
    pmf = np.zeros(ell.size)
    pmf[:-1] = p[1:-1]  # bin (ℓ_j, ℓ_(j+1)] -> ℓ_j
    pmf[-1] = p[-1]  # L > ℓ_n -> ℓ_n
    return DiscretePLD(h=h, offset=int(k[0]), pmf=pmf)


def poisson_lower_epsilon(q, sigma, steps, delta, h=H_LOWER):
    """ε_low(δ) of ``steps`` sampled-Gaussian steps (add and remove), Eq. (1)."""
    eps = 0.0
    for d in ("remove", "add"):
        h_d = grid_step(h, q, sigma, d)
        pld = compose([(sgm_pld_down(q, sigma, h_d, d), steps)])
        eps = max(eps, epsilon_for_delta(pld, delta + SLACK, side="lower"))
    return eps


def history_lower_epsilon(history, delta, h=H_LOWER):
    """ε_low(δ) of the groups [(σ, q, T), ...] (all > 0) composed, on one grid per direction
    (the finest any group asks for: any h > 0 rounds down, so the bound stays a lower one)."""
    eps = 0.0
    for d in ("remove", "add"):
        h_d = min(grid_step(h, q, s, d) for s, q, _ in history)
        pld = compose([(sgm_pld_down(q, s, h_d, d), t) for s, q, t in history])
        eps = max(eps, epsilon_for_delta(pld, delta + SLACK, side="lower"))
    return eps


def lower_epsilon(pairs, delta, compositions, h=H_LOWER):
    """ε_low(δ) of ``compositions`` copies of the worse of the binned pairs [(log_p, log_q)].

    ``h`` is the loss grid step: any h > 0 gives a lower bound, a coarser one a looser bound
    (each composition can lose up to h of loss to the rounding) at a smaller FFT.
    """
    return float(lower_epsilons(pairs, delta, [compositions], h)[0])


def lower_epsilons(pairs, delta, counts, h=H_LOWER):
    """ε_low(δ) after each number of compositions in ``counts``: one forward FFT per pair."""
    eps = np.zeros(len(counts))
    for log_p, log_q in pairs:
        pld = binned_pld_down(log_p, log_q, h)
        fft_counts = sorted({int(t) for t in counts if t > 1})  # one copy needs no FFT
        composed = dict(zip(fft_counts, self_compose_many(pld, fft_counts) if fft_counts else []))
        many = [pld if t == 1 else composed[int(t)] for t in counts]
        eps = np.maximum(eps, [epsilon_for_delta(c, delta + SLACK, side="lower") for c in many])
    return eps


def interval_log_masses(log_cdf, log_sf, edges):
    """log masses of a law on (-inf, e0], (e0, e1], ..., (e_n, inf) from log CDF and log SF.

    Left of the median the CDF is differenced, right of it the survival function, so every bin
    keeps its relative precision; ``edges`` must be increasing.
    """
    lc, ls = log_cdf(edges), log_sf(edges)
    lc = np.concatenate(([-np.inf], lc, [0.0]))
    ls = np.concatenate(([0.0], ls, [-np.inf]))
    with np.errstate(divide="ignore", invalid="ignore"):
        from_cdf = lc[1:] + np.log(-np.expm1(lc[:-1] - lc[1:]))  # log(F(b) - F(a))
        from_sf = ls[:-1] + np.log(-np.expm1(ls[1:] - ls[:-1]))  # log(S(a) - S(b))
    left = lc[1:] < np.log(0.5)  # bin (a, b] lies left of the median when F(b) < 1/2
    return np.where(left, from_cdf, from_sf)


__all__ = [
    "H_LOWER", "LOG_TINY", "MAX_LOWER_BINS", "SLACK", "binned_pld_down", "interval_log_masses",
    "history_lower_epsilon", "lower_epsilon", "lower_epsilons",
    "poisson_lower_epsilon", "sgm_pld_down",
]
