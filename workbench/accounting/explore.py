"""The budget explorer's compute step: ε against epochs for one DP-SGD configuration.

Pure function, small dataclass out (ARCHITECTURE.md, style item 7); ``workbench.viz.budget`` draws
it and ``workbench.widgets.budget`` wires it to sliders. A dataset of N records read in Poisson
batches of expected size B has sample rate q = B / N, so one epoch is round(1/q) steps and E
epochs are T = E round(1/q) steps (``steps_from_epochs``; Abadi et al. 2016, arXiv:1607.00133,
§3.1). ε(δ) is drawn for every registered accountant (``registry.ACCOUNTANTS``: RDP and PLD
built in), one ``EpsilonCurve`` each; in "solve" mode the noise multiplier is first calibrated
so the run ends exactly at the target ε (``calibrate.py``, with the RDP accountant). An
accountant registered ``slow`` gets ``pld_points`` points instead of ``points``, and each curve
is capped by the curves of the accountants it is registered as never above (``never_above``).

The PLD curve (slow, never above RDP) is a fast *upper bound*, labelled so in the plot: a
coarser grid, ``EXPLORE_DISCRETIZATION`` = 1e-3 instead of 1e-4, refined for narrow losses down
to sd(L) / 20 (no floor: ``EXPLORE_MAX_REFINE``) but to at most ``EXPLORE_GRID_POINTS`` points
per step (``pld.grid_step``), and fewer points (8). The pessimistic discretisation keeps it
above the exact ε, and it is capped by the RDP curve at the same epochs (the smaller of two
upper bounds is one too), so it never exceeds RDP. Where the grid reaches sd(L) / 4 (the loss
variance grows by at most 1.6%) it is within 1% of dp-accounting's PLD
(tests/accounting/test_explore_pld.py), batch sizes of one record and large σ included (a
fixed refinement floor left it 1.4x above at B = 1, σ = 4, and more at larger σ). Where the
point cap stops the refinement first (a narrow loss with a long tail: B of a few records at
small σ), the legend says so (``COARSE_NOTE``): the curve is then a looser upper bound, e.g.
1.1x the exact ε at B = 1, σ = 0.6; ``wb.epsilon(..., "pld")`` gives the fine one.

With ``shuffle=True`` the explorer also brackets the same run with *shuffled* fixed-size
batches (T_b = round(N / B) per epoch, ``bounds.py``): Chua et al.'s lower bound
(``shuffle.py``, on a coarse loss grid ``EXPLORE_SHUFFLE_H``, still a lower bound, within 1%
of the fine grid) and the no-amplification upper bound, at ``shuffle_points`` whole epochs.
Where the lower bound is above the Poisson curves (small σ, many batches per epoch), reporting
the Poisson ε for a shuffled run understates it.

Notation: N dataset size, B batch size, q = B / N, σ noise multiplier, E epochs, δ, T steps.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from workbench.accounting.bounds import batches_per_epoch
from workbench.accounting.calibrate import get_noise_multiplier, steps_from_epochs
from workbench.accounting.curve import epsilon_curve
from workbench.accounting.gaussian import gaussian_epsilon
from workbench.accounting.noise_range import accounted_sigma
from workbench.accounting.pld import check_pld_delta, grid_step, loss_std
from workbench.accounting.registry import ACCOUNTANTS
from workbench.accounting.shuffle import shuffle_lower_curve
from workbench.checks import (
    check_choice,
    check_count,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_positive,
)

EXPLORE_DISCRETIZATION = 1e-3
EXPLORE_GRID_POINTS = 2**15  # per-step grid cap: bounds the cost of a refined grid
EXPLORE_MAX_REFINE = 10**6  # no practical floor on refinement: the point cap bounds the cost
COARSE_NOTE = "; coarse grid here: looser than the exact PLD"
EXPLORE_SHUFFLE_H = 1e-3  # loss grid of the shuffle lower bound (tests/accounting/test_shuffle)
MODES = ("epsilon", "solve")
MAX_POINTS = 10**6  # points on a curve: beyond this a plot gains nothing


@dataclass(frozen=True)
class EpsilonCurve:
    """One accountant's ε(δ) against epochs, with how to draw it."""

    name: str  # the accountant's registered name, e.g. "rdp"
    label: str  # its short label, e.g. "RDP"
    legend: str  # the legend entry (the PLD one says it is a capped upper bound)
    style: dict  # line keywords for matplotlib, from the registration
    epochs: np.ndarray  # (n,) epochs of the points
    epsilon: np.ndarray  # (n,) ε(δ) at each

    @property
    def final(self):
        """ε(δ) at the end of training."""
        return float(self.epsilon[-1])


@dataclass(frozen=True)
class BudgetResult:
    """ε against epochs for one configuration of N, B, σ, E and δ."""

    dataset_size: int
    batch_size: int
    sample_rate: float  # q = B / N
    noise_multiplier: float  # σ of the curves (the solved σ in "solve" mode)
    epochs: float
    delta: float
    steps: int  # T = E round(1/q) (steps_from_epochs)
    mode: str  # "epsilon" or "solve"
    target_epsilon: float | None
    curves: dict  # accountant name -> EpsilonCurve, in registration order (RDP, PLD)
    discretization: float
    shuffle_epochs: np.ndarray  # (k,) whole epochs of the shuffle bracket; (0,) when off
    shuffle_lower: np.ndarray  # (k,) ε(δ) lower bound for shuffled fixed-size batches
    shuffle_upper: np.ndarray  # (k,) no-amplification upper bound (Gaussian, σ/√E)

    def __getattr__(self, attr):
        """``r.epsilon_<name>`` (final ε), ``r.<name>_epochs``, ``r.<name>_epsilon`` (arrays)
        for every accountant in ``curves``: ``r.epsilon_rdp``, ``r.pld_epochs``, ..."""
        curves = self.__dict__.get("curves") or {}
        for name, c in curves.items():
            found = {f"epsilon_{name}": c.final if c.epsilon.size else None,
                     f"{name}_epochs": c.epochs, f"{name}_epsilon": c.epsilon}.get(attr)
            if found is not None:
                return found
        raise AttributeError(f"{type(self).__name__} has no attribute {attr!r} (curves: "
                             f"{sorted(curves)})")

    @property
    def epsilon_shuffle(self):
        """(lower, upper) on ε(δ) at the last shuffle epoch with shuffled batches, or None."""
        if self.shuffle_epochs.size == 0:
            return None
        return float(self.shuffle_lower[-1]), float(self.shuffle_upper[-1])


@lru_cache(maxsize=256)  # slider moves revisit the same settings
def _shuffle_bracket(batches, sigma, epochs, delta):
    """(lower, upper) arrays at the whole epochs ``epochs`` (a tuple), see the docstring;
    σ as every accountant computes with it (``noise_range.accounted_sigma``: a σ below
    SIGMA_FLOOR is 0, ε = inf; it reached the shuffle bound raw, a NaN, until 2026-11-30)."""
    sigma = accounted_sigma(sigma)
    upper = np.array([gaussian_epsilon(sigma, delta, e) for e in epochs])
    if sigma == 0:
        return upper, upper
    lower = shuffle_lower_curve(batches, sigma, epochs, delta, EXPLORE_SHUFFLE_H)
    return np.minimum(lower, upper), upper


def _shuffle_epochs(epochs, points):
    """Up to ``points`` whole epochs spread over [1, floor(E)]; none when E < 1."""
    grid = np.round(np.linspace(epochs / points, epochs, points))
    return tuple(int(e) for e in np.unique(np.clip(grid, 1, np.floor(epochs))) if epochs >= 1)


def _options(h):
    """Options of the explorer's curves; each accountant reads those it names (PLD: all)."""
    return {"discretization": h, "max_refine": EXPLORE_MAX_REFINE,
            "max_grid_points": EXPLORE_GRID_POINTS}


def pld_grid_is_coarse(q, sigma, h) -> bool:
    """True when the explorer's point cap stops the PLD grid above sd(L) / 4 (either
    direction): its curve is then looser than 1% (module doc)."""
    if sigma == 0:
        return False
    return any(grid_step(h, q, sigma, d, EXPLORE_MAX_REFINE, EXPLORE_GRID_POINTS)
               > loss_std(q, sigma, d) / 4 for d in ("remove", "add"))


def _curve(q, sigma, epochs, delta, points, accountant, h):
    """(epochs grid, ε at each) with ``points`` points ending at ``epochs``."""
    grid = np.linspace(epochs / points, epochs, points)
    steps = [steps_from_epochs(e, q) for e in grid]
    return grid, epsilon_curve(q, sigma, steps, delta, accountant, **_options(h))


def _curves(q, sigma, epochs, delta, points, slow_points, h):
    """An EpsilonCurve per registered accountant, capped by those it is never above."""
    curves = {}
    for name, spec in ACCOUNTANTS.items():
        n = slow_points if spec.slow else points
        grid, eps = _curve(q, sigma, epochs, delta, n, name, h)
        for looser in (a for a in spec.never_above if a in ACCOUNTANTS):
            eps = np.minimum(eps, _curve(q, sigma, epochs, delta, n, looser, h)[1])
        legend = spec.explore_label(_options(h)) if spec.explore_label else spec.label
        if name == "pld" and pld_grid_is_coarse(q, sigma, h):
            legend += COARSE_NOTE
        curves[name] = EpsilonCurve(name, spec.label, legend, dict(spec.style), grid, eps)
    return curves


def explore_budget(dataset_size, batch_size, noise_multiplier, epochs, delta, *, mode="epsilon",
                   target_epsilon=None, points=40, pld_points=8,
                   discretization=EXPLORE_DISCRETIZATION, shuffle=True, shuffle_points=4):
    """Compute a :class:`BudgetResult`: ε(δ) against epochs up to E, by every accountant.

    In ``mode="solve"`` the noise multiplier is ignored and calibrated instead, so that the RDP
    ε after E epochs is at most ``target_epsilon``, with σ within 1% of the least that does so.
    ``points`` and ``pld_points`` (integers >= 1) are the numbers of curve points (the latter
    for the slow accountants, PLD);
    ``shuffle_points`` that of the shuffle bracket (``shuffle=False`` leaves it out).

    >>> r = explore_budget(60_000, 256, 1.1, 60, 1e-5, points=4, pld_points=2)
    >>> r.steps, r.rdp_epochs.tolist(), r.pld_epochs.tolist()
    (14040, [15.0, 30.0, 45.0, 60.0], [30.0, 60.0])
    >>> round(r.epsilon_rdp, 2), round(r.epsilon_pld, 2)
    (2.59, 2.38)
    >>> s = explore_budget(60_000, 256, 1.1, 60, 1e-5, mode="solve", target_epsilon=8.0)
    >>> round(s.noise_multiplier, 2), 7.8 <= s.epsilon_rdp <= 8.0
    (0.68, True)
    >>> r.shuffle_epochs.tolist(), [round(e, 1) for e in r.epsilon_shuffle]
    ([15, 30, 45, 60], [10.8, 54.0])
    """
    n = check_count(dataset_size, "dataset_size")
    b = check_count(batch_size, "batch_size", 1, n, high_name="dataset_size")
    q = b / n
    epochs = check_positive(epochs, "epochs")
    delta = check_delta(delta)
    check_choice(mode, "mode", MODES)
    sigma = check_noise_multiplier(noise_multiplier)
    if mode == "solve":
        target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
        sigma = get_noise_multiplier(target_epsilon, delta, q, epochs=epochs)
    h = check_positive(discretization, "discretization")
    points = check_count(points, "points", 1, MAX_POINTS)
    pld_points = check_count(pld_points, "pld_points", 1, MAX_POINTS)
    curves = _curves(q, sigma, epochs, delta, points, pld_points, h)  # two upper bounds of
    # one run (PLD, RDP): the smaller is one too, so a curve is capped by those it is never above
    shuffle_points = check_count(shuffle_points, "shuffle_points", 1, MAX_POINTS)
    shuffle_epochs = _shuffle_epochs(epochs, shuffle_points) if shuffle else ()
    shuffle_lower, shuffle_upper = (
        _shuffle_bracket(batches_per_epoch(q), sigma, shuffle_epochs, check_pld_delta(delta))
        if shuffle_epochs else (np.zeros(0), np.zeros(0)))
    return BudgetResult(
        dataset_size=n, batch_size=b, sample_rate=q, noise_multiplier=sigma, epochs=epochs,
        delta=delta, steps=steps_from_epochs(epochs, q), mode=mode,
        target_epsilon=target_epsilon, curves=curves, discretization=h,
        shuffle_epochs=np.array(shuffle_epochs, dtype=int), shuffle_lower=shuffle_lower,
        shuffle_upper=shuffle_upper,
    )


__all__ = [
    "COARSE_NOTE", "EXPLORE_DISCRETIZATION", "EXPLORE_GRID_POINTS", "EXPLORE_MAX_REFINE",
    "EXPLORE_SHUFFLE_H", "MAX_POINTS", "MODES", "BudgetResult", "EpsilonCurve", "explore_budget",
    "pld_grid_is_coarse",
]
