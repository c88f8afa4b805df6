"""The PRV accountant: privacy loss random variables, composed by FFT, with stated error bounds.

Gopi, Lee, Wutschitz (2021), "Numerical Composition of Differential Privacy", NeurIPS,
arXiv:2106.02848. A mechanism's privacy loss random variable (PRV) is Y = log(dP/dQ)(o) with
o ~ P; the PRVs of composed steps add, and (their Thm. 3.3; Eq. (1) of ``../pld.py``)      (1)

    δ_Y(ε) = E[(1 - e^(ε - Y))_+].

For the sampled Gaussian mechanism (μ0 = N(0, σ²), μ1 = (1 - q) N(0, σ²) + q N(1, σ²), and
g(x) = log(1 - q + q e^((2x - 1) / (2σ²))), as in ``../pld.py``) the two directions of
add/remove adjacency have the CDFs (their App. B, Prop. B.4, in this notation)              (2)

    remove: F(t) = P_μ1(g(x) <= t) = (1 - q) Φ(g⁻¹(t) / σ) + q Φ((g⁻¹(t) - 1) / σ),
    add:    F(t) = P_μ0(-g(x) <= t) = 1 - Φ(g⁻¹(-t) / σ).

Their Algorithm 1, as done here for each direction:

1. truncate every step's Y to [-L, L] and renormalise, with L from RDP so that the mass cut
   from the composition and from each step is small next to δ_err (their Remark 5.6);
2. discretise on the grid t_k = k h: the mass of the bin (t_k - h/2, t_k + h/2] goes to t_k,
   then the whole grid is shifted by s = E[Y_trunc] - Σ_k t_k p_k so the mean is kept;
3. compose the T steps by FFT (``../compose.py``; the shifts add: S = Σ_g T_g s_g);
4. read ε̃(δ) off the composed discrete PRV with Eq. (1).

With h = ε_err / sqrt(T log(12 / δ_err) / 2) their Thm. 5.5 (for the truncation of step 1)
gives δ_Y(ε + ε_err) - δ_err <= δ̃(ε) <= δ_Y(ε - ε_err) + δ_err, so the true ε lies in     (3)

    [ε̃(δ + δ_err) - ε_err,  ε̃(δ - δ_err) + ε_err],

whose ends this accountant reports as ``lower`` and ``upper``; ``epsilon`` (what the engine,
calibration and the explorer use) is the upper end, a guarantee within its stated error. The
defaults ε_err = 0.01 and δ_err = δ / 1000 are Opacus' and the authors'. Unlike ``pld.py``,
whose pessimistic grid is an upper bound by construction, the PRV's estimate ε̃ may fall on
either side of the truth; its interval is what it promises.

Notation: σ noise multiplier, q sample rate, T steps (Σ over groups), h grid step, L domain
half-width, ε_err and δ_err the stated errors, Φ the standard normal CDF.
"""

from dataclasses import dataclass

import numpy as np

from workbench.accounting.accountant import Accountant
from workbench.accounting.compose import compose, self_compose_many
from workbench.accounting.noise_range import accounted_history
from workbench.accounting.pld import (
    DiscretePLD,
    _g,
    _g_inv,
    _normal_masses,
    check_pld_delta,
    epsilon_for_delta,
)
from workbench.accounting.registry import register_accountant
from workbench.checks import check_delta, check_positive

EPS_ERROR = 0.01  # ε_err, absolute
DELTA_ERROR_RATIO = 1e-3  # δ_err = δ / 1000
MAX_GRID_POINTS = 2**23  # one step's grid; beyond it the requested precision is refused
DIRECTIONS = ("remove", "add")
TRIM_MASS = 1e-30  # mass left at each end of one step's grid that may be dropped


@dataclass(frozen=True)
class PRVEpsilon:
    """ε of a run by the PRV accountant: the estimate and the interval of Eq. (3)."""

    lower: float
    estimate: float
    upper: float
    eps_error: float
    delta_error: float


@dataclass(frozen=True)
class _ShiftedPRV:
    """A composed discrete PRV whose grid points are (offset + k) h + shift."""

    h: float
    offset: int
    pmf: np.ndarray
    inf_mass: float
    shift: float
    roundoff: float = 0.0  # the FFT's, ``compose.py`` Eq. (3)

    @property
    def losses(self):
        return (self.offset + np.arange(self.pmf.size)) * self.h + self.shift


def _domain(history, delta_error):
    """L of step 1: the RDP ε of the run at δ_err / 4 and of each single step at
    δ_err / (8 T), plus a margin of 3 (Remark 5.6 of Gopi et al.; the same as their code)."""
    from workbench.accounting.accountants.rdp import rdp_epsilon

    T = sum(t for _, _, t in history)
    L = rdp_epsilon(history, delta_error / 4)
    for s, q, _ in history:
        L = max(L, rdp_epsilon([(s, q, 1)], delta_error / (8 * T)))
    return float(L) + 3.0


def _x_of(t, q, sigma, direction):
    """x with loss t in ``direction`` (increasing in t for remove, decreasing for add)."""
    return _g_inv(q, sigma, t) if direction == "remove" else _g_inv(q, sigma, -t)


def _bin_masses(edges, q, sigma, direction):
    """Masses of Y on (-inf, e0], (e0, e1], ..., (e_n, inf), Eq. (2): exact normal tails."""
    x = _x_of(edges, q, sigma, direction)
    if direction == "remove":
        return (1 - q) * _normal_masses(x, 0.0, sigma) + q * _normal_masses(x, 1.0, sigma)
    return _normal_masses(x[::-1], 0.0, sigma)[::-1]  # add: Y = -g(x) falls as x grows


def _truncated_mean(q, sigma, L, direction):
    """E[Y | -L <= Y <= L] by quadrature in x (Y = ±g(x) is smooth in x)."""
    from scipy import integrate
    from scipy.stats import norm

    lo, hi = sorted(float(v) for v in _x_of(np.array([-L, L]), q, sigma, direction))
    reach = 40 * sigma + 1  # beyond it both normals hold < 1e-300: an infinite end is cut there
    lo, hi = max(lo, -reach), min(hi, reach)
    sign = 1.0 if direction == "remove" else -1.0

    def density(x):
        if direction == "remove":
            return (1 - q) * norm.pdf(x, 0, sigma) + q * norm.pdf(x, 1, sigma)
        return norm.pdf(x, 0, sigma)

    points = [v for v in (0.0, 0.5, 1.0) if lo < v < hi]
    mass = integrate.quad(density, lo, hi, points=points or None, limit=200)[0]
    first = integrate.quad(lambda x: sign * float(_g(q, sigma, x)) * density(x), lo, hi,
                           points=points or None, limit=200)[0]
    return first / mass


def _discrete_step(q, sigma, h, L, direction):
    """Steps 1-2: (DiscretePLD on k h for |k h| <= L, the mean-keeping shift s)."""
    K = int(np.ceil(L / h))
    if 2 * K + 1 > MAX_GRID_POINTS:
        raise ValueError(
            f"the PRV accountant would need {2 * K + 1} grid points for one step (domain "
            f"{L:.3g}, mesh {h:.3g}); the limit is {MAX_GRID_POINTS}. Raise eps_error, or use "
            f"the PLD or RDP accountant")
    k = np.arange(-K, K + 1)
    edges = (np.arange(-K, K + 2) - 0.5) * h  # (2K + 2,): bin edges around each t_k
    masses = _bin_masses(edges, q, sigma, direction)[1:-1]  # drop the two tails (truncation)
    pmf = masses / masses.sum()  # renormalised on [-L, L]
    shift = _truncated_mean(q, sigma, K * h, direction) - float(np.dot(k * h, pmf))
    # the ends where less than TRIM_MASS is left are dropped: a narrow loss fills a sliver of
    # [-L, L], and the FFT window and its Chernoff bound then work on that sliver only
    keep = np.flatnonzero((np.cumsum(pmf) > TRIM_MASS) & (np.cumsum(pmf[::-1])[::-1] > TRIM_MASS))
    first, last = keep[0], keep[-1]
    return DiscretePLD(h=h, offset=int(k[first]), pmf=pmf[first:last + 1]), shift


def _composed(history, h, L, direction):
    """Step 3: the composed discrete PRV of one direction."""
    parts, total_shift = [], 0.0
    for s, q, t in history:
        step, shift = _discrete_step(q, s, h, L, direction)
        parts.append((step, t))
        total_shift += t * shift
    pld = compose(parts)
    return _ShiftedPRV(pld.h, pld.offset, pld.pmf, pld.inf_mass, total_shift, pld.roundoff)


def _check_errors(delta, eps_error, delta_error):
    """(δ, ε_err, δ_err) validated; δ_err defaults to δ / 1000 and must be below δ."""
    delta = check_pld_delta(check_delta(delta), "PRV")
    eps_error = check_positive(eps_error, "eps_error")
    delta_error = delta * DELTA_ERROR_RATIO if delta_error is None else check_positive(
        delta_error, "delta_error")
    if not delta_error < delta:
        raise ValueError(f"delta_error={delta_error!r} must be below delta={delta!r} (the "
                         f"upper end of Eq. (3) reads epsilon at delta - delta_error)")
    return delta, eps_error, delta_error


def prv_epsilon_bounds(history, delta, eps_error=EPS_ERROR, delta_error=None) -> PRVEpsilon:
    """ε of the groups [(σ, q, T), ...] (all > 0) at ``delta``: estimate and interval, Eq. (3).

    >>> b = prv_epsilon_bounds([(1.0, 0.01, 1000)], 1e-5)
    >>> b.lower <= b.estimate <= b.upper, round(b.upper - b.lower, 2) <= 0.03
    (True, True)
    """
    delta, eps_error, delta_error = _check_errors(delta, eps_error, delta_error)
    T = sum(t for _, _, t in history)
    h = eps_error / np.sqrt(T * np.log(12 / delta_error) / 2)
    L = _domain(history, delta_error)
    lower = estimate = upper = 0.0
    for direction in DIRECTIONS:  # add/remove adjacency: the worse of the two
        prv = _composed(history, h, L, direction)
        # every reading allows for the FFT's round-off (``compose.py`` Eq. (3)): the upper end
        # at δ - δ_err - it, the lower at δ + δ_err + it (until 2026-11-30 the interval missed
        # the truth, 1.42-1.44 for <= 0.89 at δ = 1e-10 on 1.5M points; a measured spill
        # max(|mass - 1|, 10 n eps) stood in for the bound until 2026-11-30)
        estimate = max(estimate, epsilon_for_delta(prv, delta))
        upper = max(upper, epsilon_for_delta(prv, delta - delta_error) + eps_error)
        lower = max(lower, epsilon_for_delta(prv, delta + delta_error, side="lower") - eps_error)
    return PRVEpsilon(max(lower, 0.0), estimate, upper, eps_error, delta_error)


def prv_epsilon(history, delta, eps_error=EPS_ERROR, delta_error=None):
    """The upper end of Eq. (3): ε after the groups, a guarantee within the stated error."""
    return prv_epsilon_bounds(history, delta, eps_error, delta_error).upper


def prv_curve(q, sigma, steps, delta, eps_error=EPS_ERROR, delta_error=None):
    """The upper end of Eq. (3) after each count in ``steps`` (all > 0), from one
    discretisation: the mesh and the domain of the largest count hold for every smaller one
    (a finer mesh and a wider domain only shrink the error of Thm. 5.5)."""
    delta, eps_error, delta_error = _check_errors(delta, eps_error, delta_error)
    T = max(steps)
    h = eps_error / np.sqrt(T * np.log(12 / delta_error) / 2)
    L = _domain([(sigma, q, T)], delta_error)
    out = np.zeros(len(steps))
    for direction in DIRECTIONS:
        step, shift = _discrete_step(q, sigma, h, L, direction)
        for i, (t, pld) in enumerate(zip(steps, self_compose_many(step, list(steps)))):
            prv = _ShiftedPRV(pld.h, pld.offset, pld.pmf, pld.inf_mass, t * shift, pld.roundoff)
            out[i] = max(out[i], epsilon_for_delta(prv, delta - delta_error) + eps_error)
    return out


class PRVAccountant(Accountant):
    """PRV accountant (Gopi et al. 2021): ``get_epsilon`` is the upper end of its interval,
    ``get_epsilon_bounds`` the whole of it.

    >>> acc = PRVAccountant()
    >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=1000)
    >>> b = acc.get_epsilon_bounds(1e-5)
    >>> b.lower <= b.estimate <= b.upper == acc.get_epsilon(1e-5)
    True
    """

    name = "prv"

    def __init__(self, eps_error=EPS_ERROR, delta_error=None):
        super().__init__()
        self.eps_error = check_positive(eps_error, "eps_error")
        self.delta_error = None if delta_error is None else check_positive(
            delta_error, "delta_error")

    def get_epsilon_bounds(self, delta) -> PRVEpsilon:
        """Eq. (3) for this history; all zero while nothing was released."""
        live = [(s, q, t) for s, q, t in accounted_history(self.history) if q > 0 and t > 0]
        if not live or any(s == 0 for s, _, _ in live):  # nothing released, or no noise
            check_delta(delta)
            eps = np.inf if live else 0.0
            return PRVEpsilon(eps, eps, eps, self.eps_error, self.delta_error or 0.0)
        return prv_epsilon_bounds(live, delta, self.eps_error, self.delta_error)

    def _options(self):
        return {"eps_error": self.eps_error, "delta_error": self.delta_error}

    def _load_options(self, state_dict):
        eps_error = check_positive(state_dict["eps_error"], "eps_error")
        d = state_dict["delta_error"]
        self.delta_error = None if d is None else check_positive(d, "delta_error")
        self.eps_error = eps_error


def _explore_label(options):
    return f"PRV upper bound (ε_err {options.get('eps_error', EPS_ERROR):g})"


register_accountant("prv", label="PRV", epsilon=prv_epsilon, curve=prv_curve,
                    accountant_class=PRVAccountant,
                    slow=True, style={"color": "C4", "marker": "s", "markersize": 3},
                    explore_label=_explore_label)


__all__ = [
    "DELTA_ERROR_RATIO", "DIRECTIONS", "EPS_ERROR", "MAX_GRID_POINTS", "TRIM_MASS", "PRVAccountant",
    "PRVEpsilon", "prv_curve", "prv_epsilon", "prv_epsilon_bounds",
]
