"""ε over the phases as they ran (``dpsgd/phases.py``): one engine with several make_private
calls, or a run resumed from a checkpoint, reports ε (or its bracket) for the sampler and the
unit that produced each step. Until 2026-11-30 the engine remembered only its latest phase:
50 shuffled steps then 1 Poisson step were bracketed as 51 Poisson steps ([8.13, 8.13]
against the shuffled steps' own lower bound 14.73), a record-level history went on per user,
and the bracket applied the latest q to every step (1.52 for a true 6.76)."""

import io
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.accounting import epsilon_bounds, history_epsilon
from workbench.dpsgd.checkpoint import load_checkpoint, save_checkpoint
from workbench.dpsgd.checkpoint_file import read_checkpoint, write_checkpoint_file
from workbench.dpsgd.misuse import PrivacyAccountingWarning
from workbench.dpsgd.phases import Phase, phase_histories

N, DELTA = 200, 1e-5


def data():
    torch.manual_seed(0)
    return TensorDataset(torch.randn(N, 3), torch.randint(0, 2, (N,)))


def phase(engine, model, batch, steps, poisson=True, sigma=0.8, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(data(), batch_size=batch,
                                                            shuffle=not poisson),
        noise_multiplier=sigma, max_grad_norm=1.0, poisson_sampling=poisson,
        noise_generator=torch.Generator().manual_seed(1),
        sampling_generator=torch.Generator().manual_seed(2), **kw)
    done = 0
    while done < steps:
        for x, y in loader:
            if done == steps:
                break
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            done += 1
    return m, o, loader


def shuffled_then_poisson():
    engine, model = wb.PrivacyEngine(), nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyAccountingWarning)
        m, o, _ = phase(engine, model, 20, 30, poisson=False)  # 3 shuffled epochs of 10
    return engine, model, m, o


def test_a_shuffled_phase_is_bracketed_as_shuffled_after_a_poisson_phase():
    engine, model, _, _ = shuffled_then_poisson()
    phase(engine, model, 20, 1)  # the same (σ, q): merged in the accountant's history
    assert engine.accountant.history == [(0.8, 0.1, 31)]
    alone = epsilon_bounds("shuffle", sample_rate=0.1, noise_multiplier=0.8, epochs=3,
                           delta=DELTA)
    bounds = engine.epsilon_bounds(DELTA)
    assert bounds.sampler == "poisson+shuffle" and bounds.steps == 31
    with pytest.warns(PrivacyAccountingWarning):
        assert bounds.lower >= alone.lower > engine.get_epsilon(DELTA)
    assert bounds.upper >= alone.upper
    with pytest.warns(PrivacyAccountingWarning, match="30 of this run's 31 steps used "
                                                      "poisson_sampling=False"):
        engine.get_epsilon(DELTA)


def test_a_resume_with_another_sampler_keeps_the_saved_phase(tmp_path):
    engine, _, model, opt = shuffled_then_poisson()
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, engine=engine)
    engine2, model2 = wb.PrivacyEngine(), nn.Linear(3, 2)
    m2, o2, loader = phase(engine2, model2, 20, 0)  # Poisson now
    load_checkpoint(tmp_path / "c.pt", model=m2, optimizer=o2, engine=engine2)
    assert [(p.start, p.sampler) for p in engine2.phases] == [(0, "shuffle"), (30, "poisson")]
    x, y = next(iter(loader))
    o2.zero_grad()
    nn.functional.cross_entropy(m2(x), y).backward()
    o2.step()
    alone = epsilon_bounds("shuffle", sample_rate=0.1, noise_multiplier=0.8, epochs=3,
                           delta=DELTA)
    assert engine2.epsilon_bounds(DELTA).lower >= alone.lower
    with pytest.warns(PrivacyAccountingWarning, match="poisson_sampling=False"):
        engine2.get_epsilon(DELTA)


def test_a_checkpoint_without_phases_is_not_taken_as_poisson(tmp_path):
    engine, model = wb.PrivacyEngine(), nn.Linear(3, 2)
    m, o, _ = phase(engine, model, 20, 5)
    save_checkpoint(tmp_path / "c.pt", model=m, optimizer=o, engine=engine)
    state = read_checkpoint(tmp_path / "c.pt")
    del state["phases"]  # as written before phases were saved
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_checkpoint_file(tmp_path / "old.pt", buffer.getvalue())
    engine2, model2 = wb.PrivacyEngine(), nn.Linear(3, 2)
    m2, o2, _ = phase(engine2, model2, 20, 0)
    with pytest.warns(PrivacyAccountingWarning, match="its 5 steps are accounted as Poisson"):
        load_checkpoint(tmp_path / "old.pt", model=m2, optimizer=o2, engine=engine2)
    with pytest.warns(PrivacyAccountingWarning, match="5 of the run's 5 steps"):
        engine2.get_epsilon(DELTA)
    with pytest.raises(ValueError, match="first 5 steps.*epsilon_bounds\\(sampler"):
        engine2.epsilon_bounds(DELTA)


@pytest.mark.parametrize("first,second", [("record", "user"), ("user", "record")])
def test_the_privacy_unit_cannot_change_within_a_run(first, second):
    users = {"privacy_unit": "user", "user_ids": torch.arange(N) // 4}
    engine, model = wb.PrivacyEngine(), nn.Linear(3, 2)
    phase(engine, model, 20, 2, **(users if first == "user" else {}))
    with pytest.raises(ValueError, match=f"privacy_unit='{second}'.*earlier steps were taken "
                                         f"with privacy_unit='{first}'"):
        phase(engine, model, 20, 1, **(users if second == "user" else {}))
    assert len(engine.accountant) == 2
    fresh = wb.PrivacyEngine()  # a new engine for the new unit
    phase(fresh, nn.Linear(3, 2), 20, 1, **(users if second == "user" else {}))


def test_a_unit_may_change_before_any_step():
    engine, model = wb.PrivacyEngine(), nn.Linear(3, 2)
    phase(engine, model, 20, 0)
    phase(engine, model, 20, 1, privacy_unit="user", user_ids=torch.arange(N) // 4)
    assert [p.unit["unit"] for p in engine.phases] == ["user"]


def test_the_bracket_uses_each_group_s_own_sample_rate_and_sigma():
    engine, model = wb.PrivacyEngine(), nn.Linear(3, 2)
    phase(engine, model, 100, 2)  # q = 0.5
    phase(engine, model, 2, 50, sigma=1.0)  # q = 0.01
    history = engine.accountant.history
    assert history == [(0.8, 0.5, 2), (1.0, 0.01, 50)]
    bounds = engine.epsilon_bounds(DELTA)
    pld = history_epsilon(history, DELTA, "pld")
    assert bounds.lower <= pld <= bounds.upper == pytest.approx(pld, rel=1e-12)
    assert bounds.lower > 0.99 * pld


def test_the_history_splits_at_the_phases_starts():
    phases = [Phase(0, "shuffle", {"unit": "record"}, 10), Phase(30, "poisson",
                                                                 {"unit": "record"})]
    split = phase_histories(phases, [(1.0, 0.1, 20), (0.8, 0.1, 11)])
    assert [(p.sampler, g) for p, g in split] == [
        ("shuffle", [(1.0, 0.1, 20), (0.8, 0.1, 10)]), ("poisson", [(0.8, 0.1, 1)])]


def test_make_private_with_epsilon_plans_the_whole_run():
    engine, model = wb.PrivacyEngine(), nn.Linear(3, 2)
    phase(engine, model, 20, 10, sigma=1.0)
    loader = DataLoader(data(), batch_size=20)
    m, o, private = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, target_epsilon=8.0, target_delta=DELTA, epochs=2,
        max_grad_norm=1.0, sampling_generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        for x, y in private:
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert len(engine.accountant) == 30
    assert 8.0 * (1 - 1e-3) <= engine.get_epsilon(DELTA) <= 8.0
    with pytest.raises(ValueError, match="target_epsilon=1.0 is already spent"):
        engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, target_epsilon=1.0, target_delta=DELTA, epochs=1,
            max_grad_norm=1.0)


def test_an_accountant_state_loaded_into_a_fresh_engine_is_refused_with_the_way_out():
    """The history alone does not say which sampler ran it: refused, and the message names
    the checkpoint functions and ``history_epsilon`` (it asked "changed by hand?" until
    2026-12-02, probe AG). With make_private first, the loaded steps are that phase's."""
    engine = wb.PrivacyEngine()
    phase(engine, nn.Linear(3, 2), 20, 10)
    state = engine.accountant.state_dict()
    fresh = wb.PrivacyEngine()
    fresh.accountant.load_state_dict(state)
    with pytest.raises(ValueError, match="holds 10 step\\(s\\).*load_checkpoint.*history_epsilon"):
        fresh.get_epsilon(DELTA)
    again = wb.PrivacyEngine()
    phase(again, nn.Linear(3, 2), 20, 0)
    again.accountant.load_state_dict(state)
    assert again.get_epsilon(DELTA) == pytest.approx(engine.get_epsilon(DELTA), rel=1e-12)
