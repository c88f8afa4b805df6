"""Privacy-loss distribution (PLD) of the sampled Gaussian mechanism, discretised pessimistically.

Privacy loss: Sommer, Meiser, Mohammadi (2019), "Privacy Loss Classes: The Central Limit
Theorem in Differential Privacy", PoPETs, ePrint 2018/820. Subsampled Gaussian PLD and FFT
accounting: Koskela, Jälkö, Honkela (2020), "Computing Tight Differential Privacy Guarantees
Using FFT", arXiv:1906.03049. Discretisation: the "connect-the-dots" pessimistic estimate of
Doroshenko, Ghazi, Kamath, Kumar, Manurangsi (2022), "Connect the Dots: Tighter Discrete
Approximations of Privacy Loss Distributions", arXiv:2207.04380.

A pair of output laws (P, Q) has privacy loss L = log(dP/dQ)(x), x ~ P, and for every ε  (1)

    δ(ε) = E_P[(1 - exp(ε - L))_+]        (the hockey-stick divergence, plus any mass at L = +inf).

With μ0 = N(0, σ²), μ1 = (1 - q) N(0, σ²) + q N(1, σ²) and g(x) = log(1 - q + q e^((2x-1)/(2σ²))),
the two directions of add/remove adjacency are                                             (2)

    remove: P = μ1, Q = μ0, L = g(x);        add: P = μ0, Q = μ1, L = -g(x),

and g⁻¹(y) = σ² log((e^y - 1 + q) / q) + 1/2 for y > log(1 - q) maps loss values back to x.

Discretisation on the grid ℓ_k = k h. The loss mass of P on each bin (ℓ_k, ℓ_(k+1)] and the mass
of Q on the same event are exact Gaussian CDF differences. The bin's mass p is split between its
two end points so that both the mass and E_P[e^(-L)] (the Q-mass r) are kept:              (3)

    b = (r e^(ℓ_k) - p e^(-h)) / (1 - e^(-h))  to ℓ_k,       a = p - b  to ℓ_(k+1).

Why this is an upper bound: δ(ε) of a composition is E[f(Π_t e^(-L_t))] with f(u) = (1 - e^ε u)_+
convex and non-increasing, so spreading each e^(-L) to the ends of its bin with the mean kept
(Jensen) or moving a loss up can only increase δ. The mass of P below the grid is moved up to
its first point and the mass above it is put at +inf; both are pessimistic too. Because the
split keeps E[e^(-L)] exactly, the error does not drift with T as plain rounding up does
(rounding up shifts the composed loss by about T h / 2).

Notation: q sample rate, σ noise multiplier, h grid step of loss values, ℓ loss value,
δ(ε) the privacy profile, T steps.
"""

from dataclasses import dataclass

import numpy as np

#: Per-step probability mass cut from each tail of x (moved up to the grid, or to +inf).
TAIL_MASS = 1e-18
#: Largest one-step grid ``sgm_pld`` builds, and the most points ``grid_step`` refines to.
MAX_GRID_POINTS = 2**23
AUTO_GRID_POINTS = 2**20
#: Smallest δ the PLD accountant answers. Below it the FFT's round-off (~1e-16 per grid point,
#: ``compose.py``) is no longer small against δ: at δ = 1e-12 ε came out 2.4% above
#: dp-accounting's (q = 0.001, σ = 0.8, T = 10^4), at 1e-13 above RDP, at 1e-15 inf.
PLD_MIN_DELTA = 1e-10


def check_pld_delta(delta, accountant: str = "PLD"):
    """δ >= PLD_MIN_DELTA for the accountants composing by FFT (PLD, PRV), else an error
    pointing to RDP. PRV had no floor until 2026-11-29: at q = 1, σ = 5, T = 10 its lower
    bound came out above the exact ε from δ ≈ 7e-15, every bound was inf at 1e-16, and
    δ = 5e-324 raised a bare ZeroDivisionError."""
    if delta < PLD_MIN_DELTA:
        raise ValueError(
            f"delta={delta!r} is below {PLD_MIN_DELTA:g}, where the {accountant} accountant's "
            f"FFT round-off would dominate delta; use accountant='rdp' (valid at any delta)"
        )
    return delta


@dataclass(frozen=True)
class DiscretePLD:
    """A PLD on the grid ℓ_k = (offset + k) h: ``pmf`` (n,), plus ``inf_mass`` at L = +inf;
    ``roundoff`` bounds the l1 error of ``pmf`` from the FFT composition (``compose.py``,
    Eq. (3)), which ``epsilon_for_delta`` and ``delta_for_epsilon`` account for."""

    h: float
    offset: int
    pmf: np.ndarray
    inf_mass: float = 0.0
    roundoff: float = 0.0

    @property
    def losses(self):
        return (self.offset + np.arange(self.pmf.size)) * self.h


def _g(q, sigma, x):
    """g(x) = log(1 - q + q exp((2x - 1) / (2σ²))), Eq. (2), stable for large x."""
    log_1q = np.log1p(-q) if q < 1 else -np.inf
    return np.logaddexp(log_1q, np.log(q) + (2 * x - 1) / (2 * sigma**2))


def _g_inv(q, sigma, y):
    """x with g(x) = y; -inf where y <= log(1 - q) (loss values below the support).

    log(e^y - 1 + q) is taken as y + log1p(-(1 - q) e^-y) for y > 1, so that a loss beyond
    ~709 (σ below ~0.03) does not overflow e^y into inf and the masses into NaN.
    """
    y = np.asarray(y, dtype=np.float64)
    big = y > 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        small_part = np.log(np.expm1(np.minimum(y, 1.0)) + q)  # y <= 1: direct
        big_part = y + np.log1p(-(1 - q) * np.exp(-np.maximum(y, 1.0)))  # y > 1: no overflow
        inner = np.where(big, big_part, small_part) - np.log(q)
        inside = big | (np.expm1(np.minimum(y, 1.0)) + q > 0)
    return np.where(inside, sigma**2 * inner + 0.5, -np.inf)


def loss_std(q, sigma, direction):
    """Standard deviation of one step's privacy loss L under P (quadrature on an x grid)."""
    x = np.linspace(-12 * sigma, 1 + 12 * sigma, 4001)
    w0 = np.exp(-0.5 * (x / sigma) ** 2)
    w1 = np.exp(-0.5 * ((x - 1) / sigma) ** 2)
    w, sign = ((1 - q) * w0 + q * w1, 1.0) if direction == "remove" else (w0, -1.0)
    w = w / w.sum()
    ell = sign * _g(q, sigma, x)
    mean = np.dot(w, ell)
    return float(np.sqrt(np.dot(w, (ell - mean) ** 2)))


def loss_range(q, sigma, direction):
    """(ℓ_lo, ℓ_hi) holding one step's loss except TAIL_MASS of x on each side, Eq. (2)."""
    from scipy.special import ndtri  # lazy: scipy only where used
    z = -ndtri(TAIL_MASS)  # x beyond mean ± z σ is cut
    if direction == "remove":
        return float(_g(q, sigma, -z * sigma)), float(_g(q, sigma, 1 + z * sigma))
    return float(-_g(q, sigma, z * sigma)), float(-_g(q, sigma, -z * sigma))


def grid_step(h, q, sigma, direction, max_refine=100, max_points=AUTO_GRID_POINTS):
    """The grid step used: h, or finer (down to h / max_refine) when sd(L) < 20 h.

    Spreading mass over a bin of width h adds up to h²/4 to the loss variance per step (Eq. 3),
    so when the loss is narrow (small q, large σ) a fixed h inflates the composed variance, and
    ε, by more than a little (e.g. +0.8% at q = 0.001, σ = 3, h = 1e-4, as dp-accounting's PLD
    also shows); with h <= sd(L) / 20 the variance grows by at most 0.07%. The result stays a
    valid upper bound either way. The floor h / max_refine, and at most ``max_points``
    points over the loss range (a narrow loss can still have a long, rare tail), cap the cost.
    """
    lo, hi = loss_range(q, sigma, direction)
    refined = max(min(h, loss_std(q, sigma, direction) / 20), h / max_refine)
    return min(h, max(refined, (hi - lo) / max_points))


def _normal_masses(edges, mean, sigma):
    """Masses of N(mean, σ²) on (-inf, e0], (e0, e1], ..., (e_n, inf): (n + 2,), each accurate.

    Left of the mean the lower CDF is differenced, right of it the upper one, so tail bins keep
    their relative precision.
    """
    from scipy.special import ndtr  # lazy: scipy only where used
    z = (np.concatenate(([-np.inf], edges, [np.inf])) - mean) / sigma
    lower = np.diff(ndtr(z))
    upper = -np.diff(ndtr(-z))
    with np.errstate(invalid="ignore"):  # -inf + inf at an empty end bin: its side is moot
        mid = np.nan_to_num(0.5 * (z[:-1] + z[1:]), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.where(mid > 0, upper, lower)


def sgm_pld(q, sigma, h, direction):
    """Pessimistic discrete PLD of one step of the sampled Gaussian mechanism, Eqs. (2)-(3).

    ``direction`` is "remove" or "add"; q in (0, 1], σ > 0, h > 0 (validated by the caller).
    """
    ell_lo, ell_hi = loss_range(q, sigma, direction)
    if (ell_hi - ell_lo) / h > MAX_GRID_POINTS:
        raise ValueError(
            f"discretization={h:g} would need {(ell_hi - ell_lo) / h:.3g} grid points for one "
            f"step (q={q:g}, noise_multiplier={sigma:g}); the limit is {MAX_GRID_POINTS}. "
            f"Use a larger discretization, or the RDP accountant."
        )
    k = np.arange(np.floor(ell_lo / h), np.ceil(ell_hi / h) + 1)
    ell = k * h  # grid (n + 1,), also the bin edges
    x = _g_inv(q, sigma, ell if direction == "remove" else -ell)
    if direction == "add":
        x = x[::-1]  # increasing x; bins come out in reverse loss order
    m0 = _normal_masses(x, 0.0, sigma)  # μ0 on the x-intervals (n + 2,)
    m1 = (1 - q) * m0 + q * _normal_masses(x, 1.0, sigma)  # μ1
    p, r = (m1, m0) if direction == "remove" else (m0[::-1], m1[::-1])
    # p[0]: L <= ℓ_0 (moved up to ℓ_0); p[1:-1]: the n bins; p[-1]: L > ℓ_n (to +inf)
    with np.errstate(divide="ignore"):  # r e^ℓ in logs: it is <= p, but e^ℓ alone overflows
        r_exp = np.exp(np.log(r[1:-1]) + ell[:-1])  # past ℓ ≈ 709 (σ below ~0.03)
    b = (r_exp - p[1:-1] * np.exp(-h)) / -np.expm1(-h)  # Eq. (3)
    b = np.clip(b, 0.0, p[1:-1])  # rounding only: b is in [0, p] exactly
    pmf = np.zeros(ell.size)
    pmf[0] = p[0]
    pmf[:-1] += b
    pmf[1:] += p[1:-1] - b
    return DiscretePLD(h=h, offset=int(k[0]), pmf=pmf, inf_mass=float(p[-1]))


def _side(side):
    if side not in ("upper", "lower"):
        raise ValueError(f"side={side!r} must be 'upper' or 'lower'")
    return 1.0 if side == "upper" else -1.0


def delta_for_epsilon(pld, eps, side="upper"):
    """δ(ε) of a discrete PLD, Eq. (1), plus (``side="upper"``) or minus (``"lower"``) the
    round-off bound ``pld.roundoff``: an l1 error r in the pmf moves δ by at most r."""
    ell = pld.losses
    above = ell > eps
    delta = pld.inf_mass + float(np.sum(pld.pmf[above] * -np.expm1(eps - ell[above])))
    return max(delta + _side(side) * pld.roundoff, 0.0)


def epsilon_for_delta(pld, delta, side="upper"):
    """Smallest ε >= 0 with δ(ε) <= delta, Eq. (1) solved exactly between grid points, read at
    δ - ``pld.roundoff`` (``side="upper"``: an upper bound on the ε of the exact composition,
    inf where the round-off bound eats δ) or at δ + it (``"lower"``, for lower bounds)."""
    delta = delta - _side(side) * pld.roundoff
    if pld.inf_mass >= delta:
        return np.inf
    ell, p = pld.losses, pld.pmf
    keep = (ell > 0) & (p > 0)  # only ε >= 0 is asked for, and empty points add nothing
    ell, p = ell[keep], p[keep]
    if ell.size == 0:
        return 0.0
    s1 = np.cumsum(p[::-1])[::-1]  # Σ_{k >= j} p_k
    log_s2 = np.logaddexp.accumulate((np.log(p) - ell)[::-1])[::-1]  # log Σ_{k >= j} p_k e^-ℓ_k
    # δ on the segment [ℓ_(j-1), ℓ_j) is inf + s1[j] - e^ε s2[j]; at its left end ε = ℓ_(j-1)
    left = np.concatenate(([0.0], ell[:-1]))
    delta_left = pld.inf_mass + s1 - np.exp(left + log_s2)  # e^(left + log s2) <= s1 <= 1
    j = np.flatnonzero(delta_left > delta)
    if j.size == 0:
        return 0.0
    j = j[-1]  # last segment whose left end still exceeds delta
    return float(max(np.log(pld.inf_mass + s1[j] - delta) - log_s2[j], left[j]))


__all__ = [
    "AUTO_GRID_POINTS", "MAX_GRID_POINTS", "PLD_MIN_DELTA", "TAIL_MASS", "DiscretePLD",
    "check_pld_delta", "delta_for_epsilon", "epsilon_for_delta", "grid_step", "loss_range",
    "loss_std", "sgm_pld",
]
