"""The budget explorer's fast PLD curve against dp-accounting, batch sizes of one record
included (issue 24, family 5): within 1% wherever its legend does not say "coarse", and a
labelled, still valid upper bound where the grid's point cap makes it coarse."""

import pytest

from workbench.accounting import epsilon
from workbench.accounting.explore import COARSE_NOTE, explore_budget
from workbench.accounting.pld import loss_std

N, DELTA = 60_000, 1e-5


@pytest.mark.crosscheck
@pytest.mark.parametrize("batch_size, sigma", [(1, 4.0), (1, 8.0), (1, 2.0), (4, 4.0),
                                               (16, 2.0)])
def test_explorer_pld_is_within_one_percent_of_dp_accounting(batch_size, sigma):
    dpa = pytest.importorskip("dp_accounting",
                              reason="dp-accounting not installed (pip install dp-accounting)")
    r = explore_budget(N, batch_size, sigma, 1, DELTA, points=2, pld_points=1, shuffle=False)
    assert COARSE_NOTE not in r.curves["pld"].legend
    q = batch_size / N
    h = min(1e-4, loss_std(q, sigma, "remove") / 20)  # their grid fine enough for this q
    accountant = dpa.pld.PLDAccountant(value_discretization_interval=h)
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
    accountant.compose(dpa.SelfComposedDpEvent(event, r.steps))
    assert r.epsilon_pld == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-2)


@pytest.mark.parametrize("batch_size, sigma", [(1, 0.6), (2, 0.6), (1, 0.8)])
def test_a_coarse_explorer_pld_says_so_and_stays_an_upper_bound(batch_size, sigma):
    r = explore_budget(N, batch_size, sigma, 1, DELTA, points=2, pld_points=1, shuffle=False)
    assert r.curves["pld"].legend.endswith(COARSE_NOTE)
    fine = epsilon(batch_size / N, sigma, r.steps, DELTA, "pld")
    assert fine * (1 - 1e-9) <= r.epsilon_pld <= r.epsilon_rdp
