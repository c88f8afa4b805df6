"""A lower bound on ε for DP-SGD with shuffled fixed-size batches (Chua et al. 2024).

Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha, Zhang (2024), "How Private are DP-SGD
Implementations?", ICML, arXiv:2403.17673, §4; multi-epoch: the same authors (2024), "Scalable
DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS, arXiv:2411.04205, §3.

One epoch of T = round(1/q) fixed-size batches puts each example in exactly one batch, at a
uniformly random position. With the differing example's clipped gradient 1 (in one coordinate)
against 0 (zero-out adjacency, the one under which fixed-size batches make sense; for the
sampled Gaussian it is the same pair as add/remove), the T noisy batch sums of one epoch are (1)

    P = (1/T) Σ_t N(e_t, σ² I_T)        against        Q = N(0, σ² I_T).

Every set S gives δ(ε) >= P(S) - e^ε Q(S). Chua et al. use the "cube" sets {w : max_t w_t <= C}
and their complements, i.e. they read only the largest coordinate Y = max_t w_t, whose laws (2)

    F_Q(y) = Φ(y/σ)^T,        F_P(y) = Φ((y - 1)/σ) Φ(y/σ)^(T-1).

Y is a post-processing of each epoch, so the E-fold product of (F_P, F_Q) is no more
distinguishable than E epochs (fresh shuffles) of the run: binning Y finely and composing its
privacy loss with losses rounded down (``lower.py``) gives δ_low(ε), hence ε_low(δ) <= the
true ε (both directions, P vs Q and Q vs P). Checked: at q = 1 it meets the exact Gaussian ε
within 1%. Not reproduced: Chua et al.'s gap *above* the Poisson ε; with this pair the bound
stays below Poisson's ε in the regimes tried (small σ, 100-1000 steps per epoch).
The no-amplification upper bound: given the positions, each
epoch is a Gaussian mechanism of sensitivity 1, so by joint convexity the run is no worse than
E Gaussian mechanisms, i.e. one with noise σ/√E (``gaussian.py``).

Notation: q = B/N, T batches per epoch, E epochs, σ noise multiplier, Φ standard normal CDF.
"""

import numpy as np
from scipy.special import log_ndtr

from workbench.accounting.lower import interval_log_masses, lower_epsilon

BINS = 4000  # bins of Y between the edges below, plus the two tails


def _max_laws(T, sigma):
    """(log CDF, log SF) of Y under P and under Q, Eq. (2); SF = log(1 - F) computed stably."""
    def log_cdf_q(y):
        return T * log_ndtr(y / sigma)

    def log_cdf_p(y):
        return log_ndtr((y - 1) / sigma) + (T - 1) * log_ndtr(y / sigma)

    def sf(log_cdf):
        return lambda y: np.log(-np.expm1(log_cdf(y)))

    return (log_cdf_p, sf(log_cdf_p)), (log_cdf_q, sf(log_cdf_q))


def shuffle_lower_epsilon(batches, noise_multiplier, epochs, delta, bins=BINS):
    """ε_low(δ) for ``epochs`` epochs of ``batches`` shuffled batches each, Eqs. (1)-(2)."""
    T, sigma = int(batches), float(noise_multiplier)
    center = sigma * np.sqrt(2 * np.log(T)) if T > 1 else 0.0  # where the max of T normals sits
    edges = np.linspace(center - 9 * sigma, center + 1 + 9 * sigma, bins + 1)  # (bins + 1,)
    (cp, sp), (cq, sq) = _max_laws(T, sigma)
    log_p = interval_log_masses(cp, sp, edges)  # (bins + 2,) Eq. (2)
    log_q = interval_log_masses(cq, sq, edges)
    return lower_epsilon([(log_p, log_q), (log_q, log_p)], delta, int(epochs))
