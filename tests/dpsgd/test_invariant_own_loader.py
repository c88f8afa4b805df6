"""Batch statistics computed before the forward pass with a loader the engine does not own
(``poisson_sampling=False`` returns the user's, or a hand-written loop over tensors with a
bare ``DPOptimizer``): the follower starts at the optimizer's boundary (created,
``zero_grad``, ``step``), n not known until the forward pass names it
(``BatchStatistics.settle``), so each coupling is refused wherever the loop computes it;
per-record and data-set normalisations, and an evaluation pass without gradient, are not."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import workbench as wb
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import LossCouplingError

N, D, K, B = 24, 5, 3, 8


def data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, D, dtype=torch.float64, generator=g),
            torch.randint(0, K, (N,), generator=g))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, K)).double()


def ce(o, y):
    return F.cross_entropy(o, y, reduction="sum")


def user_loader(prepare, late=False, dataset=None):
    """make_private(poisson_sampling=False): the user's own DataLoader, returned as is."""
    model = mlp()
    loader = DataLoader(dataset or TensorDataset(*data()), batch_size=B)
    model, opt, same = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum", poisson_sampling=False)
    assert same is loader
    for x, y in same:
        if late:  # zero_grad first, then the statistic
            opt.zero_grad()
        x, y = prepare(x, y)
        if not late:
            opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    return model


def by_hand(prepare, late=False):
    """A bare DPOptimizer over tensors sliced by hand: no loader at all."""
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=B, loss_reduction="sum")
    X, Y = data()
    for i in range(0, N, B):
        if late:
            opt.zero_grad()
        x, y = prepare(X[i:i + B], Y[i:i + B])
        if not late:
            opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    return model


def smoothed_by_frequency(x, y):  # label smoothing toward the batch's class frequencies
    freq = torch.bincount(y, minlength=K).double() / len(y)
    return x * freq[y].unsqueeze(1), y


COUPLED = {
    "centred and scaled by the batch": lambda x, y: ((x - x.mean(0)) / x.std(0), y),
    "min-max scaled by the batch": lambda x, y: ((x - x.amin(0)) / (x.amax(0) - x.amin(0)), y),
    "ranked within the batch": lambda x, y: (x.argsort(0).argsort(0).double(), y),
    "a median read as a number": lambda x, y: (x - x.median().item(), y),
    "weighted by the batch's class frequency": smoothed_by_frequency,
}
LOOPS = {"user's loader": user_loader, "by hand": by_hand}


@pytest.mark.parametrize("late", [False, True], ids=["before zero_grad", "after zero_grad"])
@pytest.mark.parametrize("where", sorted(LOOPS))
@pytest.mark.parametrize("case", sorted(COUPLED))
def test_statistics_before_the_forward_pass_are_refused_with_any_loader(case, where, late):
    with pytest.raises(LossCouplingError, match="model's input"):
        LOOPS[where](COUPLED[case], late)


class PerClip(Dataset):
    """Each record normalised by its own 16 samples (an audio clip's mean and std)."""

    def __init__(self):
        self.x, self.y = data()
        self.x = torch.randn(N, 16, dtype=torch.float64)

    def __len__(self):
        return N

    def __getitem__(self, i):
        clip = self.x[i]
        return (clip - clip.mean()) / clip.std(), self.y[i]


ACCEPTED = {
    "per-record norm": lambda x, y: (x / x.norm(dim=1, keepdim=True), y),
    "a data-set constant": lambda x, y: ((x - 0.5) / 2.0, y),
}


@pytest.mark.parametrize("where", sorted(LOOPS))
@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_per_record_and_constant_normalisations_are_accepted(case, where):
    assert LOOPS[where](ACCEPTED[case]) is not None


def test_a_per_record_normalisation_in_the_data_set_is_accepted():
    global D
    saved, D = D, 16
    try:
        assert user_loader(lambda x, y: (x, y), dataset=PerClip()) is not None
    finally:
        D = saved


def test_an_evaluation_pass_without_gradient_is_not_refused_and_pauses_the_follower():
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=B, loss_reduction="sum")
    X, Y = data()
    x = (X[:B] - X[:B].mean(0)) / X[:B].std(0)  # a batch statistic, followed
    with torch.no_grad():
        model((X[B:] - X[B:].mean(0)) / X[B:].std(0))  # evaluation: not refused
    with pytest.raises(LossCouplingError, match="model's input"):
        model(x)  # the training pass after it still is
    opt.zero_grad()
    ce(model(X[:B]), Y[:B]).backward()
    opt.step()


def mixup(x, y):  # a shuffled batch partner (Zhang et al. 2018)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return 0.7 * x + 0.3 * x[perm], y


PARTNERS = {"mixup": mixup, "a rolled neighbour": lambda x, y: (x - x.roll(1, 0), y),
            "a flipped partner": lambda x, y: (torch.cat([x, x.flip(0)], 1)[:, :D], y)}


@pytest.mark.parametrize("where", sorted(LOOPS))
@pytest.mark.parametrize("case", sorted(PARTNERS))
def test_rows_of_two_records_combined_are_refused(case, where):
    with pytest.raises(LossCouplingError, match="two different records"):
        LOOPS[where](PARTNERS[case])


def test_a_consistent_reordering_of_the_batch_is_accepted():
    def shuffled(x, y):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        return x[perm] * 2.0, y[perm]

    assert by_hand(shuffled) is not None and user_loader(shuffled) is not None


PAIRED_LOSSES = {  # piecewise linear: no second derivative across records
    "margin ranking against the flipped batch": lambda o, y: F.margin_ranking_loss(
        o[:, 0], o[:, 0].flip(0), torch.ones(len(y), dtype=torch.float64), reduction="sum"),
    "L1 to the rolled neighbour": lambda o, y: (o - o.roll(1, 0)).abs().sum(),
    "mixed soft labels": lambda o, y: F.cross_entropy(
        o, 0.7 * F.one_hot(y, K).double() + 0.3 * F.one_hot(y, K).double().roll(1, 0),
        reduction="sum"),
}


@pytest.mark.parametrize("case", sorted(PAIRED_LOSSES))
def test_a_loss_pairing_records_is_refused(case):
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=B, loss_reduction="sum")
    X, Y = data()
    opt.zero_grad()
    with pytest.raises(LossCouplingError, match="two different records"):
        PAIRED_LOSSES[case](model(X[:B]), Y[:B]).backward()


def test_the_follower_left_after_a_loop_reads_other_libraries_tensors_without_dispatch():
    """After the last step() the follower waits for a forward pass that may never come; code
    run meanwhile with another library's tensor subclass (torch's ExpandedWeight, which Opacus'
    "ew" mode uses and which refuses any function it does not know, ``dim`` included) must
    run as without the workbench."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    user_loader(lambda x, y: (x, y))
    other = nn.Sequential(nn.Linear(D, 3), nn.LayerNorm(3)).double()
    x = data()[0][:B]
    call_for_per_sample_grads(other)(x).sum().backward()
    assert other[0].weight.grad_sample.shape == (B, 3, D)
