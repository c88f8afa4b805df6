import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import assert_agree, mse_per_sample


def check(layer, shape, lead=None):
    torch.manual_seed(0)
    model = nn.Sequential(lead, layer) if lead is not None else layer
    model = model.double()
    with torch.no_grad():  # non-trivial affine parameters
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randn_like(model(x))
    assert_agree(model, mse_per_sample, x, y)


@pytest.mark.parametrize("norm_dims", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(norm_dims, bias):
    shape = (6, 3, 4, 5)
    check(nn.LayerNorm(shape[-norm_dims:], bias=bias), shape)


def test_layer_norm_without_affine_behind_linear():
    frozen = nn.LayerNorm(5, elementwise_affine=False)  # nothing trainable: nothing returned
    assert wb.per_sample_gradients(frozen, lambda o, _: o.sum((1, 2)), torch.randn(6, 3, 5),
                                   None) == {}
    check(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5, elementwise_affine=False)), (6, 3, 4))


@pytest.mark.parametrize("shape", [(6, 8), (6, 8, 5), (6, 8, 3, 4)])
def test_group_norm(shape):
    check(nn.GroupNorm(4, 8), shape)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_instance_norm_affine(dims):
    layer = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims]
    check(layer(3, affine=True), (5, 3, *([4] * dims)))


@pytest.mark.parametrize("shape", [(6, 5), (6, 3, 5)])
def test_rms_norm(shape):
    check(nn.RMSNorm(5), shape)
    check(nn.RMSNorm(shape[1:], eps=1e-3), shape)
