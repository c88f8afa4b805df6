"""Book-keeping's conv fast path (``rules/conv.py: conv_weight_grads``) equals autograd's weight
gradient of the layer re-run with the backprops c ⊙ b (float64, <= 1e-12), for every padding
mode, groups, stride, dilation, 1-3 spatial dims, frozen parts, and non-finite records."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from workbench.clipping.nonfinite import masked
from workbench.rules.conv import conv_weight_grads

LAYERS = [
    nn.Conv1d(4, 6, 3, padding=1),
    nn.Conv1d(2, 3, 3, stride=2, dilation=2),
    nn.Conv2d(3, 4, 3, padding="same"),
    nn.Conv2d(4, 6, 2, groups=2, dilation=2, padding_mode="reflect", padding=1),
    nn.Conv2d(6, 6, 3, groups=6, padding=1, padding_mode="circular"),  # depthwise
    nn.Conv2d(4, 4, (3, 1), stride=(2, 1), padding=(2, 0), bias=False),
    nn.Conv3d(2, 4, 2, padding_mode="replicate", padding=1),
]


def reference(layer, a, weighted, own):
    """Autograd on the re-run layer: Σ_i c_i g_i with backprops c ⊙ b."""
    out = layer(a)
    grads = torch.autograd.grad(out, own, grad_outputs=weighted)
    return {id(p): g for p, g in zip(own, grads)}


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: repr(layer))
@pytest.mark.parametrize("frozen", [None, "weight", "bias"])
def test_conv_weight_grads_equal_autograd_on_the_re_run_layer(layer, frozen):
    torch.manual_seed(0)
    layer = layer.double()
    n, dims = 5, len(layer.kernel_size)
    a = torch.randn(n, layer.in_channels, *[7 - d for d in range(dims)], dtype=torch.float64)
    weighted = torch.randn_like(layer(a))  # c_i b_i
    own = [p for name, p in layer.named_parameters() if name != frozen]
    got = conv_weight_grads(layer, SimpleNamespace(args=(a,), kwargs={}), weighted, own)
    want = reference(layer, a, weighted, own) if own else {}  # nothing trainable: nothing
    assert set(got) == set(want)
    for key, g in want.items():
        assert torch.allclose(got[key], g, rtol=1e-12, atol=1e-12)


def test_conv_weight_grads_drop_non_finite_records():
    """A record with NaN in its input (its backprop masked to 0): the others' sum, no NaN."""
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, 3, padding=1).double()
    a = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    a[2, 1, 2, 2] = float("nan")
    ok = torch.tensor([True, True, False, True])
    weighted = masked(torch.randn(4, 4, 5, 5, dtype=torch.float64), ok)
    own = list(layer.parameters())
    got = conv_weight_grads(layer, SimpleNamespace(args=(a,), kwargs={}), weighted, own, ok)
    want = reference(layer, a[ok], weighted[ok], own)
    for key, g in want.items():
        assert torch.isfinite(got[key]).all()
        assert torch.allclose(got[key], g, rtol=1e-12, atol=1e-12)


def test_unbatched_input_takes_the_generic_re_run():
    layer = nn.Conv1d(2, 3, 3).double()
    a = torch.randn(2, 7, dtype=torch.float64)  # (C, L): no batch dim
    call = SimpleNamespace(args=(a,), kwargs={})
    assert conv_weight_grads(layer, call, torch.randn(3, 5, dtype=torch.float64),
                             list(layer.parameters())) is None
