"""Signal-to-noise ratio of a DP-SGD update against the batch size, at a fixed privacy budget.

The SNR explorer's compute step (ARCHITECTURE.md, style item 7). DP-SGD (Abadi et al. 2016,
arXiv:1607.00133, Algorithm 1) updates with the clipped gradients' sum plus N(0, σ²C² I_d),
divided by the (expected) batch size B. With q = B / N and T = E round(1/q) steps for E epochs,
the budget (ε, δ) fixes σ(B) through the accountant (``calibrate.get_noise_multiplier``), and

    noise(B) = σ(B) C √d / B          RMS norm of the noise on the averaged update       (1)
    SNR(B)   = signal / noise(B)      signal = ||m̃||, the norm of the mean clipped gradient (2)

**The trade-off.** A larger batch raises q, so each step costs more privacy and the accountant
needs a larger σ; but the noise on the mean is divided by B. While q is small σ barely moves
with B (at ε = 1, δ = 1e-5, E = 10, N = 60,000 it goes from 0.80 at B = 16 to 1.04 at B = 151),
so the noise falls almost like 1/B and the SNR grows almost linearly (log-log slope 0.9); once q
is large (there B > 1000, q > 0.02) σ grows about like √B, and the SNR only like √B.

Lee et al. (2022, "NanoBatch Privacy", arXiv:2109.12191, §3.2, Fig. 1-4) see both sides on
CIFAR-10: the measured gradient SNR rises with the (accumulated) batch size, yet the accuracy at
a fixed ε peaks at a moderate batch (about 32 there), because a fixed number of epochs gives
only T = E N / B steps: fewer, cleaner steps. The SNR here is the per-step half of that story;
``steps`` is the other half. Yousefpour et al. (2021, "Opacus", arXiv:2109.12298, §2, "virtual
steps") separate the physical batch (what fits in memory) from this logical batch B, chosen for
convergence and privacy; their Table 1 (§3.1.3) shows a third pull, towards large B: the time
per epoch falls steeply with it.

``signal`` is a number: measure it with ``clipping.snapshot.clip_at(...).clipped_mean_norm`` (the
SNR widget does), or pick one; ||m̃|| <= C always. (1) is sqrt(E||z||²) for z ~ N(0, σ²C²I_d)/B;
E||z|| is smaller by under 1/(4d) relative.

σ(q, ε, δ, E) is cached (``noise_multiplier``): a widget's C or signal slider then never calls
the accountant, and moving back to a seen (ε, δ, E, N) is free.

Notation: N dataset size, B expected batch size, q = B / N, E epochs, T steps, σ noise
multiplier, C clip norm, d number of parameters, m̃ mean clipped gradient, ε, δ the budget.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from workbench.accounting.calibrate import get_noise_multiplier, steps_from_epochs
from workbench.checks import (
    check_count,
    check_delta,
    check_epsilon,
    check_max_grad_norm,
    check_nonnegative,
    check_positive,
)


@dataclass(frozen=True, eq=False)
class SNRResult:
    """SNR and σ against the batch size, for one budget (ε, δ, E) and one N, d, C, signal."""

    epsilon: float
    delta: float
    epochs: float
    dataset_size: int  # N
    num_params: int  # d
    max_grad_norm: float  # C
    signal: float  # ||m̃||
    batch_sizes: np.ndarray  # (k,) B, increasing
    sample_rates: np.ndarray  # (k,) q = B / N
    steps: np.ndarray  # (k,) T = E round(1/q) (steps_from_epochs)
    noise_multipliers: np.ndarray  # (k,) σ(B) for the budget
    noise_norms: np.ndarray  # (k,) Eq. (1)
    snr: np.ndarray  # (k,) Eq. (2)


@lru_cache(maxsize=4096)
def noise_multiplier(sample_rate, epsilon, delta, epochs):
    """σ for (ε, δ) after ``epochs`` epochs at sample rate q (RDP accountant), memoised."""
    return get_noise_multiplier(epsilon, delta, sample_rate, epochs=epochs)


def default_batch_sizes(dataset_size, count=12, smallest=16):
    """``count`` batch sizes, log-spaced from ``smallest`` to N (fewer if N is small).

    >>> default_batch_sizes(60_000).tolist()
    [16, 34, 71, 151, 319, 674, 1424, 3010, 6359, 13438, 28395, 60000]
    """
    n = check_count(dataset_size, "dataset_size")
    return np.unique(np.geomspace(min(smallest, n), n, count).round().astype(np.int64))


def explore_snr(epsilon, delta, epochs, dataset_size, num_params, max_grad_norm, signal,
                batch_sizes=None):
    """Compute an :class:`SNRResult`: σ(B), the noise norm and the SNR for each batch size.

    >>> r = explore_snr(1.0, 1e-5, 10, 60_000, 10_000, 1.0, 0.1, batch_sizes=[64, 256, 1024])
    >>> r.steps.tolist(), r.noise_multipliers.round(2).tolist(), r.snr.round(2).tolist()
    ([9380, 2340, 590], [0.91, 1.16, 1.89], [0.07, 0.22, 0.54])
    """
    epsilon = check_epsilon(epsilon, "epsilon")
    delta = check_delta(delta)
    epochs = check_positive(epochs, "epochs")
    n = check_count(dataset_size, "dataset_size")
    d = check_count(num_params, "num_params")
    C = check_max_grad_norm(max_grad_norm)
    signal = check_nonnegative(signal, "signal", note="a gradient norm")
    B = default_batch_sizes(n) if batch_sizes is None else np.asarray(batch_sizes)
    if B.ndim != 1 or B.size == 0 or not np.issubdtype(B.dtype, np.integer) or B.min() < 1 \
            or B.max() > n:
        raise ValueError(f"batch_sizes must be integers in [1, dataset_size={n}]; "
                         f"got {batch_sizes!r}")
    B = np.sort(B).astype(np.int64)  # (k,)
    q = B / n  # (k,)
    sigma = np.array([noise_multiplier(float(qi), epsilon, delta, epochs) for qi in q])  # (k,)
    noise = sigma * C * np.sqrt(d) / B  # (k,)  Eq. (1)
    return SNRResult(
        epsilon=epsilon, delta=delta, epochs=epochs, dataset_size=n, num_params=d,
        max_grad_norm=C, signal=signal, batch_sizes=B, sample_rates=q,
        steps=np.array([steps_from_epochs(epochs, qi) for qi in q]), noise_multipliers=sigma,
        noise_norms=noise, snr=signal / noise,  # Eq. (2)
    )


__all__ = ["SNRResult", "default_batch_sizes", "explore_snr", "noise_multiplier"]
