"""The invariant when the loop computes a statistic of the batch's data *before* the model's
forward pass (``loss_watch.BeforeForward``, ``loss_watch.watched``): a Trainer-style
``num_items_in_batch``, a label count read as a number, batch class frequencies, inputs
centred or scaled by the batch's own statistics. Each couples the records (removing one moves
every other record's clipped contribution); the engine's loaders follow the batch from the
moment they hand it out, so each is refused, in every loader the engine builds (Poisson,
virtual steps, user level). Per-record normalisations, data-set constants and statistics used
only for logging are accepted, and the following stops when a pass ends or is abandoned."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.dpsgd.loss_watch import BeforeForward
from workbench.errors import LossCouplingError

N, D, K = 48, 5, 3
W = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, dtype=torch.float64, generator=g)
    y = torch.randint(0, K, (N,), generator=g)
    return TensorDataset(x, y)


def loop(step, steps=3, **options):
    """Runs ``steps`` steps of the engine's loop with the batch loss ``step(model, x, y)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K)).double()
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
        loss_reduction="sum", sampling_generator=torch.Generator().manual_seed(1), **options)
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad()
        step(model, x, y).backward()
        opt.step()
    return opt


def ce(o, y):
    return F.cross_entropy(o, y, reduction="none")  # (n,)


def items_in_batch(model, x, y):
    k = (y != 2).sum()  # a Trainer's num_items_in_batch, before the forward pass
    return (ce(model(x), y) * (y != 2)).sum() / k


def count_as_number(model, x, y):
    k = W[y].sum().item()  # the batch's total class weight, read as a number
    return (W[y] * ce(model(x), y)).sum() / k


def class_frequency(model, x, y):
    w = 1.0 / (torch.bincount(y, minlength=K).double() + 1)  # the batch's class frequencies
    return F.cross_entropy(model(x), y, weight=w, reduction="sum")


def centred_inputs(model, x, y):
    x = (x - x.mean(0)) / x.std(0)  # standardised by the batch's own statistics
    return ce(model(x), y).sum()


def scaled_inputs(model, x, y):
    return ce(model(x / x.abs().max()), y).sum()  # one scale over the whole batch


PREPROCESS = torch.nn.BatchNorm1d(D, affine=False).double()  # a module outside the model


COUPLED = {"num_items_in_batch": items_in_batch, "a count read as a number": count_as_number,
           "batch class frequency as weight=": class_frequency,
           "inputs centred by the batch": centred_inputs,
           "inputs scaled by the batch max": scaled_inputs,
           # fused normalisations and the records moved off dim 0 (silent until 2026-12-01:
           # one record's influence 1.7-1.8 C)
           "inputs through F.batch_norm": lambda m, x, y: ce(m(F.batch_norm(
               x, None, None, training=True)), y).sum(),
           "inputs through a BatchNorm1d in train mode": lambda m, x, y: ce(m(
               PREPROCESS.train()(x)), y).sum(),
           "inputs through F.normalize over the records": lambda m, x, y: ce(m(
               F.normalize(x, dim=0)), y).sum(),
           "inputs centred over x.T's dim 1": lambda m, x, y: ce(m(
               (x.T - x.T.mean(1, keepdim=True)).T), y).sum(),
           "inputs through layer_norm of x.T": lambda m, x, y: ce(m(
               F.layer_norm(x.T, (x.shape[0],)).T), y).sum(),
           "inputs' sign chosen by an if on their sum": lambda m, x, y: ce(m(
               x if x[:, 0].sum() > 0 else -x), y).sum(),
           "inputs scaled by a std over x.transpose(0, 1)": lambda m, x, y: ce(m(
               x / x.transpose(0, 1).std(1)), y).sum()}
LOADERS = {"poisson": {}, "virtual steps": {"max_physical_batch_size": 4},
           "user level": {"privacy_unit": "user", "user_ids": torch.arange(N) // 2}}


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("case", sorted(COUPLED))
def test_statistics_computed_before_the_forward_pass_are_refused(case, loader):
    with pytest.raises(LossCouplingError, match="statistic of the whole batch"):
        loop(COUPLED[case], **LOADERS[loader])


def logged(model, x, y):
    share = (y == 0).double().mean().item()  # printed by the loop, not used by the loss
    assert 0 <= share <= 1
    return ce(model(x), y).sum()


ACCEPTED = {
    "inputs through a BatchNorm1d in eval mode": lambda m, x, y: ce(m(PREPROCESS.eval()(x)),
                                                                  y).sum(),
    "inputs centred by their own mean over x.T's dim 0": lambda m, x, y: ce(m(
        x - x.T.mean(0)[:, None]), y).sum(),
    "inputs through F.normalize per record": lambda m, x, y: ce(m(F.normalize(x, dim=1)),
                                                               y).sum(),
    "per-record normalised inputs": lambda m, x, y: ce(m(x / x.norm(dim=1, keepdim=True)),
                                                       y).sum(),
    "a data-set constant": lambda m, x, y: ce(m(x), y).sum() / 7.0,
    "a statistic for logging only": logged,
    "the batch's row count": lambda m, x, y: ce(m(x), y).sum() / len(y) * len(y),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_per_record_and_constant_terms_are_accepted(case, loader):
    opt = loop(ACCEPTED[case], **LOADERS[loader])
    assert opt is not None


def followers() -> int:
    """BeforeForward modes on the TorchFunctionMode stack."""
    return sum(isinstance(torch._C._get_function_stack_at(i), BeforeForward)
               for i in range(torch._C._len_torch_function_stack()))


def test_the_following_stops_at_the_end_of_a_pass_and_at_detach():
    loop(lambda m, x, y: ce(m(x), y).sum(), steps=10 ** 6)  # the whole pass
    assert followers() == 0 and BeforeForward.following is None
    opt = loop(lambda m, x, y: ce(m(x), y).sum(), steps=2)  # abandoned after a batch
    assert followers() == 1
    opt.detach()
    assert followers() == 0 and BeforeForward.following is None


def test_a_refused_input_loses_nothing():
    """The refusal comes before the forward pass changes anything: the fixed loop then runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K)).double()
    model, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=16), noise_multiplier=0.0, max_grad_norm=1.0,
        loss_reduction="sum", sampling_generator=torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    with pytest.raises(LossCouplingError, match="model's input"):
        centred_inputs(model, x, y)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for x, y in loader:
        opt.zero_grad()
        ce(model(x), y).sum().backward()
        opt.step()
        break
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_abandoned_passes_leave_at_most_one_follower_and_the_users_modes_in_place():
    from torch.overrides import TorchFunctionMode

    class Mine(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for _ in range(3):  # three engines, each abandoned after a batch, none detached
        loop(lambda m, x, y: ce(m(x), y).sum(), steps=1)
        assert followers() == 1
    with Mine() as mine:  # the user's own mode, above the follower, stays where it is
        opt = loop(lambda m, x, y: ce(m(x), y).sum(), steps=1)
        assert followers() == 1
        stack = [torch._C._get_function_stack_at(i)
                 for i in range(torch._C._len_torch_function_stack())]
        assert mine in stack
        opt.detach()
        assert followers() == 0
    assert mine not in [torch._C._get_function_stack_at(i)
                        for i in range(torch._C._len_torch_function_stack())]
