"""Norms and clipped sums of every layer type equal micro-batching (float64, <= 1e-9)."""

import warnings

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import assert_clipping_agrees, mse_per_sample
from tests.per_sample.test_embedding import EmbedSum
from tests.per_sample.test_engine import ScaleShift, Tied, Twice
from workbench.per_sample import einsum as einsum_module
from workbench.rules.linear import gram_is_cheaper

CE = nn.CrossEntropyLoss(reduction="none")


def regression(model, shape, seed=0):
    torch.manual_seed(seed)
    model = model.double()
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    return model, x, y


@pytest.mark.parametrize("shape", [(6, 5), (6, 3, 5), (6, 2, 3, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(shape, bias):
    model, x, y = regression(nn.Linear(5, 4, bias=bias), shape)
    assert_clipping_agrees(model, mse_per_sample, x, y)


@pytest.mark.parametrize("T,p,d", [(3, 8, 8), (12, 4, 5)])
def test_linear_sequences_on_both_sides_of_the_rule(T, p, d):
    model, x, y = regression(nn.Linear(d, p), (5, T, d))
    expected = "gram" if gram_is_cheaper(T, p, d) else "materialise"
    assert {3: True, 12: False}[T] == gram_is_cheaper(T, p, d)
    routes = wb.ghost_routes(model, mse_per_sample, x, y)
    assert list(routes["route"]) == [expected] and "pd =" in routes["reason"][0]
    assert_clipping_agrees(model, mse_per_sample, x, y)


@pytest.mark.parametrize("layer,shape,route", [
    (nn.Conv1d(16, 8, 3, padding=1), (5, 16, 6), "gram"),  # 2 L^2 = 72 < 8 * 48
    (nn.Conv1d(2, 3, 3, stride=2), (5, 2, 21), "materialise"),
    (nn.Conv2d(3, 4, 3, padding="same", groups=1), (4, 3, 6, 5), "materialise"),
    (nn.Conv2d(4, 6, 2, groups=2, dilation=2, padding_mode="reflect", padding=1),
     (4, 4, 5, 5), "materialise"),
    (nn.Conv2d(32, 8, 2, stride=2), (4, 32, 4, 4), "gram"),
    (nn.Conv3d(2, 4, 2, bias=False), (3, 2, 3, 4, 3), "materialise"),
])
def test_conv(layer, shape, route):
    model, x, y = regression(layer, shape)
    assert wb.ghost_routes(model, mse_per_sample, x, y)["route"][0] == route
    assert_clipping_agrees(model, mse_per_sample, x, y)


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("index_shape", [(), (6,), (3, 4)])
def test_embedding(padding_idx, index_shape):
    torch.manual_seed(0)
    model = EmbedSum(padding_idx=padding_idx).double()
    x = torch.randint(0, 5, (7, *index_shape))  # repeated indices within a sample
    assert_clipping_agrees(model, CE, x, torch.randint(0, 2, (7,)))


@pytest.mark.parametrize("layer,shape", [
    (nn.LayerNorm((3, 5)), (6, 4, 3, 5)),
    (nn.LayerNorm(5, bias=False), (6, 5)),
    (nn.GroupNorm(2, 4), (6, 4, 5)),
    (nn.InstanceNorm2d(3, affine=True), (5, 3, 4, 4)),
    (nn.RMSNorm(5), (6, 3, 5)),
])
def test_normalisation_layers_by_fast_gradient_clipping(layer, shape):
    model, x, y = regression(nn.Sequential(layer), shape)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    routes = wb.ghost_routes(model, mse_per_sample, x, y)
    assert list(routes["route"]) == ["fast gradient clipping"]
    assert_clipping_agrees(model, mse_per_sample, x, y)


def test_custom_layer_without_any_sampler(recwarn):
    model, x, y = regression(nn.Sequential(nn.Linear(3, 4), ScaleShift(4)), (5, 3))
    assert_clipping_agrees(model, mse_per_sample, x, y)


def test_registered_norm_sampler_is_used():
    calls = []

    @wb.register_norm_sampler(ScaleShift)
    def scale_shift_norms(layer, activations, backprops):
        calls.append(1)
        x = activations[0]
        return (x * backprops).pow(2).sum(1) + backprops.pow(2).sum(1)

    try:
        model, x, y = regression(nn.Sequential(nn.Linear(3, 4), ScaleShift(4)), (5, 3))
        ref = wb.per_sample_grad_norms(model, mse_per_sample, x, y, method="microbatch")
        einsum_module._WARNED.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the norm sampler covers it: no vmap warning
            got = wb.per_sample_grad_norms(model, mse_per_sample, x, y, method="ghost")
        assert torch.allclose(got, ref, rtol=1e-12) and calls
        assert wb.ghost_routes(model, mse_per_sample, x, y)["route"][1] == "norm sampler"
    finally:
        del wb.clipping.NORM_SAMPLERS[ScaleShift]


def test_weight_sharing_module_called_twice():
    torch.manual_seed(0)
    model = Twice().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    routes = wb.ghost_routes(model, CE, x, y)
    assert (routes["route"] == "gram (shared)").sum() == 2  # 2 (1 + 1)² < 4 · 4: cross Grams
    assert_clipping_agrees(model, CE, x, y)


def test_weight_sharing_tied_parameter():
    torch.manual_seed(0)
    model = Tied().double()
    x, y = torch.randint(0, 7, (6, 3)), torch.randint(0, 7, (6,))
    assert_clipping_agrees(model, CE, x, y)


def test_frozen_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(9, 4), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(),
                          nn.Linear(5, 3), nn.LayerNorm(3)).double()
    model[0].requires_grad_(False)
    model[2].weight.requires_grad_(False)
    x, y = torch.randint(0, 9, (6, 3)), torch.randint(0, 3, (6,))
    _, ref = assert_clipping_agrees(model, CE, x, y)
    assert set(ref) == {"2.bias", "4.weight", "4.bias", "5.weight", "5.bias"}


def test_clipping_bounds_every_sample():
    model, x, y = regression(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)), (1, 4))
    norm = wb.per_sample_grad_norms(model, mse_per_sample, x, y)
    summed = wb.clipped_grad_sum(model, mse_per_sample, x, y, max_grad_norm=float(norm) / 10)
    total = torch.sqrt(sum(g.pow(2).sum() for g in summed.values()))
    assert torch.isclose(total, norm / 10, rtol=1e-12)
