"""Composition of discrete privacy-loss distributions by FFT.

Koskela, Jälkö, Honkela (2020), "Computing Tight Differential Privacy Guarantees Using FFT",
arXiv:1906.03049. Privacy losses of independent steps add up (Sommer, Meiser, Mohammadi 2019),
so the PLD of a composition is the convolution of the steps' PLDs; on a common grid of step h
and in the Fourier domain a T-fold self-composition is a T-th power:                    (1)

    ω_(1..T) = ω_1 * ω_2 * ... * ω_T,          DFT(ω^(*T)) = DFT(ω)^T.

A DFT of length n convolves cyclically, so mass outside a window of n grid points wraps around.
The window is chosen with a Chernoff bound on the sum S of the losses (λ > 0):             (2)

    P(S >= a) <= exp(-λ a) Π_g M_g(λ)^(T_g),      P(S <= b) <= exp(λ b) Π_g M_g(-λ)^(T_g),

with M_g(λ) = Σ_k ω_g(ℓ_k) e^(λ ℓ_k) the moment generating function of group g, so that each tail
outside the window holds at most ``TAIL_MASS``. The upper tail is added to the mass at +inf
(it could wrap to a low loss and hide from δ); the lower tail can only wrap upwards, which is
pessimistic. Masses at +inf compose as 1 - Π_g (1 - m_g)^(T_g).

Numerics: the inverse FFT has an absolute error near 1e-16 per grid point; negative values are
clipped to 0, so δ below about 1e-12 is dominated by round-off and should not be trusted.

Notation: ω a discrete PLD, T_g the count of group g, h grid step, λ Chernoff parameter.
"""

import numpy as np

from workbench.accounting.pld import DiscretePLD

#: Mass allowed outside the composed window on each side, Eq. (2).
TAIL_MASS = 1e-15
#: Largest composed grid (points of the cyclic convolution); 2**25 complex numbers are 512 MiB.
MAX_POINTS = 2**25
_LAMBDAS = np.logspace(-1.5, 3.5, 21)  # λ tried in Eq. (2), per unit of loss


def log_mgf(pld):
    """log M(λ) and log M(-λ) of the discrete PLD for every λ in ``_LAMBDAS``: (2, n_λ)."""
    with np.errstate(divide="ignore"):
        log_p = np.log(pld.pmf)
    ell = pld.losses
    out = np.empty((2, _LAMBDAS.size))
    for row, sign in enumerate((1.0, -1.0)):
        for i, lam in enumerate(_LAMBDAS):  # one λ at a time: memory stays O(n)
            a = log_p + sign * lam * ell  # log(ω_k e^(±λ ℓ_k))  (n,)
            m = a.max()
            out[row, i] = m + np.log(np.exp(a - m).sum())
    return out


def _polar(spectrum):
    """(log|z|, arg z) of a spectrum, so that powers cost one exp and one cis each."""
    with np.errstate(divide="ignore"):
        return np.log(np.abs(spectrum)), np.angle(spectrum)


def _power(polar, t):
    """z ** t from (log|z|, arg z), skipping frequencies where |z|^t < e^-70 (they add < 1e-30)."""
    log_r, theta = polar
    out = np.zeros(log_r.size, dtype=np.complex128)
    keep = t * log_r > -70.0
    out[keep] = np.exp(t * log_r[keep] + 1j * (t * theta[keep]))
    return out


def window(logm, support, h):
    """Grid indices [lo, hi] outside which each tail of the sum holds <= TAIL_MASS, Eq. (2).

    ``logm`` is Σ_g T_g log_mgf(ω_g) (2, n_λ); ``support`` the (lo, hi) indices the sum can reach.
    """
    a = np.min((logm[0] - np.log(TAIL_MASS)) / _LAMBDAS)
    b = np.max((np.log(TAIL_MASS) - logm[1]) / _LAMBDAS)
    return max(int(np.floor(b / h)), support[0]), min(int(np.ceil(a / h)), support[1])


def _fft_length(lo, hi, plds):
    """A fast FFT length holding the window [lo, hi] and every input PLD; refuses huge ones."""
    from scipy.fft import next_fast_len  # lazy: scipy only where used
    need = max([hi - lo + 1] + [pld.pmf.size for pld in plds])
    if need > MAX_POINTS:
        h = plds[0].h
        raise ValueError(
            f"the composed PLD spans {need * h:.4g} in privacy loss, {need} grid points of "
            f"h={h:g} (the limit is {MAX_POINTS}); such a run has epsilon far beyond any useful "
            f"guarantee. Use the RDP accountant, or a larger discretization."
        )
    return next_fast_len(need, real=True)


def _support(parts):
    lo = sum(t * pld.offset for pld, t in parts)
    return lo, lo + sum(t * (pld.pmf.size - 1) for pld, t in parts)


def _inf_mass(parts):
    return float(1 - np.prod([(1 - pld.inf_mass) ** t for pld, t in parts]) + TAIL_MASS)


def _read_window(cyclic, lo, hi, shift):
    """Grid points lo..hi of a cyclic convolution whose position 0 is grid index ``shift``."""
    return np.clip(cyclic[(np.arange(lo, hi + 1) - shift) % cyclic.size], 0.0, None)


def compose(parts):
    """The PLD of composing ``parts`` = [(DiscretePLD, count), ...] (same h), Eq. (1)."""
    from scipy.fft import irfft, rfft  # lazy: scipy only where used
    parts = [(pld, int(t)) for pld, t in parts if t > 0]
    h = parts[0][0].h
    if any(pld.h != h for pld, _ in parts):
        raise ValueError("all PLDs must share the grid step h to be composed")
    lo, hi = window(sum(t * log_mgf(pld) for pld, t in parts), _support(parts), h)
    n = _fft_length(lo, hi, [pld for pld, _ in parts])
    spectrum = np.ones(n // 2 + 1, dtype=np.complex128)
    for pld, t in parts:
        spectrum *= _power(_polar(rfft(pld.pmf, n)), t)  # Eq. (1)
    pmf = _read_window(irfft(spectrum, n), lo, hi, _support(parts)[0])
    return DiscretePLD(h=h, offset=lo, pmf=pmf, inf_mass=_inf_mass(parts))


def self_compose_many(pld, counts):
    """[ω^(*T) for T in counts], sharing one forward FFT: for ε-vs-steps curves."""
    from scipy.fft import irfft, rfft  # lazy: scipy only where used
    logm = log_mgf(pld)
    windows = [window(t * logm, _support([(pld, t)]), pld.h) for t in counts]
    n = _fft_length(0, max(hi - lo for lo, hi in windows), [pld])  # the widest window
    polar = _polar(rfft(pld.pmf, n))
    out = []
    for t, (lo, hi) in zip(counts, windows):
        pmf = _read_window(irfft(_power(polar, t), n), lo, hi, t * pld.offset)  # Eq. (1)
        out.append(DiscretePLD(h=pld.h, offset=lo, pmf=pmf, inf_mass=_inf_mass([(pld, t)])))
    return out


__all__ = ["MAX_POINTS", "TAIL_MASS", "compose", "log_mgf", "self_compose_many", "window"]
