"""RDPAccountant / PLDAccountant: history, merging, heterogeneous schedules, checkpoints."""

import pytest
import torch

from workbench.accounting import (
    DEFAULT_ORDERS,
    PLDAccountant,
    RDPAccountant,
    compute_rdp,
    epsilon,
    rdp_to_epsilon,
)


@pytest.mark.parametrize("cls", [RDPAccountant, PLDAccountant])
def test_history_merges_consecutive_equal_steps(cls):
    acc = cls()
    assert len(acc) == 0 and acc.get_epsilon(1e-5) == 0.0
    for _ in range(30):
        acc.step(noise_multiplier=1.0, sample_rate=0.01)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=20)
    acc.step(noise_multiplier=0.8, sample_rate=0.01, steps=0)  # no steps: nothing recorded
    assert acc.history == [(1.0, 0.01, 50)] and len(acc) == 50
    assert acc.get_epsilon(1e-5) == pytest.approx(epsilon(0.01, 1.0, 50, 1e-5, cls.name))


def test_heterogeneous_schedule_adds_rdp():
    acc = RDPAccountant()
    schedule = [(1.0, 0.01, 100), (0.7, 0.02, 40), (1.0, 0.01, 60)]
    for sigma, q, t in schedule:
        acc.step(noise_multiplier=sigma, sample_rate=q, steps=t)
    assert acc.history == schedule and len(acc) == 200
    rdp = sum(compute_rdp(q, s, t) for s, q, t in schedule)
    assert acc.get_epsilon_and_order(1e-5) == rdp_to_epsilon(DEFAULT_ORDERS, rdp, 1e-5)
    assert acc.get_epsilon(1e-5) == acc.get_epsilon_and_order(1e-5)[0]


def test_heterogeneous_pld_lies_between_its_parts_and_below_rdp():
    pld, rdp = PLDAccountant(), RDPAccountant()
    for acc in (pld, rdp):
        acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=300)
        acc.step(noise_multiplier=0.7, sample_rate=0.02, steps=100)
    both = pld.get_epsilon(1e-5)
    assert epsilon(0.01, 1.0, 300, 1e-5, "pld") < both < rdp.get_epsilon(1e-5)


@pytest.mark.parametrize("acc", [RDPAccountant(orders=[2, 4.5, 32]),
                                 PLDAccountant(discretization=2e-4)])
def test_state_dict_round_trips_through_a_weights_only_checkpoint(acc, tmp_path):
    acc.step(noise_multiplier=1.1, sample_rate=0.004, steps=500)
    acc.step(noise_multiplier=0.9, sample_rate=0.004, steps=10)
    torch.save({"accountant": acc.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["accountant"]
    fresh = type(acc)()
    fresh.load_state_dict(state)
    assert fresh.history == acc.history and len(fresh) == 510
    assert fresh.state_dict() == acc.state_dict()
    assert fresh.get_epsilon(1e-5) == acc.get_epsilon(1e-5)


def test_load_state_dict_checks_the_mechanism_and_values():
    with pytest.raises(ValueError, match="from a 'rdp' accountant; this one is 'pld'"):
        PLDAccountant().load_state_dict(RDPAccountant().state_dict())
    with pytest.raises(ValueError, match="sample_rate must be in"):
        RDPAccountant().load_state_dict({"name": "rdp", "history": [[1.0, 2.0, 3]],
                                         "orders": [2.0]})


@pytest.mark.parametrize("cls, drop", [(RDPAccountant, "orders"), (RDPAccountant, "history"),
                                       (PLDAccountant, "discretization")])
def test_load_state_dict_names_missing_and_unexpected_keys(cls, drop):
    state = cls().state_dict()
    del state[drop]
    with pytest.raises(KeyError, match=rf"missing keys \['{drop}'\], unexpected keys \[\]"):
        cls().load_state_dict(state)
    with pytest.raises(KeyError, match=r"unexpected keys \['extra'\]"):
        cls().load_state_dict(cls().state_dict() | {"extra": 1})
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        cls().load_state_dict([("history", [])])


def test_get_epsilon_and_order_agrees_with_get_epsilon_before_and_after_steps():
    acc = RDPAccountant()
    assert acc.get_epsilon_and_order(1e-5) == (0.0, None) and acc.get_epsilon(1e-5) == 0.0
    acc.step(noise_multiplier=1.0, sample_rate=0.0, steps=10)  # nothing sampled yet
    assert acc.get_epsilon_and_order(1e-5) == (0.0, None) and acc.get_epsilon(1e-5) == 0.0
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=100)
    eps, order = acc.get_epsilon_and_order(1e-5)
    assert eps == acc.get_epsilon(1e-5) > 0 and order in acc.orders
    with pytest.raises(ValueError, match="delta must be in"):
        RDPAccountant().get_epsilon_and_order(0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=-1.0, sample_rate=0.1), r"noise_multiplier must be .* got -1.0"),
    (dict(noise_multiplier=1.0, sample_rate=1.5), r"sample_rate must be in \[0, 1\].* got 1.5"),
    (dict(noise_multiplier=1.0, sample_rate=0.1, steps=2.5), "steps must be a non-negative"),
])
def test_step_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RDPAccountant().step(**kwargs)


@pytest.mark.crosscheck
def test_rdp_accountant_matches_opacus_on_a_schedule():
    opacus = pytest.importorskip("opacus.accountants",
                                 reason="Opacus not installed (pip install opacus)")
    theirs = opacus.RDPAccountant()
    ours = RDPAccountant(orders=opacus.RDPAccountant.DEFAULT_ALPHAS)
    for sigma, q, t in [(1.0, 0.01, 100), (0.7, 0.02, 40), (1.0, 0.01, 60)]:
        for _ in range(t):
            theirs.step(noise_multiplier=sigma, sample_rate=q)
        ours.step(noise_multiplier=sigma, sample_rate=q, steps=t)
    assert ours.get_epsilon(1e-5) == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-6)
