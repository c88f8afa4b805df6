"""Privacy accounting for DP-SGD: how much ε a run of the sampled Gaussian mechanism spends.

One concept per file:

    rdp.py         Rényi DP of the sampled Gaussian mechanism (Mironov, Talwar, Zhang 2019)
    convert.py     RDP -> (ε, δ) (Balle et al. 2020, Thm. 21)
    pld.py         its privacy-loss distribution, discretised pessimistically (connect-the-dots)
    compose.py     composition of PLDs by FFT (Koskela, Jälkö, Honkela 2020)
    registry.py    the table of accountants: register_accountant
    accountants/   one file per accountant, each registering itself: rdp.py, pld.py
    curve.py       ε of a run, a curve over steps, or a heterogeneous schedule, by name
    calibrate.py   the noise multiplier σ for a target ε
    accountant.py  Accountant: a history of steps, ε on demand; make_accountant by name
    gaussian.py    the exact Gaussian mechanism (q = 1), the yardstick (Balle & Wang 2018)
    noise_range.py the σ the accountants compute with: pessimistic beyond float64's reach
    explore.py     the budget explorer's compute step (ε vs epochs, σ for a target)
    checks.py      argument validation
    lower.py       lower bounds on ε: binned output laws, losses rounded down
    shuffle.py     shuffled fixed-size batches: Chua et al. (2024)'s lower bound
    bounds.py      [lower, upper] on ε for a sampler: Poisson, shuffle, deterministic

>>> from workbench import accounting
>>> round(accounting.epsilon(0.01, 1.0, 1000, 1e-5), 3)
2.101
"""

from workbench.accounting import accountants  # noqa: F401  (registers RDP and PLD)
from workbench.accounting.accountant import Accountant, make_accountant
from workbench.accounting.accountants.pld import PLD_DISCRETIZATION, PLDAccountant
from workbench.accounting.accountants.rdp import RDPAccountant
from workbench.accounting.bounds import SAMPLERS, EpsilonBounds, epsilon_bounds
from workbench.accounting.calibrate import (
    Calibration,
    calibrate,
    get_noise_multiplier,
    steps_from_epochs,
    steps_per_epoch,
)
from workbench.accounting.convert import rdp_to_epsilon
from workbench.accounting.curve import epsilon, epsilon_curve, history_epsilon
from workbench.accounting.explore import BudgetResult, EpsilonCurve, explore_budget
from workbench.accounting.gaussian import gaussian_delta, gaussian_epsilon
from workbench.accounting.rdp import DEFAULT_ORDERS, compute_rdp
from workbench.accounting.registry import (
    ACCOUNTANTS,
    AccountantSpec,
    register_accountant,
    unregister_accountant,
)
from workbench.accounting.snr import SNRResult, explore_snr

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "AccountantSpec",
    "DEFAULT_ORDERS",
    "PLD_DISCRETIZATION",
    "BudgetResult",
    "EpsilonBounds",
    "EpsilonCurve",
    "SAMPLERS",
    "PLDAccountant",
    "RDPAccountant",
    "SNRResult",
    "Calibration",
    "calibrate",
    "compute_rdp",
    "epsilon",
    "epsilon_bounds",
    "epsilon_curve",
    "explore_budget",
    "explore_snr",
    "gaussian_delta",
    "gaussian_epsilon",
    "get_noise_multiplier",
    "history_epsilon",
    "make_accountant",
    "rdp_to_epsilon",
    "register_accountant",
    "steps_from_epochs",
    "steps_per_epoch",
    "unregister_accountant",
]
