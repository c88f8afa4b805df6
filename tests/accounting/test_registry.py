"""A new accountant is one registration: every consumer finds it by name, and it leaves no trace.

The toy accountant is the Gaussian mechanism *without* amplification by sampling: T_g steps of
noise σ_g compose to one Gaussian mechanism with σ_eff = (Σ_g T_g / σ_g²)^(-1/2) (Dong, Roth,
Su 2019, arXiv:1905.02383, Cor. 3.3), whose ε(δ) is exact (``gaussian_epsilon``, Balle & Wang
2018). It ignores q, so it is an upper bound at every q and the exact ε at q = 1.
"""

import math

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench import accounting
from workbench.accounting import (
    ACCOUNTANTS,
    explore_budget,
    gaussian_epsilon,
    make_accountant,
    register_accountant,
    unregister_accountant,
)
from workbench.audit.report_kinds import accountant_epsilons
from workbench.audit.report_suites import check_accountants
from workbench.viz.audit_privacy import plot_epsilon_curves
from workbench.viz.budget import plot_budget

matplotlib.use("Agg")


def no_amplification_epsilon(history, delta):
    sigma_eff = sum(t / s**2 for s, _, t in history) ** -0.5
    return gaussian_epsilon(sigma_eff, delta)


@pytest.fixture
def gauss():
    """The toy accountant, registered for one test and removed after it (pass or fail)."""
    spec = register_accountant("gauss", label="Gaussian", epsilon=no_amplification_epsilon)
    yield spec
    unregister_accountant("gauss")


def test_builtins_are_registered_in_listing_order():
    assert list(ACCOUNTANTS) == ["rdp", "pld", "prv"]
    assert ACCOUNTANTS["pld"].never_above == ("rdp",) and ACCOUNTANTS["pld"].slow


def test_epsilon_functions_find_it(gauss):
    assert list(ACCOUNTANTS) == ["rdp", "gauss", "pld", "prv"]  # fast ones first
    exact = gaussian_epsilon(1.0 / math.sqrt(100), 1e-5)
    assert accounting.epsilon(0.01, 1.0, 100, 1e-5, accountant="gauss") == exact
    history = [(1.0, 0.01, 100), (2.0, 0.5, 40)]  # σ_eff² = 1 / (100 + 10)
    assert accounting.history_epsilon(history, 1e-5, "gauss") == pytest.approx(
        gaussian_epsilon(110**-0.5, 1e-5), rel=1e-12)
    # without a curve function it is called per point; 0 steps and σ = 0 answered before it
    curve = accounting.epsilon_curve(0.01, 1.0, [0, 10, 100], 1e-5, accountant="gauss")
    assert curve[0] == 0 and curve[2] == exact
    assert curve[1] == gaussian_epsilon(1 / math.sqrt(10), 1e-5)
    assert accounting.epsilon(0.01, 0.0, 5, 1e-5, accountant="gauss") == math.inf
    # options reach only the accountants that name them
    assert accounting.epsilon(0.01, 1.0, 100, 1e-5, "gauss", discretization=1e-3) == exact
    # at q = 1 the toy is exact: RDP's bound is above it, PLD's pessimistic grid at or above it
    q1 = {a: accounting.epsilon(1.0, 5.0, 20, 1e-5, accountant=a) for a in ACCOUNTANTS}
    assert q1["gauss"] <= q1["pld"] * (1 + 1e-9) <= q1["rdp"]
    assert q1["pld"] == pytest.approx(q1["gauss"], rel=1e-2)


def test_calibration_finds_it(gauss):
    sigma = accounting.get_noise_multiplier(2.0, 1e-5, 0.01, steps=100, accountant="gauss")
    assert accounting.epsilon(0.01, sigma, 100, 1e-5, "gauss") <= 2.0 < accounting.epsilon(
        0.01, sigma / 1.01, 100, 1e-5, "gauss")


def test_engine_trains_with_it(gauss):
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    model = nn.Linear(5, 3)
    engine = wb.PrivacyEngine(accountant="gauss")
    assert type(engine.accountant).__name__ == "GaussianAccountant"
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=1.5,
        max_grad_norm=1.0, sampling_generator=torch.Generator().manual_seed(0))
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    steps = len(engine.accountant)
    assert steps == len(loader) == 4
    assert engine.accountant.state_dict() == {"name": "gauss",
                                              "history": [[1.5, 0.25, 4]]}
    assert engine.get_epsilon(1e-5) == gaussian_epsilon(1.5 / 2, 1e-5)  # σ / sqrt(T)
    restored = make_accountant("gauss")
    restored.load_state_dict(engine.accountant.state_dict())
    assert restored.get_epsilon(1e-5) == engine.get_epsilon(1e-5)


def test_budget_explorer_draws_it(gauss):
    r = explore_budget(60_000, 256, 1.1, 10, 1e-5, points=5, pld_points=2, shuffle=False)
    assert list(r.curves) == ["rdp", "gauss", "pld", "prv"]
    assert r.gauss_epochs.shape == (5,) and r.pld_epochs.shape == (2,)
    assert r.epsilon_gauss == gaussian_epsilon(1.1 / math.sqrt(r.steps), 1e-5)
    assert r.epsilon_gauss > r.epsilon_rdp > r.epsilon_pld  # no amplification: far larger
    ax = Figure().add_subplot()
    artists = plot_budget(ax, r)
    line = artists["gauss"]
    assert line.get_label() == "Gaussian" and line.get_color() == "C3"  # C2 is the shuffle band
    assert list(line.get_ydata()) == list(r.curves["gauss"].epsilon)
    assert "(Gaussian)" in ax.get_title()


def test_audit_report_lists_and_checks_it(gauss):
    check = check_accountants([(0.01, 1.0, 100)], curve_points=3)
    assert list(check.labels.values()) == ["RDP", "Gaussian", "PLD", "PRV"]
    assert check.passed and check.pairs == (("pld", "rdp"),)  # the toy claims no order
    assert check.table["eps_gauss"].iloc[0] == gaussian_epsilon(0.1, 1e-5)
    assert accountant_epsilons(check).endswith("(Gaussian)")  # the largest ε, last
    assert len(plot_epsilon_curves(Figure().add_subplot(), check)) == 4


def test_a_wrong_order_claim_is_caught():
    """Registered as never above PLD, the toy (no amplification) fails the report's check."""
    register_accountant("gauss", label="Gaussian", epsilon=no_amplification_epsilon,
                        never_above=("pld",))
    try:
        check = check_accountants([(0.01, 1.0, 100)], curve_points=3)
    finally:
        unregister_accountant("gauss")
    assert not check.passed and check.summary == "Gaussian exceeds PLD"


def test_unregistered_is_gone_everywhere():
    register_accountant("gauss", label="Gaussian", epsilon=no_amplification_epsilon)
    unregister_accountant("gauss")
    assert list(ACCOUNTANTS) == ["rdp", "pld", "prv"]
    with pytest.raises(ValueError, match=r"accountant must be one of \['pld', 'prv', 'rdp'\]"):
        accounting.epsilon(0.01, 1.0, 10, 1e-5, accountant="gauss")
    with pytest.raises(ValueError, match="accountant must be one of"):
        wb.PrivacyEngine(accountant="gauss")
    r = explore_budget(60_000, 256, 1.1, 10, 1e-5, points=2, pld_points=1, shuffle=False)
    assert list(r.curves) == ["rdp", "pld", "prv"]
    with pytest.raises(AttributeError, match="no attribute 'epsilon_gauss'"):
        r.epsilon_gauss  # noqa: B018


def test_registration_errors(gauss):
    with pytest.raises(ValueError, match="'gauss' is already registered"):
        register_accountant("gauss", label="G", epsilon=no_amplification_epsilon)
    with pytest.raises(ValueError, match="lower-case identifier"):
        register_accountant("My GDP", label="G", epsilon=no_amplification_epsilon)
    with pytest.raises(TypeError, match="epsilon must be callable"):
        register_accountant("gdp", label="G", epsilon=1.0)
    with pytest.raises(ValueError, match="name must be 'gdp'"):
        register_accountant("gdp", label="G", epsilon=no_amplification_epsilon,
                            accountant_class=accounting.RDPAccountant)
    assert "gdp" not in ACCOUNTANTS
    with pytest.raises(TypeError, match=r"option\(s\) \['discretisation'\] that no registered"):
        accounting.epsilon(0.01, 1.0, 10, 1e-5, "pld", discretisation=1e-3)  # misspelt
    assert np.isfinite(accounting.epsilon(0.01, 1.0, 10, 1e-5, "rdp", discretization=1e-3))
