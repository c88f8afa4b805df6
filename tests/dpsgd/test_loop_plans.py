"""Plans the loop must follow, and settings it must not break (issue 24, family 5).

Invariants held here, each over more than one path:
- the steps make_private_with_epsilon plans = the steps its loader runs (every sampler kind,
  drop_last, virtual steps, fractional epochs), so the engine's own ε ends at the target;
- no step moves the weights without being accounted, and a bad q, σ or C is refused before
  anything changes (make_private, DPDataLoader, assignments after construction);
- a logical batch of virtual steps never mixes with, nor is blocked by, an abandoned one.
"""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.dpsgd import DPOptimizer, PrivacyEngine
from workbench.dpsgd.sampling import DPDataLoader

CE = nn.CrossEntropyLoss()


def dataset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g, dtype=torch.float64),
                         torch.randint(0, 2, (n,), generator=g))


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def run(model, opt, loader, epochs=1):
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            CE(model(x), y).backward()
            opt.step()
            steps += 1
    return steps


# --- 1. the plan is the loop's ----------------------------------------------------------------

@pytest.mark.parametrize("N, B, drop_last, poisson, epochs, physical", [
    (100, 30, False, False, 2, None),   # shuffle: ceil(100/30) = 4 steps, round(1/q) = 3
    (100, 30, True, False, 2, None),    # drop_last: floor = 3
    (100, 40, False, False, 1.5, None),  # round(1/0.4) = 2 but 3 batches; 1.5 epochs: 5 steps
    (100, 30, False, False, 1, 7),      # virtual steps: logical batches are what count
    (100, 30, False, True, 2, None),    # Poisson: round(1/q) = 3
])
def test_epsilon_target_is_met_by_the_steps_the_loader_runs(N, B, drop_last, poisson, epochs,
                                                           physical):
    engine, model = PrivacyEngine(accountant="rdp"), net()
    loader = DataLoader(dataset(N), batch_size=B, shuffle=True, drop_last=drop_last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", wb.dpsgd.engine.PrivacyAccountingWarning)
        model, opt, dp_loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, target_epsilon=2.0, target_delta=1e-3, epochs=epochs,
            max_grad_norm=1.0, poisson_sampling=poisson, max_physical_batch_size=physical,
            sampling_generator=torch.Generator().manual_seed(0) if poisson else None)
    planned = math.ceil(epochs * len(dp_loader))
    for _ in range(math.ceil(epochs)):
        for x, y in dp_loader:
            if len(engine.accountant) == planned:
                break
            opt.zero_grad()
            CE(model(x), y).backward()
            opt.step()
    assert len(engine.accountant) == planned
    eps = engine.accountant.get_epsilon(1e-3)
    if poisson:
        assert 1.9 <= eps <= 2.0 + 1e-6, (eps, planned)
    if not poisson:  # the bracket counts the loader's own epochs, not round(1 / q) batches
        T = len(dp_loader)
        bounds = engine.epsilon_bounds(1e-3)
        # σ planned on the bracket's upper bound (the Poisson σ left it at 2.7-5.5 for a
        # target of 2 until 2026-12-01): within the target, and tight
        assert 1.99 <= bounds.upper <= 2.0 + 1e-6 or math.ceil(epochs) != epochs, bounds
        assert bounds.upper <= 2.0 + 1e-6, bounds
        begun, done = math.ceil(planned / T), planned // T
        assert bounds.steps == begun * T, (bounds, T)
        ref = wb.accounting.epsilon_bounds(
            "shuffle", sample_rate=engine.sample_rate, noise_multiplier=opt.noise_multiplier,
            epochs=begun, delta=1e-3, batches_per_epoch=T)
        assert bounds.upper == ref.upper
        assert bounds.lower == (ref.lower if done == begun else wb.accounting.epsilon_bounds(
            "shuffle", sample_rate=engine.sample_rate, noise_multiplier=opt.noise_multiplier,
            epochs=done, delta=1e-3, batches_per_epoch=T).lower)


def _shuffled(loader_kwargs=None, N=40, B=4):
    engine, model = PrivacyEngine(), net()
    loader = DataLoader(dataset(N), batch_size=B, shuffle=True, **(loader_kwargs or {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", wb.dpsgd.engine.PrivacyAccountingWarning)
        model, opt, same = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=0.8, max_grad_norm=1.0,
            poisson_sampling=False)
    assert same is loader  # returned as it is
    return engine, model, opt, loader


def _bracket(engine, epochs, T, done=None):
    def at(e):
        return wb.accounting.epsilon_bounds("shuffle", sample_rate=engine.sample_rate,
                                            noise_multiplier=0.8, epochs=e, delta=1e-5,
                                            batches_per_epoch=T)
    return at(epochs).upper, (at(done).lower if done else 0.0)


LOOPS = {  # steps (each a list of batches); passes begun and completed, given T = len(loader)
    "a fresh pass per step": (lambda loader: [[next(iter(loader))] for _ in range(len(loader))],
                              lambda T: T, lambda T: 0),
    "two batches a step": (lambda loader: [list(pair) for _ in range(2)
                                           for pair in zip(*[iter(loader)] * 2)],
                           lambda T: 2, lambda T: 1),  # (steps // T: one epoch of T steps)
    "a break half-way through each of two epochs": (
        lambda loader: [[b] for _ in range(2) for i, b in zip(range(len(loader) // 2), loader)],
        lambda T: 2, lambda T: 0),
}


@pytest.mark.parametrize("case", sorted(LOOPS))
def test_the_shuffled_bracket_counts_the_passes_the_loop_began(case):
    """ceil(steps / len(loader)) epochs were charged until 2026-11-30: one batch per fresh
    pass (next(iter(loader))), ten steps, was bracketed by one epoch's [.., 11.0] for a true
    ε of 14.5 (the probe's, N = 100, B = 10, σ = 0.5); two batches a step, by one epoch for
    two."""
    engine, model, opt, loader = _shuffled()
    T = len(loader)
    take, begun, done = LOOPS[case]
    for step in take(loader):
        opt.zero_grad()
        for x, y in step:
            CE(model(x), y).backward()
        opt.step()
    bounds = engine.epsilon_bounds(1e-5)
    upper, lower = _bracket(engine, begun(T), T, done(T))
    assert bounds.upper == upper and bounds.upper > _bracket(engine, 1, T)[0]
    assert bounds.lower == min(lower, upper)


def test_an_epoch_as_planned_is_bracketed_as_before():
    engine, model, opt, loader = _shuffled()
    run(model, opt, loader, epochs=2)
    upper, lower = _bracket(engine, 2, len(loader), 2)
    bounds = engine.epsilon_bounds(1e-5)
    assert (bounds.upper, bounds.lower) == (upper, lower)
    _shuffled()  # make_private again on the same loader (a re-run cell): accepted


@pytest.mark.parametrize("sampler", ["replacement", "num_samples"])
def test_a_shuffled_pass_drawing_a_record_twice_is_refused(sampler):
    data = dataset(40)
    kw = {"replacement": True} if sampler == "replacement" else {"num_samples": 120}
    engine, model = PrivacyEngine(), net()
    with pytest.raises(ValueError, match="RandomSampler draws.*each record once"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(data, batch_size=4, sampler=torch.utils.data
                                                   .RandomSampler(data, **kw)),
                            noise_multiplier=0.8, max_grad_norm=1.0, poisson_sampling=False)


# --- 3. q in (0, 1], checked before anything changes ------------------------------------------

@pytest.mark.parametrize("poisson", [True, False])
def test_batch_larger_than_the_data_set_is_refused_before_the_model_is_touched(poisson):
    engine, model = PrivacyEngine(), net()
    before = [len(m._forward_hooks) for m in model.modules()]
    with pytest.raises(ValueError, match=r"batch_size=20 gives the sample rate q = 20 / N = "
                                         r"2 .*q must be in \(0, 1\].*batch_size <= 10"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", wb.dpsgd.engine.PrivacyAccountingWarning)
            engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                        lr=1.0),
                                data_loader=DataLoader(dataset(10), batch_size=20),
                                noise_multiplier=1.0, max_grad_norm=1.0,
                                poisson_sampling=poisson)
    assert [len(m._forward_hooks) for m in model.modules()] == before
    with pytest.raises(ValueError, match="q = 20 / N = 2"):
        engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(dataset(10), batch_size=20), target_epsilon=1.0,
            target_delta=1e-5, epochs=1, max_grad_norm=1.0)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_poisson_loader_refuses_a_sample_rate_outside_zero_one(q):
    with pytest.raises(ValueError, match="sample_rate must be"):
        DPDataLoader(dataset(10), sample_rate=q)


def test_a_step_whose_accounting_fails_does_not_move_the_weights():
    model = net()

    def broken_accountant(sigma):
        raise RuntimeError("accountant refused")

    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=4, on_step=broken_accountant)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = dataset(4).tensors
    opt.zero_grad()
    CE(model(x), y).backward()
    with pytest.raises(RuntimeError, match="accountant refused"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- 10. settings assigned after construction --------------------------------------------------

BAD_SETTINGS = [
    ("noise_multiplier", float("nan"), ValueError, "noise_multiplier must be"),
    ("noise_multiplier", -1.0, ValueError, "noise_multiplier must be"),
    ("noise_multiplier", "1.0", TypeError, "noise_multiplier must be"),
    ("max_grad_norm", 0.0, ValueError, "max_grad_norm must be"),
    ("max_grad_norm", float("inf"), ValueError, "max_grad_norm must be"),
    ("max_grad_norm", [1.0, 2.0, 3.0], ValueError, "3 values for 1 parameter groups"),
    ("expected_batch_size", 0, ValueError, "expected_batch_size must be"),
    ("method", "fast", ValueError, "method must be one of"),
    ("loss_reduction", "none", ValueError, "loss_reduction must be 'mean'"),
    ("generator", 3, TypeError, "generator must be a torch.Generator"),
    ("on_step", "rdp", TypeError, "on_step must be callable"),
    ("verify", "sometimes", ValueError, "verify must be True"),
    ("all_reduce_timeout_minutes", 0, ValueError, "all_reduce_timeout_minutes must be"),
]


@pytest.mark.parametrize("name, value, error, message", BAD_SETTINGS)
def test_settings_are_checked_when_assigned(name, value, error, message):
    model = net()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=4)
    old = getattr(opt, name)
    with pytest.raises(error, match=message):
        setattr(opt, name, value)
    assert getattr(opt, name) == old  # the bad value never lands
    with pytest.raises(error, match=message):  # the constructor uses the same check
        kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
        if name in kw or name in ("method", "loss_reduction", "generator",
                                  "on_step"):
            kw[name] = value
            DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, **kw)
        else:
            raise error(message)  # not a constructor argument: nothing more to check


def test_good_settings_assigned_after_construction_take_effect():
    model = net()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=4)
    opt.noise_multiplier, opt.max_grad_norm = 0.0, 0.5
    x, y = dataset(4).tensors
    opt.zero_grad()
    nn.CrossEntropyLoss(reduction="none")(model(x), y).mean().backward()
    opt.step()
    expected = wb.clipped_grad_sum(net(), nn.CrossEntropyLoss(reduction="none"), x, y, 0.5,
                                   method="microbatch")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad * 4, expected[name], rtol=1e-9, atol=1e-12)


def test_shuffled_batches_under_ddp_count_every_rank(monkeypatch):
    # each of 2 ranks draws batch_size records a step: q = 2 B / N, B_global = 2 B (the
    # process group itself is not needed to build the plan)
    monkeypatch.setattr(wb.dpsgd.engine, "_world", lambda: 2)
    engine, model = PrivacyEngine(), net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", wb.dpsgd.engine.PrivacyAccountingWarning)
        data = dataset(100)  # each rank its own share (a RandomSampler is refused under DDP)
        _, opt, loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=20, sampler=torch.utils.data.distributed
                                   .DistributedSampler(data, num_replicas=2, rank=0)),
            target_epsilon=2.0, target_delta=1e-3, epochs=1, max_grad_norm=1.0,
            poisson_sampling=False)
    assert engine.sample_rate == 0.4 and opt.expected_batch_size == 40
    with pytest.raises(ValueError, match="q = 2 ranks x 60 / N = 1.2"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1),
                            data_loader=DataLoader(dataset(100), batch_size=60),
                            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)


def test_two_engines_over_one_shuffled_loader_each_count_its_passes():
    """A second make_private on the same loader replaced the first engine's counter, which
    fell back to steps / len(loader): [4.37, 6.57] for five fresh passes (true [11.0, 11.5])."""
    first, model, opt, loader = _shuffled()
    second = PrivacyEngine()
    other = net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", wb.dpsgd.engine.PrivacyAccountingWarning)
        second.make_private(module=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                            data_loader=loader, noise_multiplier=0.8, max_grad_norm=1.0,
                            poisson_sampling=False)
    for _ in range(5):
        x, y = next(iter(loader))
        opt.zero_grad()
        CE(model(x), y).backward()
        opt.step()
    assert first.passes.begun == second.passes.begun == 5
    assert first.epsilon_bounds(1e-5).upper == _bracket(first, 5, len(loader))[0]


def test_with_workers_a_pass_broken_off_is_not_counted_as_done():
    """The workers' sampler runs ahead: passes the loop broke off ended there too, and the
    lower bound counted them as epochs done (8.19 for a loop of half passes)."""
    engine, model, opt, loader = _shuffled({"num_workers": 1})
    for _ in range(2):
        for i, (x, y) in zip(range(len(loader) // 2), loader):
            opt.zero_grad()
            CE(model(x), y).backward()
            opt.step()
    bounds = engine.epsilon_bounds(1e-5)
    assert bounds.lower == 0.0 and bounds.upper == _bracket(engine, 2, len(loader))[0]
