"""A lower bound on ε for DP-SGD with shuffled fixed-size batches (Chua et al. 2024).

Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha, Zhang (2024), "How Private are DP-SGD
Implementations?", ICML, arXiv:2403.17673, §4; multi-epoch: the same authors (2024), "Scalable
DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS, arXiv:2411.04205, §3. Reference code:
google-research/google-research, dpsgd_batch_sampler_accounting/dpsgd_bounds.py
(``ShuffleAccountant``: the same pair, cube sets, epochs composed as a PLD).

The pair (zero-out adjacency, Kairouz et al. 2021, arXiv:2103.00039: D' replaces the differing
example x* by a null example whose gradient is 0). One epoch of T = round(1/q) batches of b
examples; let every other example have the clipped gradient -1 (one coordinate, C = 1) and x*
the gradient +1. On D the batch holding x* sums to -(b - 1) + 1, the others to -b; on D' the
batch holding x* sums to -(b - 1). Adding the known offset b to every batch sum, the T noisy
sums of one epoch are, with x* at a uniformly random position t,                        (1)

    P = MoG(2)  (on D)      against      Q = MoG(1)  (on D'),
    MoG(m) = (1/T) Σ_t N(m e_t, σ² I_T).

Both directions count (δ is a max over the ordered pairs), so we bound P vs Q and Q vs P.
Why the offset matters: where the largest coordinate comes from x*'s batch, both laws carry the
same weight 1/T, so it cancels and the likelihood ratio grows like e^((2y - 3)/(2σ²)), as for
the unsampled Gaussian mechanism. Against N(0, σ² I) (gradient 1 vs 0 with all others 0, the
naive pair) the ratio keeps a factor 1/T, and that bound stays below Poisson's ε.

Every set S gives δ(ε) >= P(S) - e^ε Q(S). Chua et al. use the "cube" sets {w : max_t w_t <= C}
and their complements, i.e. they read only the largest coordinate Y = max_t w_t, whose law
under MoG(m) is                                                                          (2)

    F_m(y) = P(Y <= y) = Φ((y - m)/σ) Φ(y/σ)^(T - 1).

Composition over E epochs (each a fresh shuffle): Y is a post-processing of one epoch, so the
E-fold product of the binned laws of Y under (MoG(2), MoG(1)) is no more distinguishable than
the E epochs themselves. We bin Y finely (each bin changes the loss by about ``LOSS_PER_BIN``)
and compose the binned pair's privacy loss with every loss rounded *down* (``lower.py``): a
lower bound δ_low(ε) on the true δ(ε), hence ε_low(δ) <= the true ε. With T = 1 the pair is
N(2, σ²) vs N(1, σ²), the Gaussian mechanism itself, so the bound then meets the exact ε.

The no-amplification upper bound: given the positions, each epoch is a Gaussian mechanism of
sensitivity 1, so by joint convexity the run is no worse than E Gaussian mechanisms, i.e. one
with noise σ/√E (``gaussian.py``). The pair (1) is such a mixture, so lower <= upper always.

Where it bites (tests/accounting/test_shuffle.py, notebook 04): small σ and many batches per
epoch. In the setting of the reference code's example (T = 1000 steps, one epoch, σ = 0.35) at
δ = 1e-6, the Poisson PLD gives ε = 13.3 while shuffling has ε >= 17.08, the no-amplification
ε itself; at σ = 0.8 the Poisson ε is 0.47 and the shuffled run's is in [6.04, 6.31].

Notation: q = B/N, T batches per epoch, E epochs, σ noise multiplier, Φ standard normal CDF,
m the mean of the differing batch in MoG(m).
"""

import numpy as np

from workbench.accounting.lower import H_LOWER, interval_log_masses, lower_epsilons

MEANS = (2.0, 1.0)  # (P, Q) = (MoG(2), MoG(1)), Eq. (1)
LOSS_PER_BIN = 2e-3  # bin width of Y is LOSS_PER_BIN σ² / (m_P - m_Q): the loss's slope bound
MAX_BINS = 200_000  # cap on bins of Y (tiny σ): coarser bins only loosen the lower bound
TAIL = 1e-30  # mass of Q left of the first edge and of P right of the last (they stay as bins)


def max_log_cdf(y, T, sigma, m):
    """log F_m(y) = log Φ((y - m)/σ) + (T - 1) log Φ(y/σ), Eq. (2)."""
    from scipy.special import log_ndtr  # lazy: scipy only where used
    return log_ndtr((y - m) / sigma) + (T - 1) * log_ndtr(y / sigma)


def max_log_sf(y, T, sigma, m):
    """log(1 - F_m(y)), Eq. (2), computed stably from the log CDF (-inf where it underflows:
    ``lower.binned_pld_down`` bounds such a bin's loss)."""
    with np.errstate(divide="ignore"):
        return np.log(-np.expm1(max_log_cdf(y, T, sigma, m)))


def _edges(T, sigma):
    """Increasing bin edges of Y covering all but ``TAIL`` of both laws' mass."""
    from scipy.special import ndtri  # lazy: scipy only where used
    lo = sigma * ndtri(np.exp(np.log(TAIL) / T))  # F_0(lo) = TAIL, below F_1 and F_2
    hi = MEANS[0] - sigma * ndtri(TAIL / T)  # T Φ(-(hi - 2)/σ) = TAIL bounds 1 - F_2(hi)
    width = LOSS_PER_BIN * sigma**2 / (MEANS[0] - MEANS[1])
    bins = int(min(MAX_BINS, np.ceil((hi - lo) / width)))
    return np.linspace(lo, hi, bins + 1)


def max_log_masses(T, sigma, edges):
    """log masses of the bins of Y under P = MoG(2) and Q = MoG(1): two arrays (bins + 2,)."""
    return tuple(
        interval_log_masses(lambda y, m=m: max_log_cdf(y, T, sigma, m),
                            lambda y, m=m: max_log_sf(y, T, sigma, m), edges)
        for m in MEANS)


def shuffle_lower_epsilon(batches, noise_multiplier, epochs, delta, h=H_LOWER):
    """ε_low(δ) for ``epochs`` epochs of ``batches`` shuffled batches each, Eqs. (1)-(2).

    ``h`` is the loss grid of the composition (``lower.lower_epsilon``); every h > 0 is sound.

    >>> round(shuffle_lower_epsilon(1000, 0.8, 1, 1e-6), 2)  # Poisson's ε here is 0.47
    6.04
    """
    return float(shuffle_lower_curve(batches, noise_multiplier, [epochs], delta, h)[0])


def shuffle_lower_curve(batches, noise_multiplier, epochs, delta, h=H_LOWER):
    """ε_low(δ) after each whole number of epochs in ``epochs`` (one binning, one FFT each way)."""
    T, sigma = int(batches), float(noise_multiplier)
    log_p, log_q = max_log_masses(T, sigma, _edges(T, sigma))
    return lower_epsilons([(log_p, log_q), (log_q, log_p)], delta, [int(e) for e in epochs], h)


__all__ = [
    "LOSS_PER_BIN", "MAX_BINS", "MEANS", "TAIL", "max_log_cdf", "max_log_masses", "max_log_sf",
    "shuffle_lower_curve", "shuffle_lower_epsilon",
]
