"""A loss that combines the records' terms other than by a sum or a mean
(``dpsgd/record_reduction.py``, kind "coupled"): refused at ``loss.backward()``.

Found by a probe (2026-11-30): a top-k or a max of the records' losses (online hard-example
mining), a clamp of the batch's mean loss, a gate on the detached mean: each couples the
records piecewise-linearly, so the window's second-derivative test saw nothing, and removing
one record moved the noiseless update by 1.5-2.4 C / B. Their neighbours that keep the loss
a sum of one term per record stay exact (a per-record clamp, a top-k over each record's
classes, scaling, adding loss terms, a regulariser on the parameters)."""

import pytest
import torch
import torch.nn.functional as F

from tests.dpsgd.test_invariant import assert_invariant, batch, mlp, released
from workbench.errors import LossCouplingError


def ce(z, y):
    return F.cross_entropy(z, y, reduction="none")


COUPLED = {
    "top-k of the records": lambda z, y: ce(z, y).topk(3).values.mean(),
    "max of the records": lambda z, y: ce(z, y).max(),
    "median of the records": lambda z, y: ce(z, y).median(),
    "sorted records": lambda z, y: ce(z, y).sort().values[-2:].sum(),
    "cumulative sum": lambda z, y: ce(z, y).cumsum(0).mean(),
    "clamp of the mean": lambda z, y: F.cross_entropy(z, y).clamp(max=1.0),
    "square of the mean": lambda z, y: F.cross_entropy(z, y) ** 2,
    "reciprocal": lambda z, y: 1.0 / F.cross_entropy(z, y).clamp(min=0.1),
    "gate on the mean": lambda z, y: F.cross_entropy(z, y) * (
        F.cross_entropy(z, y).detach() < 1.0),
    "where on the mean": lambda z, y: torch.where(
        F.cross_entropy(z, y) > 10.0, 0.0 * F.cross_entropy(z, y), F.cross_entropy(z, y)),
    "product of two means": lambda z, y: F.cross_entropy(z, y) * ce(z, y).mean(),
    # gates on a reduction with gradient, or its number (silent until 2026-11-30: one
    # record moved the released sum by 6 C; the detached mean's was refused)
    "records above the mean": lambda z, y: ce(z, y)[ce(z, y) > ce(z, y).mean()].sum(),
    "a mask by the mean": lambda z, y: (ce(z, y) * (ce(z, y) > ce(z, y).mean())).sum(),
    "records above the median": lambda z, y: torch.where(
        ce(z, y) > ce(z, y).median(), ce(z, y), 0.0 * ce(z, y)).sum(),
    "records above the mean's number": lambda z, y: ce(z, y)[
        ce(z, y) > ce(z, y).mean().item()].sum(),
    "each record bounded by the mean": lambda z, y: torch.maximum(
        ce(z, y), ce(z, y).mean()).sum(),
    # the review of those (silent): a k-th value, an argsort's picks, a detached number
    "records below the 2nd value": lambda z, y: (
        ce(z, y) * (ce(z, y) <= ce(z, y).kthvalue(2).values)).sum(),
    "the 2 smallest by argsort": lambda z, y: ce(z, y)[ce(z, y).argsort()[:2]].sum(),
    "records above the detached mean's number": lambda z, y: ce(z, y)[
        ce(z, y) > ce(z, y).detach().mean().item()].sum(),
}

LINEAR = {  # name: (batch loss, record i's own loss, by sum)
    "per-record clamp": (lambda z, y: ce(z, y).clamp(max=1.0).mean(),
                         lambda z, y: ce(z, y).clamp(max=1.0).sum()),
    "top-k over each record's classes": (
        lambda z, y: z.topk(2, dim=1).values.sum(1).pow(2).mean(),
        lambda z, y: z.topk(2, dim=1).values.sum(1).pow(2).sum()),
    "scaled and shifted": (lambda z, y: 0.5 * F.cross_entropy(z, y) / 4 + 3.0,
                           lambda z, y: 0.125 * ce(z, y).sum()),
    "two terms": (lambda z, y: F.cross_entropy(z, y) + z.pow(2).sum(1).mean(),
                  lambda z, y: (ce(z, y) + z.pow(2).sum(1)).sum()),
    "each record's top classes by argsort's default dim": (
        lambda z, y: z.gather(1, z.argsort(descending=True)[:, :2]).pow(2).sum(1).mean(),
        lambda z, y: z.gather(1, z.argsort(descending=True)[:, :2]).pow(2).sum(1).sum()),
    "stacked terms": (lambda z, y: torch.stack([F.cross_entropy(z, y),
                                                z.pow(2).sum(1).mean()]).sum(),
                      lambda z, y: (ce(z, y) + z.pow(2).sum(1)).sum()),
}


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping", "auto"])
@pytest.mark.parametrize("name", sorted(COUPLED))
def test_losses_combining_records_non_linearly_are_refused(name, mode):
    x, y = batch()
    with pytest.raises(LossCouplingError, match="one term per record|statistic of the whole "
                                                "batch|depend on the other records"):
        released(mlp(), COUPLED[name], x, y, mode)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("name", sorted(LINEAR))
def test_linear_combinations_stay_exact(name, mode):
    x, y = batch()
    loss, own = LINEAR[name]
    assert_invariant(mlp, loss, own, x, y, mode)


def test_the_message_names_the_operation():
    x, y = batch()
    with pytest.raises(LossCouplingError, match=r"topk\(\) over the records"):
        released(mlp(), COUPLED["top-k of the records"], x, y, "einsum")
    with pytest.raises(LossCouplingError, match=r"clamp\(\) of F.cross_entropy"):
        released(mlp(), COUPLED["clamp of the mean"], x, y, "einsum")


def _stacked_topk(z, y):  # each record's own top-2 in a Python loop, then their mean
    return torch.stack([z[i].topk(2).values.sum().pow(2) for i in range(len(z))]).mean()


def _stacked_topk_own(z, y):
    return torch.stack([z[i].topk(2).values.sum().pow(2) for i in range(len(z))]).sum()


def _summed_max(z, y):  # Python's sum over each record's own max
    return sum(z[i].max() for i in range(len(z))) / len(z)


def _summed_max_own(z, y):
    return sum(z[i].max() for i in range(len(z)))


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("loss, own", [(_stacked_topk, _stacked_topk_own),
                                       (_summed_max, _summed_max_own)])
def test_a_records_own_values_taken_one_by_one_are_not_the_records(loss, own, mode):
    """n = 4 records of 4 classes: a record's row z[i] has n entries; its top-k or max was
    taken for one over the records (refused) until 2026-11-30."""
    x, y = batch(n=4)
    assert_invariant(mlp, loss, own, x, y, mode)


def test_a_loss_over_kept_records_divided_by_the_batch_is_refused():
    """``CE(model(x[keep]), y[keep]).sum() / len(x)`` under ``loss_reduction='mean'``: the
    engine scales by the k rows the model ran on, so clip(g_i k / n) was released (k / n a
    statistic of the batch), silently, where n was a multiple of k, until 2026-11-30."""
    import torch.nn as nn

    from workbench.dpsgd.optimizer import DPOptimizer
    model = mlp(out=3)  # (n · classes = 2 · 3, no count of 8 by chance)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=8.0)
    x, _ = batch()
    x = torch.cat([x, x])[:8]
    y = torch.tensor([0, 0, 1, 1, 1, 1, 1, 2])
    keep = y == 0
    try:
        opt.zero_grad()
        with pytest.raises(LossCouplingError, match="sums the records' terms"):
            (nn.CrossEntropyLoss(reduction="none")(model(x[keep]), y[keep]).sum()
             / len(x)).backward()
    finally:
        opt.detach()
