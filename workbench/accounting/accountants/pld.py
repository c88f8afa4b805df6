"""The PLD accountant: the privacy-loss distribution of the run, composed by FFT.

Koskela, Jälkö, Honkela (2020), arXiv:1906.03049: the loss of one step of the sampled Gaussian
mechanism is discretised on a grid of step h (``../pld.py``, pessimistically, as in Doroshenko
et al. 2022, arXiv:2207.04380), the T steps are composed by FFT (``../compose.py``), and ε(δ)
is read off the composed distribution. Tighter than RDP (typically 5-15% smaller ε for DP-SGD
settings, whose conversion to (ε, δ) is lossy), slower (tens to hundreds of milliseconds). The
pessimistic discretisation stays an upper bound, and shrinking h tightens it; h is refined
automatically when one step's loss is narrow (``pld.grid_step``). Add/remove adjacency: ε is
the worse of the two directions, each on one grid shared by all its groups.

Never above RDP (``registry``: ``never_above=("rdp",)``, which the noise calibration relies on):
the result is the smaller of the PLD's ε and the RDP accountant's, both upper bounds. The PLD's
is one including the FFT's round-off: ε is read at δ minus the bound of ``compose.py`` Eq. (3)
(until 2026-11-30 it was not, and came out below the truth by up to 0.03 on ~1e6-point grids
near δ = 1e-10); where that bound eats δ (T beyond ~2·10^6 at δ = 1e-10) RDP answers, with a
``RuntimeWarning``. Groups with q = 1 are one Gaussian mechanism (``_unsampled``) and are
composed as a single step of it. Where the
loss of one step is far narrower than the finest grid (σ = 1e8 at q = 1 for 1e12 steps: one
Gaussian with σ = 100) the grid's own spread, h²/4 per step, swamps the loss's variance and the
PLD alone said ε = 0.33 against RDP's 0.031 and the exact 0.027.

Notation: σ noise multiplier, q sample rate, T steps, h grid step, δ target delta.
"""

import warnings

import numpy as np

from workbench.accounting.accountant import Accountant
from workbench.accounting.accountants.rdp import rdp_curve, rdp_epsilon
from workbench.accounting.compose import compose, self_compose_many
from workbench.accounting.gaussian import gaussian_epsilon
from workbench.accounting.pld import (
    AUTO_GRID_POINTS,
    MAX_GRID_POINTS,
    check_pld_delta,
    epsilon_for_delta,
    grid_step,
    loss_range,
    sgm_pld,
)
from workbench.accounting.registry import register_accountant
from workbench.checks import check_positive

#: Default grid step h of the PLD accountant (the same as dp-accounting's default).
PLD_DISCRETIZATION = 1e-4
#: Default limit on the automatic grid refinement of narrow losses (``pld.grid_step``).
MAX_REFINE = 100
DIRECTIONS = ("remove", "add")  # add/remove adjacency: ε is the worse of the two


def pld_epsilon(history, delta, discretization=PLD_DISCRETIZATION, max_refine=MAX_REFINE):
    """ε(δ) after the groups [(σ, q, T), ...] (all > 0), composed on the grid h."""
    h = check_positive(discretization, "discretization")
    max_refine = check_positive(max_refine, "max_refine")
    check_pld_delta(delta)
    if all(q == 1 for _, q, _ in history):
        return _unsampled(history, delta)
    history = _merge_unsampled(history)
    eps, roundoff = 0.0, 0.0
    for d in DIRECTIONS:  # each direction on one grid shared by all its groups
        h_d = min(grid_step(h, q, s, d, max_refine) for s, q, _ in history)
        fits = max((hi - lo) / MAX_GRID_POINTS for lo, hi in  # the finest step at which
                   (loss_range(q, s, d) for s, q, _ in history))  # every group's grid fits
        h_d = min(h, max(h_d, fits))  # a narrow group's refinement, not past a wide group's
        # limit (until 2026-11-29 the refined step was refused for the wide group, the
        # message blaming the discretization the user had not chosen)
        pld = compose([(sgm_pld(q, s, h_d, d), t) for s, q, t in history])
        eps = max(eps, epsilon_for_delta(pld, delta))  # at δ - pld.roundoff: an upper bound
        roundoff = max(roundoff, pld.roundoff)
    rdp = rdp_epsilon(history, delta)
    _note_roundoff(roundoff, delta, rdp <= eps)
    return min(eps, rdp)  # two upper bounds: the smaller holds


def _merge_unsampled(history):
    """The groups with q = 1 as one Gaussian step of noise (Σ T / σ²)^(-1/2) (``_unsampled``):
    the same mechanism, and one step instead of T on the FFT grid (R1 of 2026-11-30: 10^6 steps
    of σ = 1000 beside one other step came out at 6.5420 for an exact lower bound of 6.5479)."""
    full = [(s, t) for s, q, t in history if q == 1]
    if not full:
        return list(history)
    sigma = sum(t / s ** 2 for s, t in full) ** -0.5
    return [(sigma, 1.0, 1)] + [(s, q, t) for s, q, t in history if q != 1]


def _note_roundoff(roundoff, delta, rdp_answers):
    """Warn when the FFT's round-off bound took over half of δ and RDP's ε is what is left."""
    if roundoff > delta / 2 and rdp_answers:
        warnings.warn(
            f"the PLD accountant's FFT round-off bound ({roundoff:.3g}) is over half of "
            f"delta={delta:g}, so epsilon is the RDP accountant's; a larger delta, or fewer "
            f"steps, lets the PLD answer", RuntimeWarning, stacklevel=3)


def pld_curve(q, sigma, steps, delta, discretization=PLD_DISCRETIZATION, max_refine=MAX_REFINE,
              max_grid_points=AUTO_GRID_POINTS):
    """ε(δ) after each count in ``steps`` (all > 0), sharing one forward FFT between them."""
    h = check_positive(discretization, "discretization")
    max_refine = check_positive(max_refine, "max_refine")
    check_pld_delta(delta)
    if q == 1:
        return np.array([_unsampled([(sigma, 1.0, t)], delta) for t in steps])
    out, roundoff = np.zeros(len(steps)), 0.0
    for d in DIRECTIONS:
        h_d = grid_step(h, q, sigma, d, max_refine, max_grid_points)
        plds = self_compose_many(sgm_pld(q, sigma, h_d, d), list(steps))
        out = np.maximum(out, [epsilon_for_delta(p, delta) for p in plds])  # at δ - roundoff
        roundoff = max([roundoff] + [p.roundoff for p in plds])
    rdp = rdp_curve(q, sigma, steps, delta)
    _note_roundoff(roundoff, delta, bool(np.any(rdp <= out)))
    return np.minimum(out, rdp)  # never above RDP (docstring)


def _unsampled(history, delta) -> float:
    """ε(δ) of groups [(σ, 1, T), ...]: every record in every step, so the composition is one
    Gaussian mechanism of noise (Σ_t T_t / σ_t²)^(-1/2), whose ε is exact (``gaussian.py``).
    The FFT's round-off, which grows with T, put the PLD's ε below that exact value at many
    steps near the δ floor until 2026-11-30 (σ = 6324.6, T = 10^7, δ = 1e-10: 3.09793 for
    3.09943; σ = 2, T = 3000: 548.309 for 548.314); mixed histories merge their q = 1 groups
    into one such step (``_merge_unsampled``) and bound the round-off (``compose.py``)."""
    eps = gaussian_epsilon(sum(t / s ** 2 for s, _, t in history) ** -0.5, delta)
    return eps + 4e-13 * (1 + eps)  # past the root finder's tolerance: an upper bound still


class PLDAccountant(Accountant):
    """Privacy-loss-distribution accountant; ``discretization`` is the loss grid step h.

    >>> acc = PLDAccountant()
    >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=1000)
    >>> round(acc.get_epsilon(1e-5), 3)
    1.828
    """

    name = "pld"

    def __init__(self, discretization=PLD_DISCRETIZATION):
        super().__init__()
        self.discretization = check_positive(discretization, "discretization")

    def _options(self):
        return {"discretization": self.discretization}

    def _load_options(self, state_dict):
        self.discretization = check_positive(state_dict["discretization"], "discretization")


def _explore_label(options):
    """The explorer draws PLD on a coarse grid, capped by RDP (``explore.py``)."""
    return f"PLD upper bound (grid {options['discretization']:.1g}, capped by RDP)"


register_accountant("pld", label="PLD", epsilon=pld_epsilon, curve=pld_curve,
                    accountant_class=PLDAccountant, never_above=("rdp",), slow=True,
                    style={"color": "C1", "marker": "o", "markersize": 3},
                    explore_label=_explore_label)


__all__ = [
    "DIRECTIONS", "MAX_REFINE", "PLD_DISCRETIZATION", "PLDAccountant", "pld_curve", "pld_epsilon",
]
