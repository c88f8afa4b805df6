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

Numerics (until 2026-11-30 the composition ran in float64 and its round-off, about 1e-16 per
grid point, put ε below the truth on ~1e6-point grids: 6.5420 for the exact lower bound 6.5479 at
δ = 1e-10). The FFTs and powers now run in long double (``DTYPE``, unit round-off u = 2^-64 on
x86), and every composed PLD carries ``roundoff``, a rigorous bound on the l1 error of its pmf,
which ``pld.epsilon_for_delta`` takes off δ (δ(ε) = Σ p_k (1 - e^(ε - ℓ_k))_+ has weights in
[0, 1], so an l1 error r moves δ by at most r). From the computed spectra:                  (3)

    forward FFT, per frequency (Higham 2002, "Accuracy and Stability of Numerical Algorithms",
    §24.1, the componentwise step of the proof of Thm. 24.2: L stages with |Â_i - A_i| <= η|A_i|
    and |A_L|...|A_1| = |F_n|):  |Ẑ_k - Z_k| <= γ ||ω||_1 = γ,   γ = (1 + η)^L - 1,

    with L = ceil(log2 n) + 2 and η = 8u (Higham's η = μ + γ_4(√2 + μ) is about 7u for radix 2;
    pocketfft's radix-3/4/5 butterflies err less per factor of 2, and the 2 extra stages cover its
    real-input pass and the 1/n). A power Ẑ^T then errs by at most (|Ẑ| + γ)^T - |Ẑ|^T, its polar
    evaluation by a relative 4 T u (|log|Ẑ|| + 4), a product over groups by Π U_g - Π C_g (U_g,
    C_g the bound on the true and the computed modulus); call the sum e_k. The inverse FFT adds
    at most γ ||Ŝ||_2 / sqrt(n) in l2 norm (Thm. 24.2), and the exact inverse of the error e
    has l2 norm ||e||_2 / sqrt(n) (Parseval), so the l1 error of the w points read is at most

        sqrt(w / n) (||e||_2 + γ ||Ŝ||_2)        (norms over all n frequencies),

    plus 2^-52 for rounding the result to float64. sgm_pld's own float64 errors are relative (a
    few ulp per mass) and stay relative through the composition.

Measured (2026-11-30): the float64 composition's actual l1 error (against long double) is
1/400-1/160 of the bound (3) evaluated for float64 (1.3e-10 for 4.9e-8 at q = 0.5, σ = 1000,
T = 10^6; 1.3e-11 for 4.7e-9 at q = 256/60000, σ = 1.1, T = 10^5): the margin of a worst-case
bound. In long double the bound is about 2.4e-17 T (2.3e-12 at T = 10^5, 2.4e-11 at 10^6):
nothing at δ = 1e-5, a quarter of δ = 1e-10 at T = 10^6 (``accountants/pld.py`` defers to RDP
where it is over half). Long double costs 2-5x float64's time (0.02 s -> 0.07 s for
T = 10^5 at q = 256/60000, σ = 1.1).

Notation: ω a discrete PLD, T_g the count of group g, h grid step, λ Chernoff parameter.
"""

import math

import numpy as np

from workbench.accounting.pld import DiscretePLD

#: Mass allowed outside the composed window on each side, Eq. (2).
TAIL_MASS = 1e-15
#: Largest composed grid (points of the cyclic convolution); its long-double half spectrum
#: is 512 MiB.
MAX_POINTS = 2**25
#: Arithmetic of the FFTs and powers; float64's round-off is too large for big grids, Eq. (3).
DTYPE = np.longdouble
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
    """z ** t from (log|z|, arg z), skipping frequencies where |z|^t < e^-70 (they add < 1e-30,
    and Eq. (3) counts them)."""
    log_r, theta = polar
    out = np.zeros(log_r.size, dtype=np.result_type(log_r.dtype, np.complex64))
    keep = t * log_r > -70.0
    out[keep] = np.exp(t * log_r[keep] + 1j * (t * theta[keep]))
    return out


def _fft_error(n, dtype):
    """γ of Eq. (3): componentwise error of a length-n FFT per unit of ||ω||_1."""
    u = float(np.finfo(dtype).eps) / 2
    return math.expm1((math.ceil(math.log2(n)) + 2) * math.log1p(8 * u))


def roundoff_bound(log_moduli, counts, n, w, dtype):
    """Eq. (3): a bound on the l1 error of w points read from the composed pmf of length n,
    from the computed log|Ẑ_g| of each group's half spectrum (n // 2 + 1 frequencies) and its
    count T_g."""
    u = float(np.finfo(dtype).eps) / 2
    gamma = _fft_error(n, dtype)
    log_c = np.zeros(n // 2 + 1)  # log of the computed modulus Π |Ẑ_g|^T_g
    log_u = np.zeros(n // 2 + 1)  # log of U, the bound on the true modulus
    excess = np.zeros(n // 2 + 1)  # log U - log C where every group's power is computed
    kept = np.ones(n // 2 + 1, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for log_r, t in zip(log_moduli, counts):
            log_r = np.asarray(log_r, dtype=np.float64)
            ok = t * log_r > -70.0  # ``_power`` leaves the others out: their error is all of U
            kept &= ok
            polar = np.where(ok, 4 * t * u * (np.abs(log_r) + 4), 0.0)
            excess += np.where(ok, t * np.log1p(gamma * np.exp(-log_r)), 0.0) + polar
            log_c += t * log_r
            log_u += t * np.logaddexp(log_r, math.log(gamma)) + polar
        err = np.where(kept, np.exp(log_c + excess) * -np.expm1(-excess),
                       np.exp(log_u) + np.exp(log_c))  # left out: |true| + |computed|
        computed = np.where(kept, np.exp(log_c), 0.0)
    err = np.nan_to_num(err, nan=np.inf)
    l2 = np.sqrt(2 * np.sum(err ** 2)) * (1 + gamma) + gamma * np.sqrt(2 * np.sum(computed ** 2))
    # (2: the n frequencies are at most twice the half spectrum)
    return float(1.01 * np.sqrt(w / n) * l2 + 2.0 ** -52)  # 1.01: its own float64 evaluation


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
    """Grid points lo..hi of a cyclic convolution whose position 0 is grid index ``shift``,
    as float64; negative values (round-off only) are clipped to 0, which only nears the truth."""
    return np.clip(cyclic[(np.arange(lo, hi + 1) - shift) % cyclic.size], 0.0, None).astype(
        np.float64)


def compose(parts, dtype=DTYPE):
    """The PLD of composing ``parts`` = [(DiscretePLD, count), ...] (same h), Eq. (1), with the
    round-off bound of Eq. (3); ``dtype`` float64 is for measuring that bound only."""
    from scipy.fft import irfft, rfft  # lazy: scipy only where used
    parts = [(pld, int(t)) for pld, t in parts if t > 0]
    h = parts[0][0].h
    if any(pld.h != h for pld, _ in parts):
        raise ValueError("all PLDs must share the grid step h to be composed")
    lo, hi = window(sum(t * log_mgf(pld) for pld, t in parts), _support(parts), h)
    n = _fft_length(lo, hi, [pld for pld, _ in parts])
    spectrum = np.ones(n // 2 + 1, dtype=np.result_type(dtype, np.complex64))
    log_moduli = []
    for pld, t in parts:
        polar = _polar(rfft(pld.pmf.astype(dtype), n))
        log_moduli.append(polar[0])
        spectrum *= _power(polar, t)  # Eq. (1)
    pmf = _read_window(irfft(spectrum, n), lo, hi, _support(parts)[0])
    bound = roundoff_bound(log_moduli, [t for _, t in parts], n, hi - lo + 1, dtype)
    bound += sum(pld.roundoff * t for pld, t in parts)  # inputs' own errors, to first order
    return DiscretePLD(h=h, offset=lo, pmf=pmf, inf_mass=_inf_mass(parts), roundoff=bound)


def self_compose_many(pld, counts, dtype=DTYPE):
    """[ω^(*T) for T in counts], sharing one forward FFT: for ε-vs-steps curves."""
    from scipy.fft import irfft, rfft  # lazy: scipy only where used
    logm = log_mgf(pld)
    windows = [window(t * logm, _support([(pld, t)]), pld.h) for t in counts]
    n = _fft_length(0, max(hi - lo for lo, hi in windows), [pld])  # the widest window
    polar = _polar(rfft(pld.pmf.astype(dtype), n))
    out = []
    for t, (lo, hi) in zip(counts, windows):
        pmf = _read_window(irfft(_power(polar, t), n), lo, hi, t * pld.offset)  # Eq. (1)
        bound = roundoff_bound([polar[0]], [t], n, hi - lo + 1, dtype) + t * pld.roundoff
        out.append(DiscretePLD(h=pld.h, offset=lo, pmf=pmf, inf_mass=_inf_mass([(pld, t)]),
                               roundoff=bound))
    return out


__all__ = [
    "DTYPE", "MAX_POINTS", "TAIL_MASS", "compose", "log_mgf", "roundoff_bound",
    "self_compose_many", "window",
]
