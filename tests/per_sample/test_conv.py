import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.helpers import assert_agree
from workbench.rules import conv as conv_sampler

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SIZE = {1: (13,), 2: (9, 8), 3: (6, 5, 7)}

CONFIGS = {
    "plain": dict(kernel_size=3),
    "stride": dict(kernel_size=3, stride=2),
    "pad-int": dict(kernel_size=3, padding=2),
    "pad-same-even-kernel": dict(kernel_size=4, padding="same"),
    "pad-same-dilated": dict(kernel_size=3, padding="same", dilation=2),
    "pad-valid": dict(kernel_size=2, padding="valid"),
    "dilation": dict(kernel_size=2, dilation=2, padding=1),
    "groups": dict(kernel_size=3, groups=2, padding=1),
    "depthwise": dict(kernel_size=3, groups=4, padding=1),
    "no-bias": dict(kernel_size=3, bias=False),
    "reflect": dict(kernel_size=3, padding=1, padding_mode="reflect"),
    "replicate": dict(kernel_size=3, padding=2, padding_mode="replicate"),
    "circular": dict(kernel_size=3, padding=1, padding_mode="circular", stride=2),
    "pointwise": dict(kernel_size=1),  # the unfold is a view of the input
    "pointwise-stride": dict(kernel_size=1, stride=2, groups=2),  # every other position
    "pointwise-pad": dict(kernel_size=1, padding=1),  # padded: the general unfold
}


def conv_loss(outputs, targets):
    return (outputs * targets).flatten(1).sum(1) + (outputs ** 2).flatten(1).sum(1)


def check_conv(dims, n=5, c_in=4, c_out=8, **config):
    conv = CONV[dims](c_in, c_out, **config).double()
    x = torch.randn(n, c_in, *SIZE[dims], dtype=torch.float64)
    y = torch.randn_like(conv(x))
    assert_agree(conv, conv_loss, x, y)


@pytest.fixture(params=["unfold", "grouped", "depthwise"])
def route(request, monkeypatch):
    """Run a test once per weight-gradient route of the conv sampler."""
    monkeypatch.setattr(conv_sampler, "ROUTE", request.param)
    return request.param


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_matches_microbatch(dims, name, route):
    torch.manual_seed(dims)
    check_conv(dims, **CONFIGS[name])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_depthwise_conv_matches_microbatch(dims, name, route):
    """One channel per group (groups = C_in = C_out): every route, the depthwise one too."""
    torch.manual_seed(dims)
    check_conv(dims, c_out=4, **dict(CONFIGS[name], groups=4))


def test_auto_route_rule():
    assert conv_sampler.choose_route(nn.Conv2d(3, 8, 3), None) == "unfold"
    assert conv_sampler.choose_route(nn.Conv2d(16, 8, 3), None) == "grouped"
    assert conv_sampler.choose_route(nn.Conv2d(64, 8, 3), None) == "grouped"  # the last grouped
    assert conv_sampler.choose_route(nn.Conv2d(128, 8, 3), None) == "unfold"
    assert conv_sampler.choose_route(nn.Conv2d(32, 8, 1), None) == "unfold"  # 1x1: a bmm
    assert conv_sampler.choose_route(nn.Conv2d(32, 8, 1, stride=2), None) == "unfold"
    depthwise = nn.Conv2d(8, 8, 7, padding=3, groups=8)  # ConvNeXt's
    assert conv_sampler.choose_route(depthwise, torch.zeros(2, 8, 16, 16)) == "depthwise"
    assert conv_sampler.choose_route(depthwise, torch.zeros(2, 8, 1, 1)) == "unfold"
    small = nn.Conv2d(8, 8, 3, padding=1, groups=8)
    assert conv_sampler.choose_route(small, torch.zeros(2, 8, 16, 16)) == "grouped"
    strided = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)  # MobileNet's
    assert conv_sampler.choose_route(strided, torch.zeros(2, 8, 16, 16)) == "depthwise"


def test_a_forced_depthwise_route_leaves_other_layers_to_the_rule(monkeypatch):
    monkeypatch.setattr(conv_sampler, "ROUTE", "depthwise")
    assert conv_sampler.choose_route(nn.Conv2d(16, 8, 3), None) == "grouped"
    assert conv_sampler.choose_route(nn.Conv2d(4, 4, 5, groups=4), None) == "depthwise"


def test_conv_tuple_arguments(route):
    torch.manual_seed(0)
    check_conv(2, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
    check_conv(3, kernel_size=(2, 3, 1), stride=(1, 2, 1), padding=(0, 1, 1))


@settings(max_examples=25, deadline=None)
@given(
    dims=st.sampled_from([1, 2, 3]),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.sampled_from([0, 1, "same"]),
    groups=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    route=st.sampled_from(["unfold", "grouped", "depthwise"]),
)
def test_conv_sweep(dims, k, stride, dilation, padding, groups, bias, route):
    if padding == "same":
        stride = 1  # PyTorch refuses 'same' with stride > 1
    torch.manual_seed(0)
    conv_sampler.ROUTE = route
    try:
        check_conv(dims, n=3, c_in=4, c_out=4, kernel_size=k, stride=stride, dilation=dilation,
                   padding=padding, groups=groups, bias=bias)
    finally:
        conv_sampler.ROUTE = "auto"


def test_cnn_with_pooling_float32():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4),
    )
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 4, (8,))
    assert_agree(model, nn.CrossEntropyLoss(reduction="none"), x, y)


@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 0), ((1, 2), 0), (1, 1), (2, 1)])
def test_unfold_of_a_pointwise_convolution_is_f_unfold(stride, padding):
    """A 1x1 kernel's unfold (a view, or every s-th position; the general route once padded)
    against PyTorch's own im2col, F.unfold, float64, exactly."""
    layer = nn.Conv2d(3, 4, 1, stride=stride, padding=padding).double()
    a = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    want = torch.nn.functional.unfold(a, 1, padding=padding, stride=stride)  # (n, C, L)
    torch.testing.assert_close(conv_sampler.unfold(layer, a), want, rtol=0, atol=0)
