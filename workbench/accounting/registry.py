"""One table naming the accountants and the batch samplers.

An accountant is a class with ``step(noise_multiplier=, sample_rate=)``, ``get_epsilon(delta)``
and ``state_dict()`` (``accountant.py``); a sampler is a function (q, σ, E, δ) ->
``EpsilonBounds`` (``bounds.py``). Adding either is one file plus one line here; the training
engine, the budget explorer and ``epsilon_bounds`` read these tables instead of spelling the
names out.

>>> sorted(ACCOUNTANTS), sorted(SAMPLERS)
(['pld', 'rdp'], ['deterministic', 'poisson', 'shuffle'])
>>> b = epsilon_bounds("deterministic", sample_rate=0.01, noise_multiplier=1.0, epochs=4,
...                    delta=1e-5)
>>> round(b.lower, 3) == round(b.upper, 3), b.steps
(True, 400)
"""

import math

from workbench.accounting import curve
from workbench.accounting.accountant import PLDAccountant, RDPAccountant
from workbench.accounting.bounds import deterministic_bounds, poisson_bounds, shuffle_bounds
from workbench.accounting.curve import check_pld_delta
from workbench.checks import (
    check_choice,
    check_count,
    check_delta,
    check_noise_multiplier,
    check_positive,
    check_sample_rate,
)

ACCOUNTANTS = {"rdp": RDPAccountant, "pld": PLDAccountant}
SAMPLERS = {"poisson": poisson_bounds, "deterministic": deterministic_bounds,
            "shuffle": shuffle_bounds}
assert set(ACCOUNTANTS) == set(curve.ACCOUNTANTS), "curve.py and the registry disagree"


def make_accountant(name, **options):
    """A fresh accountant by name: ``make_accountant("pld", discretization=1e-4)``."""
    return ACCOUNTANTS[check_choice(name, "accountant", ACCOUNTANTS)](**options)


def epsilon_bounds(sampler, *, sample_rate, noise_multiplier, epochs, delta):
    """[lower, upper] on ε(δ) of DP-SGD whose batches come from ``sampler``.

    ``sampler`` in {"poisson", "shuffle", "deterministic"}; q = B/N, σ, E epochs (an integer
    for "shuffle" and "deterministic": each epoch is one pass), δ >= 1e-10 (the PLD floor).
    """
    check_choice(sampler, "sampler", SAMPLERS)
    q = check_sample_rate(sample_rate, positive=True, note="q = B / N: an epoch is 1 / q steps")
    sigma = check_noise_multiplier(noise_multiplier)
    epochs = check_positive(epochs, "epochs")
    if sampler != "poisson":
        epochs = float(check_count(epochs, "epochs", note=f"with sampler={sampler!r} each "
                                   f"epoch is one pass over the data"))
    delta = check_pld_delta(check_delta(delta))
    if sigma == 0:
        bounds = SAMPLERS[sampler](q, 1.0, int(epochs), delta)  # steps; ε is inf for all
        return type(bounds)(sampler, math.inf, math.inf, "no noise", "no noise", delta,
                            bounds.steps)
    return SAMPLERS[sampler](q, sigma, int(epochs) if sampler != "poisson" else epochs, delta)
