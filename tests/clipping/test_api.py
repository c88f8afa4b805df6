"""Clip factors, the zoo, errors and leaving the model as it was."""

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import assert_clipping_agrees
from tests.per_sample.test_engine import hook_count
from workbench import models
from workbench.clipping import CLIP_METHODS, NORM_METHODS, clip_factors

CE = nn.CrossEntropyLoss(reduction="none")


def test_clip_factors_exact_and_zero_norm():
    c = clip_factors(torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64), 1.5)
    assert c.tolist() == [1.0, 1.0, 0.5]


@pytest.mark.parametrize("C", [0, -1.0, float("inf"), float("nan")])
def test_bad_max_grad_norm(C):
    model, x, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randint(0, 2, (4,))
    match = f"max_grad_norm must be a finite number > 1e-12.*{float(C)!r}"
    with pytest.raises(ValueError, match=match):
        wb.clipped_grad_sum(model, CE, x, y, max_grad_norm=C)


def test_max_grad_norm_of_wrong_type():
    with pytest.raises(TypeError, match="max_grad_norm must be a real number; got 'one' \\(str\\)"):
        clip_factors(torch.ones(2), "one")


def test_unknown_methods():
    model, x, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="method must be one of.*got 'bookkeeping'"):
        wb.per_sample_grad_norms(model, CE, x, y, method="bookkeeping")
    with pytest.raises(ValueError, match="got 'ghosts'"):
        wb.clipped_grad_sum(model, CE, x, y, 1.0, method="ghosts")


@pytest.mark.parametrize("method", CLIP_METHODS)
def test_errors_are_shared_with_per_sample_gradients(method):
    model, x, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(wb.LossShapeError, match="reduction='none'"):
        wb.clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, 1.0, method=method)
    with pytest.raises(ValueError, match="empty batch"):
        wb.clipped_grad_sum(model, CE, x[:0], y[:0], 1.0, method=method)
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(wb.SampleMixingError, match="BatchNorm1d at 1"):
        wb.clipped_grad_sum(bn, lambda o, t: o.sum(1), x, None, 1.0, method=method)


@pytest.mark.parametrize("method", CLIP_METHODS)
def test_model_left_as_it_was(method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    model[0].weight.grad = torch.ones_like(model[0].weight)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    wb.clipped_grad_sum(model, CE, x, y, 0.1, method=method)
    if method in NORM_METHODS:
        wb.per_sample_grad_norms(model, CE, x, y, method=method)
    assert hook_count(model) == 0
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None


def test_nothing_trainable():
    model = nn.Linear(3, 2).requires_grad_(False)
    x = torch.randn(4, 3)
    assert wb.clipped_grad_sum(model, lambda o, t: o.sum(1), x, None, 1.0) == {}
    assert wb.per_sample_grad_norms(model, lambda o, t: o.sum(1), x, None).tolist() == [0.0] * 4


@pytest.mark.parametrize("name", list(models.ZOO))
def test_zoo(name):
    torch.manual_seed(0)
    model = models.make_model(name).double()
    n = 2 if name == "cifar10_cnn" else 4
    x, y = models.example_batch(name, n, generator=torch.Generator().manual_seed(1),
                                dtype=torch.float64)
    if x.dtype == torch.int64:
        x = x[:, :32]
    assert_clipping_agrees(model, CE, x, y)
