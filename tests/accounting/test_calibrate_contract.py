"""The calibration contract at huge targets: every accountant returns σ with
(1 - τ) ε* <= ε(σ) <= ε* or raises ``CalibrationError`` naming itself and the target.

Until 2026-12-02 a PRV or PLD refusal of small σ (a loss too wide for the grid) while ε was
still below the band returned the last σ computed: PRV gave σ = 0.148 with ε = 151.5 for a
target of 999 (q = 0.01, T = 100, δ = 1e-5), PLD σ = 0.0805 with ε = 556.7, plausible numbers
with far more noise than the target needs. The grid limits are lowered here so the same
refusals come at cheap grids (the real ones take a minute a case on two cores)."""

import itertools

import pytest

import workbench.accounting.accountants.prv as prv_module
import workbench.accounting.compose as compose_module
import workbench.accounting.pld as pld_module
from workbench.accounting import (
    calibrate,
    epsilon,
    get_noise_multiplier,
    register_accountant,
    unregister_accountant,
)
from workbench.errors import CalibrationError, WorkbenchError


@pytest.fixture
def small_grids(monkeypatch):
    """PRV and PLD refuse grids past 2^15 points (one step) and 2^17 (composed)."""
    monkeypatch.setattr(prv_module, "MAX_GRID_POINTS", 2**15)
    monkeypatch.setattr(pld_module, "MAX_GRID_POINTS", 2**15)
    monkeypatch.setattr(compose_module, "MAX_POINTS", 2**17)


def test_every_accountant_meets_huge_targets_or_names_itself(small_grids):
    answered = refused = 0
    for accountant, q, steps, target in itertools.product(
            ("rdp", "pld", "prv"), (0.01, 1.0), (1, 100), (50.0, 999.0)):
        case = (accountant, q, steps, target)
        try:
            c = calibrate(target, 1e-5, q, steps=steps, accountant=accountant)
        except CalibrationError as err:
            assert isinstance(err, (WorkbenchError, ValueError))
            assert f"target_epsilon={target!r}" in str(err), (case, err)
            assert f"accountant={accountant!r}" in str(err), (case, err)
            refused += 1
            continue
        assert (1 - 1e-3) * target <= c.epsilon <= target, (case, c)
        assert c.epsilon == epsilon(q, c.noise_multiplier, steps, 1e-5, accountant), case
        answered += 1
    assert answered >= 8 and refused >= 4  # RDP answers all eight; PRV refuses here


def test_prv_below_the_band_at_its_least_noise_is_refused_with_what_it_reaches(small_grids):
    """q = 0.01, T = 1: PRV computes ε down to ~0.13 only; the error says how far it gets and
    a target it reaches, and that target then calibrates inside the band."""
    with pytest.raises(CalibrationError, match=r"accountant='prv' cannot return the noise") \
            as err:
        calibrate(999.0, 1e-5, 0.01, steps=1, accountant="prv")
    message = str(err.value)
    assert "refused" in message and "accountant='rdp'" in message and "eps_error" in message
    reach = float(message.rsplit("no larger than ", 1)[1].split(",")[0])
    assert reach < 999.0
    c = calibrate(reach, 1e-5, 0.01, steps=1, accountant="prv")
    assert (1 - 1e-3) * reach <= c.epsilon <= reach


# A toy accountant: ε = 1/σ² for any q and T (one group), refusing σ below a floor, as PRV's
# and PLD's grids do.
FLOOR = {"sigma": 0.0}


def _toy_epsilon(history, delta):
    (sigma, _, _), = history
    if sigma < FLOOR["sigma"]:
        raise ValueError(f"toy: noise_multiplier={sigma:g} is below its floor "
                         f"{FLOOR['sigma']:g}")
    return 1 / sigma**2


@pytest.fixture
def toy():
    register_accountant("toy", label="toy", epsilon=_toy_epsilon)
    yield FLOOR
    unregister_accountant("toy")
    FLOOR["sigma"] = 0.0


def test_a_band_just_above_the_floor_is_found(toy):
    """Target 100 needs σ = 0.1, just above the floor 0.0995: the search's factor steps jump
    past the floor; the gap between the refused σ and the last computed one is bisected
    (the last computed σ, ε ~ 69, was returned)."""
    toy["sigma"] = 0.0995
    c = calibrate(100.0, 1e-5, 0.5, steps=1, accountant="toy")
    assert (1 - 1e-3) * 100 <= c.epsilon <= 100, c
    assert get_noise_multiplier(100.0, 1e-5, 0.5, steps=1, accountant="toy", rtol=1e-3) \
        == pytest.approx(0.1, rel=2e-3)


@pytest.mark.parametrize("rtol", [None, 1e-2])
def test_a_target_beyond_the_floor_is_a_named_error(toy, rtol):
    toy["sigma"] = 0.11  # ε <= 1 / 0.11² = 82.6 wherever it computes
    with pytest.raises(CalibrationError, match=r"target_epsilon=100.0 with accountant='toy' "
                                               r"cannot return.*no larger than 82\.[56]"):
        calibrate(100.0, 1e-5, 0.5, steps=1, accountant="toy", rtol=rtol)
    c = calibrate(82.0, 1e-5, 0.5, steps=1, accountant="toy")
    assert (1 - 1e-3) * 82 <= c.epsilon <= 82
