"""ε of a DP-SGD run: one number, a curve over steps, or a heterogeneous schedule.

A run is a history of groups (σ, q, T): T steps with noise multiplier σ and sample rate q. Two
accountants turn it into ε for a target δ, both upper bounds on the true ε:

- "rdp": Rényi DP adds up over steps (Mironov 2017, arXiv:1702.07476, Prop. 1),
  ε(α) = Σ_g T_g ε_g(α) (``rdp.py``), then the conversion of Balle et al. 2020 (``convert.py``).
  Fast (about a millisecond), and a curve over steps is almost free since RDP is linear in T.
- "pld": the privacy-loss distribution, composed by FFT (``pld.py``, ``compose.py``). Tighter,
  typically 5-15% smaller ε for DP-SGD settings, because RDP's conversion to (ε, δ) is lossy.
  Slower (tens to hundreds of milliseconds), and its grid step h sets the accuracy: the
  pessimistic discretisation stays an upper bound, and shrinking h tightens it. h is refined
  automatically when one step's loss is narrow (``pld.grid_step``).

Notation: q sample rate, σ noise multiplier, T steps, δ target delta, h PLD grid step.
"""

import numpy as np

from workbench.accounting.compose import compose, self_compose_many
from workbench.accounting.convert import rdp_to_epsilon
from workbench.accounting.pld import AUTO_GRID_POINTS, epsilon_for_delta, grid_step, sgm_pld
from workbench.accounting.rdp import DEFAULT_ORDERS, rdp_one_step
from workbench.checks import (
    check_choice,
    check_delta,
    check_noise_multiplier,
    check_orders,
    check_positive,
    check_sample_rate,
    check_steps,
)

ACCOUNTANTS = ("rdp", "pld")
#: Default grid step h of the PLD accountant (the same as dp-accounting's default).
PLD_DISCRETIZATION = 1e-4
#: Default limit on the automatic grid refinement of narrow losses (``pld.grid_step``).
MAX_REFINE = 100
DIRECTIONS = ("remove", "add")  # add/remove adjacency: ε is the worse of the two
#: Smallest δ the PLD accountant answers. Below it the FFT's round-off (~1e-16 per grid point,
#: ``compose.py``) is no longer small against δ: at δ = 1e-12 ε came out 2.4% above
#: dp-accounting's (q = 0.001, σ = 0.8, T = 10^4), at 1e-13 above RDP, at 1e-15 inf.
PLD_MIN_DELTA = 1e-10


def check_pld_delta(delta):
    """δ >= PLD_MIN_DELTA for the PLD accountant, else an error pointing to RDP."""
    if delta < PLD_MIN_DELTA:
        raise ValueError(
            f"delta={delta!r} is below {PLD_MIN_DELTA:g}, where the PLD accountant's FFT "
            f"round-off would dominate delta; use accountant='rdp' (valid at any delta)"
        )
    return delta


def check_history(history):
    """[(σ, q, T), ...] validated, as a list of (float, float, int) tuples."""
    return [
        (check_noise_multiplier(s), check_sample_rate(q), check_steps(t)) for s, q, t in history
    ]


def history_epsilon(history, delta, accountant="rdp", *, orders=DEFAULT_ORDERS,
                    discretization=PLD_DISCRETIZATION, max_refine=MAX_REFINE):
    """ε(δ) after the groups [(σ, q, T), ...] of ``history``, with the chosen accountant.

    ``orders`` are used by RDP; ``discretization`` (grid step h) and ``max_refine`` (how much
    finer a step may be used when one step's loss is narrow, see ``pld.grid_step``; 1 keeps h)
    by PLD.
    """
    history = check_history(history)
    delta = check_delta(delta)
    check_choice(accountant, "accountant", ACCOUNTANTS)
    live = [(s, q, t) for s, q, t in history if q > 0 and t > 0]
    if not live:
        return 0.0
    if any(s == 0 for s, _, _ in live):
        return float("inf")
    if accountant == "rdp":
        orders = check_orders(orders)
        rdp = sum(t * rdp_one_step(q, s, orders) for s, q, t in live)
        return rdp_to_epsilon(orders, rdp, delta)[0]
    h = check_positive(discretization, "discretization")
    max_refine = check_positive(max_refine, "max_refine")
    check_pld_delta(delta)
    eps = 0.0
    for d in DIRECTIONS:  # each direction on one grid shared by all its groups
        h_d = min(grid_step(h, q, s, d, max_refine) for s, q, _ in live)
        pld = compose([(sgm_pld(q, s, h_d, d), t) for s, q, t in live])
        eps = max(eps, epsilon_for_delta(pld, delta))
    return eps


def epsilon(sample_rate, noise_multiplier, steps, delta, accountant="rdp", *,
            orders=DEFAULT_ORDERS, discretization=PLD_DISCRETIZATION, max_refine=MAX_REFINE):
    """ε(δ) after ``steps`` steps of DP-SGD with sample rate q and noise multiplier σ.

    >>> round(epsilon(256 / 60_000, 1.1, 60 * 235, 1e-5), 3)  # MNIST, 60 epochs, batch 256
    2.6
    >>> round(epsilon(256 / 60_000, 1.1, 60 * 235, 1e-5, accountant="pld"), 3)
    2.385
    """
    return history_epsilon([(noise_multiplier, sample_rate, steps)], delta, accountant,
                           orders=orders, discretization=discretization, max_refine=max_refine)


def epsilon_curve(sample_rate, noise_multiplier, steps, delta, accountant="rdp", *,
                  orders=DEFAULT_ORDERS, discretization=PLD_DISCRETIZATION, max_refine=MAX_REFINE,
                  max_grid_points=AUTO_GRID_POINTS):
    """ε(δ) after each number of steps in ``steps`` (array-like of ints): an array, same length.

    RDP computes ε(α) once and scales it by T; PLD shares one forward FFT between the points.
    ``max_grid_points`` caps one step's PLD grid when it is refined (``pld.grid_step``).

    >>> epsilon_curve(0.01, 1.0, [0, 100, 1000], 1e-5).round(3)
    array([0.   , 1.214, 2.101])
    """
    q, sigma = check_sample_rate(sample_rate), check_noise_multiplier(noise_multiplier)
    counts = [check_steps(t) for t in np.atleast_1d(steps)]
    delta = check_delta(delta)
    check_choice(accountant, "accountant", ACCOUNTANTS)
    out = np.zeros(len(counts))
    live = [i for i, t in enumerate(counts) if t > 0 and q > 0]
    if not live or sigma == 0:
        out[live] = np.inf
        return out
    if accountant == "rdp":
        orders = check_orders(orders)
        rdp = np.outer([counts[i] for i in live], rdp_one_step(q, sigma, orders))  # (n, orders)
        out[live] = rdp_to_epsilon(orders, rdp, delta)[0]
        return out
    h = check_positive(discretization, "discretization")
    max_refine = check_positive(max_refine, "max_refine")
    check_pld_delta(delta)
    for d in DIRECTIONS:
        h_d = grid_step(h, q, sigma, d, max_refine, max_grid_points)
        plds = self_compose_many(sgm_pld(q, sigma, h_d, d), [counts[i] for i in live])
        out[live] = np.maximum(out[live], [epsilon_for_delta(p, delta) for p in plds])
    return out
