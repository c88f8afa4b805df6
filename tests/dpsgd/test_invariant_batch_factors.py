"""A loss scaled by a factor of the realised batch size (``dpsgd/record_reduction.py``,
``realised``): refused at ``loss.backward()``.

Found by a probe (2026-12-01, probeT S5): ``F.cross_entropy(out, y) * len(x) / B``,
``F.cross_entropy(out, y) / len(x)`` and gradient accumulation written as ``ce_mean(chunk) *
n_c / n`` kept the kind "mean" (a mean times a number is a mean), so the optimizer clipped
clip(f(n) g_i): one record, by changing n, moved every other record's clipped term (1.1-1.9 C;
the update 17% off the claimed step, 62% with chunks of 1). Constant factors (a temperature,
1 / accumulation steps, 1 / B with B a constant) stay exact, and a mean written as a sum of
the records' terms times 1 / n (``(ce_none * (1 / len(x))).sum()``) is a mean: it was refused
as a sum, with the advice to divide by the batch size it already divided by."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from tests.dpsgd.test_invariant import C, assert_invariant, batch, mlp
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import LossCouplingError

B = 7.0  # the expected batch size given to the optimizer (N = 6 records in ``batch()``): n/B = 6/7,
# not a round number (record_reduction._round: 0.75 = 6/8 would be taken for a constant)


def ce(z, y):
    return F.cross_entropy(z, y, reduction="none")


def released(model, loss_of_batch, x, y, mode="einsum", reduction="mean"):
    """One σ = 0 step with expected batch size B; Σ_i c_i g_i / B (flat)."""
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=B, method=mode,
                      loss_reduction=reduction)
    try:
        opt.zero_grad()
        loss_of_batch(model(x), y).backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    finally:
        opt.detach()


SCALED = {  # (loss of the batch, loss_reduction): a factor of the realised n, by any read
    "mean times len(x) / B": (lambda z, y: F.cross_entropy(z, y) * len(z) / B, "mean"),
    "mean times (n / B)": (lambda z, y: F.cross_entropy(z, y) * (z.size(0) / B), "mean"),
    "mean over len(x)": (lambda z, y: F.cross_entropy(z, y) / len(z), "mean"),
    "mean over x.shape[0]": (lambda z, y: F.cross_entropy(z, y) / z.shape[0], "mean"),
    "mean over y.numel()": (lambda z, y: F.cross_entropy(z, y) / y.numel(), "mean"),
    "mean over sqrt(n)": (lambda z, y: F.cross_entropy(z, y) / len(z) ** 0.5, "mean"),
    "mean times B / n": (lambda z, y: B / len(z) * F.cross_entropy(z, y), "mean"),
    "terms over n, then their mean": (lambda z, y: (ce(z, y) / len(z)).mean(), "mean"),
    "in place": (lambda z, y: F.cross_entropy(z, y).clone().div_(len(z)), "mean"),
    "two terms, one scaled": (lambda z, y: 0.5 * F.cross_entropy(z, y)
                              + F.cross_entropy(z, y) * len(z) / B, "mean"),
    # under "sum": a sum over n was "not told apart from a constant" (a documented limit)
    "sum over len(x) under sum": (lambda z, y: ce(z, y).sum() / len(z), "sum"),
    "sum times n / B under sum": (lambda z, y: ce(z, y).sum() * len(z) / B, "sum"),
}

EXACT = {  # (loss of the batch, record i's own loss, loss_reduction)
    "sum of the terms times 1 / n": (lambda z, y: (ce(z, y) * (1.0 / len(z))).sum(),
                                     lambda z, y: ce(z, y).sum(), "mean"),
    "terms divided by n, summed": (lambda z, y: (ce(z, y) / z.shape[0]).sum(),
                                   lambda z, y: ce(z, y).sum(), "mean"),
    "terms weighted by a full((n,), 1 / n)": (
        lambda z, y: (ce(z, y) * torch.full((len(z),), 1.0 / len(z), dtype=z.dtype)).sum(),
        lambda z, y: ce(z, y).sum(), "mean"),
    "sum over len(x)": (lambda z, y: F.cross_entropy(z, y, reduction="sum") / len(z),
                        lambda z, y: ce(z, y).sum(), "mean"),
    "sum over n, then 1 / accumulation steps": (
        lambda z, y: ce(z, y).sum() / len(z) / 4, lambda z, y: ce(z, y).sum() / 4, "mean"),
    "a temperature": (lambda z, y: F.cross_entropy(z / 2.0, y) * 0.5,
                      lambda z, y: 0.5 * ce(z / 2.0, y).sum(), "mean"),
    "one over the constant B": (lambda z, y: F.cross_entropy(z, y) * (1 / B),
                                lambda z, y: ce(z, y).sum() / B, "mean"),
    "constant with len(x) read for a log": (
        lambda z, y: F.cross_entropy(z, y) / 4 + 0 * len(z),
        lambda z, y: ce(z, y).sum() / 4, "mean"),
    "mean times n under sum": (lambda z, y: ce(z, y).mean() * len(z) * 0.5,
                               lambda z, y: 0.5 * ce(z, y).sum(), "sum"),
    "sum times 1 / B under sum": (lambda z, y: ce(z, y).sum() / B,
                                  lambda z, y: ce(z, y).sum() / B, "sum"),
}


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("name", sorted(SCALED))
def test_a_factor_of_the_realised_batch_size_is_refused(name, mode):
    x, y = batch()
    loss, reduction = SCALED[name]
    with pytest.raises(LossCouplingError, match="factor computed from the realised batch size"):
        released(mlp(), loss, x, y, mode, reduction)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("name", sorted(EXACT))
def test_constant_factors_and_means_written_by_hand_stay_exact(name, mode):
    x, y = batch()
    loss, own, reduction = EXACT[name]
    assert_invariant(mlp, loss, own, x, y, mode, reduction=reduction)


def test_the_message_names_the_factor_and_the_way_out():
    x, y = batch()
    with pytest.raises(LossCouplingError, match=r"scaled by 0.857143 \(n/B = 6/7\).*"
                                                r"max_physical_batch_size.*learning rate"):
        released(mlp(), SCALED["mean times len(x) / B"][0], x, y)


def test_a_constant_equal_to_the_read_count_is_refused_with_the_way_out():
    """Matched by value: a constant 1/6 at n = 6 with len(x) read is a coincidence the check
    cannot tell apart; the message says to move it into the learning rate."""
    x, y = batch()
    with pytest.raises(LossCouplingError, match="by coincidence, write it into the learning"):
        released(mlp(), lambda z, y_: F.cross_entropy(z, y_) / 6 + 0 * len(z), x, y)
    released(mlp(), lambda z, y_: F.cross_entropy(z, y_) / 6, x, y)  # nothing read: a constant


@pytest.mark.parametrize("constant", [0.1, 0.5, 0.25, 2.0])
def test_a_round_constant_equal_to_a_count_function_is_taken_for_a_constant(constant):
    """``0.1 * term`` with n = 10 and ``if len(x) == 0`` read by the loop (the review of
    2026-12-01: a loop of the engine's loader refused at every step with 10 records): round
    numbers (two significant digits) are how constants are written, so they pass."""
    x, y = batch()
    x, y = torch.cat([x] * 5)[: int(round(1 / constant)) if constant < 1 else 6], \
        torch.cat([y] * 5)[: int(round(1 / constant)) if constant < 1 else 6]
    released(mlp(), lambda z, y_: constant * F.cross_entropy(z, y_) + 0 * len(z), x, y)


def private(seed=3):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 5, generator=g, dtype=torch.float64),
                         torch.randint(0, 4, (40,), generator=g))
    model = mlp()
    engine = wb.PrivacyEngine(accountant="rdp")
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=C,
        sampling_generator=torch.Generator().manual_seed(seed))


CHUNKED = {  # a hand-written accumulation over chunks of 3 of one loader batch
    "chunk's mean times n_c / n": lambda m, xc, yc, n: F.cross_entropy(m(xc), yc)
    * xc.shape[0] / n,
    "chunk's sum over n": lambda m, xc, yc, n: F.cross_entropy(m(xc), yc, reduction="sum") / n,
    "chunk's terms summed over n": lambda m, xc, yc, n: ce(m(xc), yc).sum() / n,
}


@pytest.mark.parametrize("size", [3, 1])
@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_accumulation_weighted_by_the_chunks_share_is_refused(name, size):
    """``ce_mean(chunk) * n_c / n``: each record clipped as clip(g_i n_c / n) (the probe's
    o02: 17% off the claimed step). ``sum(chunk) / n`` was refused with "divide the sum by
    the batch size", which it did."""
    if size == 1 and name == "chunk's terms summed over n":
        pytest.xfail("n = 1: the window's batch statistics (derived) are off, no kind")
    model, opt, loader = private()
    with pytest.raises(LossCouplingError, match="factor computed from the realised batch.*"
                                                "each chunk's own mean"):
        for x, y in loader:
            n = len(x)
            opt.zero_grad()
            for xc, yc in zip(x.split(size), y.split(size)):
                CHUNKED[name](model, xc, yc, n).backward()
            opt.step()


def test_accumulation_of_each_chunks_own_mean_is_exact():
    model, opt, loader = private()
    steps = 0
    for x, y in loader:
        if len(x) < 4:
            continue
        twin = copy.deepcopy(model)
        opt.zero_grad()
        for xc, yc in zip(x.split(3), y.split(3)):
            F.cross_entropy(model(xc), yc).backward()
        opt.step()
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        params = list(twin.parameters())
        want = torch.zeros_like(got)
        for i in range(len(x)):
            g = torch.cat([t.flatten() for t in torch.autograd.grad(
                F.cross_entropy(twin(x[i:i + 1]), y[i:i + 1]), params)])
            want += min(1.0, C / float(g.norm())) * g
        assert float((got - want / 8).norm()) <= 1e-9 * max(1.0, float(want.norm()))
        steps += 1
    assert steps


ACROSS = {  # a factor c·n^p whose c is no constant the step knows: only two steps show it
    "len(x) / 64 with B = 8": lambda z, y, t: F.cross_entropy(z, y) * len(z) / 64,
    "2 len(x) / B": lambda z, y, t: F.cross_entropy(z, y) * 2 * len(z) / 8,
    "over 3 len(x)": lambda z, y, t: F.cross_entropy(z, y) / (3 * len(z)),
    "sqrt(len(x)) / 7": lambda z, y, t: F.cross_entropy(z, y) * len(z) ** 0.5 / 7,
    "terms times len(x) / 40, then their mean": lambda z, y, t: (ce(z, y) * len(z) / 40).mean(),
}
STEADY = {  # a constant, or a schedule of the step that does not follow n: exact
    "a weight stepped once by the ratio n moved": lambda z, y, t: (1.0 if t == 0 else 0.8)
    * F.cross_entropy(z, y),  # (n = 10, then 8, 9, 7: f/f0 = n/n0 = 0.8 at the step)
    "a weight of 0.37": lambda z, y, t: 0.37 * F.cross_entropy(z, y),
    "an annealed weight": lambda z, y, t: min(1.0, (t + 1) / 7) * F.cross_entropy(z, y),
    "a weight read from n but constant": lambda z, y, t: F.cross_entropy(z, y)
    * (1.0 if len(z) else 0.0),
}


def engine_steps(loss_of, steps=8):
    """``steps`` Poisson steps (B = 8 of N = 32) of the engine's loop; the sizes drawn."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 5, dtype=torch.float64), torch.randint(0, 3, (32,)))
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 3)).double()
    model, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=1.0,
        sampling_generator=torch.Generator().manual_seed(3))
    sizes = []
    try:
        for t, (x, y) in enumerate(loader):
            if t == steps:
                break
            sizes.append(len(x))
            opt.zero_grad()
            loss_of(model(x), y, t).backward()
            opt.step()
    finally:
        opt.detach()
    return sizes


@pytest.mark.parametrize("case", sorted(ACROSS))
def test_a_factor_following_n_across_steps_is_refused(case):
    """probeV S1 (2026-12-01): ``ce * len(x) / 64`` with the loader's B = 8 is clip(n/64 g_i),
    0.19-0.33 off the step at |grad| 0.04-0.10, silently: n/64 matches none of n, 1/n, n/B
    at one step; three steps of different n show f/n constant."""
    with pytest.raises(LossCouplingError, match=r"scaled by .*c(·|/)(sqrt\()?n"):
        engine_steps(ACROSS[case])


@pytest.mark.parametrize("case", sorted(STEADY))
def test_a_factor_that_does_not_follow_n_is_accepted(case):
    sizes = engine_steps(STEADY[case])
    assert sizes == [10, 8, 9, 7]  # (different n: the rule had its chance)
