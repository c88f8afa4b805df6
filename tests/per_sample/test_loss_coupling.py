"""per_sample/loss.py against a float64 per-record twin: f_i times record i's rows of ∂L/∂z is
∇_z ℓ_i (Eq. 1-2) for the losses whose reduction the engine owns; coupled losses raise."""

import pytest
import torch
from torch import nn

from workbench.errors import LossCouplingError
from workbench.per_sample.loss import check_separable, record_factors, substitute

n, m, V = 4, 3, 5
W = torch.tensor([0.2, 1.5, 1.0, 0.6, 2.5], dtype=torch.float64)
CASES = {
    "plain": {},
    "weight": {"weight": W},
    "ignore": {"ignore_index": -100},
    "weight+ignore": {"weight": W, "ignore_index": -100},
    "smoothing+weight+ignore": {"weight": W, "ignore_index": -100, "label_smoothing": 0.15},
    "ignore 3": {"ignore_index": 3},
}


def targets(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (rows,), generator=g)
    y[torch.rand(rows, generator=g) < 0.35] = -100
    y[:rows // n] = -100  # record 0: nothing counted
    return y


def own_loss(kind, kwargs, z, y, i, per):  # record i's loss, Eq. (1)
    none = kind(**kwargs, reduction="none")
    rows = slice(i * per, (i + 1) * per)
    ignore = kwargs.get("ignore_index", -100)
    counted = int((y[rows] != ignore).sum())
    return none(z[rows], y[rows]).sum() / max(counted, 1)


@pytest.mark.parametrize("per", [1, m])  # one row per record, or m positions (token LM)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", [nn.CrossEntropyLoss, nn.NLLLoss])
def test_factors_make_each_record_its_own_loss(kind, case, per):
    kwargs = dict(CASES[case])
    if kind is nn.NLLLoss:
        kwargs.pop("label_smoothing", None)
    z = torch.randn(n * per, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = targets(n * per)
    if kwargs.get("ignore_index", -100) != -100:
        y = torch.where(y == -100, kwargs["ignore_index"], y)
    crit = kind(**kwargs)
    prep = (lambda t: t.log_softmax(1)) if kind is nn.NLLLoss else (lambda t: t)
    z = z.requires_grad_(True)
    (G,) = torch.autograd.grad(crit(prep(z), y), z)
    f = check_separable(crit, prep(z).detach(), (y,), n, "mean", 1e-9)
    f_direct = record_factors(crit, z, y, n, "mean")
    assert torch.equal(f, f_direct)
    for i in range(n):
        (g,) = torch.autograd.grad(own_loss(kind, kwargs, prep(z), y, i, per), z)
        rows = slice(i * per, (i + 1) * per)
        assert torch.allclose(f[i] * G[rows], g[rows], rtol=1e-12, atol=1e-14), (case, i)


def test_soft_targets_and_elementwise_losses_use_n():
    z = torch.randn(n * m, V, dtype=torch.float64)
    soft = torch.rand(n * m, V, dtype=torch.float64).softmax(1)
    for crit, y in [(nn.CrossEntropyLoss(weight=W), soft), (nn.MSELoss(), soft),
                    (nn.BCEWithLogitsLoss(pos_weight=W), soft.round())]:
        f = check_separable(crit, z, (y,), n, "mean", 1e-9)
        assert torch.equal(f, torch.full((n,), float(n), dtype=torch.float64))
    f = check_separable(nn.CrossEntropyLoss(weight=W, reduction="sum"), z,
                        (targets(n * m),), n, "sum", 1e-9)
    assert torch.equal(f, torch.ones(n, dtype=torch.float64))


class InfoNCE(nn.Module):
    def forward(self, z, y):
        return nn.functional.cross_entropy(z @ z.T, torch.arange(z.shape[0]))


class BatchNormalised(nn.Module):
    def forward(self, z, y):
        return nn.functional.cross_entropy((z - z.mean(0)) / z.std(0), y)


class MaskedMean(nn.Module):  # a token mean over the whole batch, by hand: unknown, coupled
    def forward(self, z, y):
        mask = (y != -100).double()
        ce = nn.functional.cross_entropy(z, y.clamp(min=0), reduction="none")
        return (ce * mask).sum() / mask.sum()


@pytest.mark.parametrize("loss", [InfoNCE, BatchNormalised, MaskedMean])
def test_coupled_losses_raise_naming_the_loss(loss):
    z = torch.randn(n * m, V, dtype=torch.float64)
    y = targets(n * m).clamp(min=0) if loss is not MaskedMean else targets(n * m)
    with pytest.raises(LossCouplingError, match=loss.__name__):
        check_separable(loss(), z, (y,), n, "mean", 1e-7)


def test_reduction_mismatch_and_unattributable_rows_raise():
    from workbench.per_sample.loss import reduction_of

    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        reduction_of(nn.CrossEntropyLoss(reduction="sum"), "mean")
    with pytest.raises(LossCouplingError, match="not a multiple"):
        record_factors(nn.CrossEntropyLoss(ignore_index=0), torch.randn(7, V), targets(7), n,
                       "mean")


def test_substitute_keeps_record_i_and_replaces_the_rest_by_record_k():
    x = torch.arange(n * m).view(n * m, 1)
    s = substitute(x, 2, 0, n).view(n, m)
    assert torch.equal(s[2], x.view(n, m)[2])
    assert all(torch.equal(s[j], x.view(n, m)[0]) for j in (0, 1, 3))
