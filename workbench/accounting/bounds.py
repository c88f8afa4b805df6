"""ε of a DP-SGD run as a bracket [lower, upper] that knows how the batches were drawn.

The accountants (``curve.py``, ``registry.py``) assume Poisson sampling. Implementations often
shuffle the data into fixed-size batches instead, or walk through it in a fixed order, and
account as if Poisson: Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha, Zhang (2024), "How Private
are DP-SGD Implementations?", ICML, arXiv:2403.17673, show that this can understate ε badly,
most for small σ and many steps per epoch. ``epsilon_bounds`` says what each sampler can claim:

    "poisson"        lower: optimistic PLD (``lower.py``); upper: pessimistic PLD (``pld.py``),
                     the two discretisations of Doroshenko et al. (2022, arXiv:2207.04380).
    "deterministic"  every example in exactly one batch per epoch, no amplification: E epochs
                     are a Gaussian mechanism with noise σ/√E, exact (Balle & Wang 2018,
                     arXiv:1805.06530, Thm. 8), so lower = upper.
    "shuffle"        lower: Chua et al.'s bound (``shuffle.py``); upper: the deterministic ε
                     (shuffling is never worse than a fixed order, and no better bound is known).
                     For small σ and many batches per epoch the lower bound is far above the
                     Poisson ε: T = 1000, σ = 0.8, one epoch, δ = 1e-6 gives Poisson 0.47 but
                     shuffle in [6.04, 6.31] (``shuffle.py``, tests/accounting/test_shuffle.py).

Notation: q = B/N sample rate, T batches per epoch (``batches_per_epoch``: a fixed-size
loader's own len(loader), ceil(N/B) or floor(N/B) with ``drop_last``; by default round(1/q),
the Poisson loader's length), E epochs, σ, δ.

>>> sorted(SAMPLERS)
['deterministic', 'poisson', 'shuffle']
>>> b = epsilon_bounds("deterministic", sample_rate=0.01, noise_multiplier=1.0, epochs=4,
...                    delta=1e-5)
>>> round(b.lower, 3) == round(b.upper, 3), b.steps
(True, 400)
"""

import math
from dataclasses import dataclass, replace

from workbench.accounting.calibrate import steps_from_epochs, steps_per_epoch
from workbench.accounting.curve import epsilon
from workbench.accounting.gaussian import gaussian_epsilon
from workbench.accounting.lower import poisson_lower_epsilon
from workbench.accounting.noise_range import accounted_sigma
from workbench.accounting.pld import check_pld_delta
from workbench.accounting.shuffle import shuffle_lower_epsilon
from workbench.checks import (
    check_choice,
    check_count,
    check_delta,
    check_noise_multiplier,
    check_positive,
    check_sample_rate,
)


@dataclass(frozen=True)
class EpsilonBounds:
    """ε(δ) bracket: the true ε of the run lies in [lower, upper]."""

    sampler: str
    lower: float
    upper: float
    lower_method: str
    upper_method: str
    delta: float
    steps: int  # optimiser steps of the run

    def __str__(self):
        return (f"{self.sampler}: {self.lower:.4g} <= epsilon <= {self.upper:.4g} at "
                f"delta={self.delta:g} ({self.steps} steps; lower: {self.lower_method}; "
                f"upper: {self.upper_method})")


def batches_per_epoch(q, given=None):
    """T: the loader's own batches per epoch when ``given``, else round(1/q), the workbench's
    one epoch (steps_per_epoch)."""
    return _batches(q, given)


def _batches(q, given):
    if given is None:
        return steps_per_epoch(q)
    return int(check_count(given, "batches_per_epoch", note="len(loader): the steps of one "
                           "pass over the data"))


def poisson_bounds(q, sigma, epochs, delta, T):
    steps = steps_from_epochs(epochs, q, T)
    upper = epsilon(q, sigma, steps, delta, "pld")
    lower = min(poisson_lower_epsilon(q, sigma, steps, delta), upper)
    return EpsilonBounds("poisson", lower, upper, "PLD, optimistic grid",
                         "PLD, pessimistic grid", delta, steps)


def deterministic_bounds(q, sigma, epochs, delta, T):
    eps = gaussian_epsilon(sigma, delta, steps=epochs)  # Gaussian mechanism, σ/√E
    return EpsilonBounds("deterministic", eps, eps, "Gaussian mechanism, exact",
                         "Gaussian mechanism, exact", delta, epochs * T)


def shuffle_bounds(q, sigma, epochs, delta, T):
    upper = gaussian_epsilon(sigma, delta, steps=epochs)
    lower = min(shuffle_lower_epsilon(T, sigma, epochs, delta), upper)
    return EpsilonBounds("shuffle", lower, upper, "Chua et al. 2024, max of batch sums",
                         "no amplification (Gaussian mechanism)", delta, epochs * T)


SAMPLERS = {"poisson": poisson_bounds, "deterministic": deterministic_bounds,
            "shuffle": shuffle_bounds}
"""sampler name -> (q, σ, E, δ, T) -> EpsilonBounds; a new sampler is a function and a line here."""


def epsilon_bounds(sampler, *, sample_rate, noise_multiplier, epochs, delta,
                   batches_per_epoch=None):
    """[lower, upper] on ε(δ) of DP-SGD whose batches come from ``sampler``.

    ``sampler`` in {"poisson", "shuffle", "deterministic"}; q = B/N, σ, E epochs (an integer
    for "shuffle" and "deterministic": each epoch is one pass), δ >= 1e-10 (the PLD floor).
    ``batches_per_epoch``: T, the steps one pass of the loader runs (len(loader): ceil(N / B)
    for a shuffled loader, which round(1/q), the default, undercounts when B does not divide N).
    """
    check_choice(sampler, "sampler", SAMPLERS)
    q = check_sample_rate(sample_rate, positive=True, note="q = B / N: an epoch is 1 / q steps")
    sigma = check_noise_multiplier(noise_multiplier)
    epochs = check_positive(epochs, "epochs")
    if sampler != "poisson":
        epochs = float(check_count(epochs, "epochs", note=f"with sampler={sampler!r} each "
                                   f"epoch is one pass over the data"))
    delta = check_delta(delta)
    if sampler == "poisson":  # (the fixed-size brackets are closed forms and quadrature:
        # refused below the PLD's floor too, pointing to an option this function lacks,
        # until 2026-11-30)
        try:
            check_pld_delta(delta, "Poisson bracket's PLD")
        except ValueError as err:
            raise ValueError(f"{str(err).split('; use')[0]}; for an upper bound at this "
                             f"delta use accounting.epsilon(..., accountant='rdp') (valid at "
                             f"any delta)") from None
    T = _batches(q, batches_per_epoch)
    epochs = int(epochs) if sampler != "poisson" else epochs
    computed = accounted_sigma(sigma)  # noise_range.py: pessimistic outside its range
    if computed == 0:
        bounds = SAMPLERS[sampler](q, 1.0, epochs, delta, T)  # steps; ε is inf for all
        return replace(bounds, lower=math.inf, upper=math.inf, lower_method="no noise",
                       upper_method="no noise")
    bounds = SAMPLERS[sampler](q, computed, epochs, delta, T)
    if computed < sigma:  # an upper bound at less noise holds at σ; a lower bound does not
        bounds = replace(bounds, lower=0.0, lower_method=f"trivial (noise_multiplier beyond "
                         f"{computed:g}: the upper bound is computed there)")
    return bounds


__all__ = [
    "SAMPLERS", "EpsilonBounds", "batches_per_epoch", "deterministic_bounds", "epsilon_bounds",
    "poisson_bounds", "shuffle_bounds",
]
