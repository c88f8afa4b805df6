"""A convolution's per-sample weight gradients, by three routes (grad rule).

After unfolding (``conv_geometry.unfold``) a convolution is a Linear layer over its L output
positions, so (Yousefpour et al. 2021, arXiv 2109.12298, Appendix B)

    ∂ℓ_i/∂W = b_i U(a_i)ᵀ         (n, p, C k)   summed over the L output positions
    ∂ℓ_i/∂c = Σ_l b_{i,:,l}       (n, p)

With G groups the channels split into G independent convolutions, so the product is taken
per group: (n, G, p/G, L) x (n, G, C k / G, L) -> (n, G, p/G, C k / G).

The same gradient is also one *grouped* convolution (Rochette, Manoel, Tramel 2019, arXiv
1912.06015, §3): ∂ℓ_i/∂W is the cross-correlation of a_i with b_i, so stacking the n samples
along channels and running PyTorch's weight-gradient kernel with n·G groups gives all of them
at once, without the (n, C k, L) unfolded tensor. A depthwise convolution (one channel per
group) has a third route: the same cross-correlation as one depthwise *forward* convolution
of the inputs with the backprops as kernels (``depthwise_weight_grads``).
``choose_route`` picks the route per call; all three are tested against micro-batching.

Notation as in ``rules/conv.py``: n batch, C / p input / output channels, k kernel size
(k_1...k_D), L output positions, G groups, a (n, C, *spatial), b (n, p, *out).
"""

import math

import torch
import torch.nn.functional as F

from workbench.rules.conv_chunks import chunks, scratch_budget, scratch_per_sample
from workbench.rules.conv_geometry import (
    is_depthwise,
    output_positions,
    pad_input,
    padded_input,
    unfold,
)


def grouped_weight_grads(layer, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(n, *W.shape): all samples' weight gradients as one grouped weight-gradient kernel."""
    n, W = a.shape[0], layer.weight
    a, padding = padded_input(layer, a)
    a = a.reshape(1, -1, *a.shape[2:])  # (1, n C, *spatial): sample i = channel block i
    b = b.reshape(1, -1, *b.shape[2:])  # (1, n p, *out)
    W_n = W.detach().unsqueeze(0).expand(n, *W.shape).reshape(n * W.shape[0], *W.shape[1:])
    _, w, _ = torch.ops.aten.convolution_backward(
        b, a, W_n, None, list(layer.stride), padding, list(layer.dilation), False,
        [0] * len(padding), n * layer.groups, [False, True, False])  # (n p, C/G, *k)
    return w.reshape(n, *W.shape)


def unfold_weight_grads(layer, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(n, *W.shape): unfold, then b_i U(a_i)ᵀ per group (the Linear rule)."""
    n, G = a.shape[0], layer.groups
    b = b.reshape(n, G, layer.out_channels // G, -1)  # (n, G, p/G, L)
    U = unfold(layer, a)  # (n, C k, L)
    U = U.reshape(n, G, -1, U.shape[-1])  # (n, G, C k / G, L)
    w = b @ U.transpose(2, 3)  # (n, G, p/G, C k / G): one batched product, no einsum parse
    return w.reshape(n, *layer.weight.shape)


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def depthwise_weight_grads(layer, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(n, C, 1, *k) for a depthwise convolution: one depthwise *forward* convolution.

    Per sample and channel the weight gradient is the cross-correlation of the padded input
    with the backprop (Rochette et al. 2019, §3): for each kernel offset u,

        ∂ℓ_i/∂W_{c,u} = Σ_l b_{i,c,l} a_{i,c, s l + d u}

    which is a convolution of a_{i,c} (input) with b_{i,c} (kernel) at stride d and dilation
    s (the layer's dilation and stride swapped): n·C groups of one channel, PyTorch's
    depthwise kernel, no (n, C k, L) unfolded tensor. Its output can run past k where the
    padded input is longer than the layer's last window reaches: cut to k.
    """
    n, C = a.shape[:2]
    a = pad_input(layer, a)
    dims = len(layer.kernel_size)
    out = CONV[dims](a.reshape(1, n * C, *a.shape[2:]), b.reshape(n * C, 1, *b.shape[2:]),
                     stride=layer.dilation, dilation=layer.stride, groups=n * C)
    out = out[(0, slice(None), *(slice(0, k) for k in layer.kernel_size))]  # (n C, *k)
    return out.reshape(n, C, 1, *layer.kernel_size)


ROUTE = "auto"
"""'auto' (choose_route's rule), or force 'unfold' / 'grouped' / 'depthwise' (tests,
teaching, benchmarks)."""

WEIGHT_GRADS = {"unfold": unfold_weight_grads, "grouped": grouped_weight_grads,
                "depthwise": depthwise_weight_grads}
"""route name -> (layer, a, b) -> (n, *W.shape)."""


def choose_route(layer, a: torch.Tensor | None) -> str:
    """'unfold', 'grouped' or 'depthwise' for this layer and input (``ROUTE`` overrides;
    a forced 'depthwise' applies to depthwise layers only, the others take the rule).

    Measured on a 2-core CPU (torch 2.13, n = 256, 3x3 kernels, ms unfold / grouped, whole
    batch): C = 3: 13 / 41; C = 8: 4.5 / 1.9; C = 16: 28 / 9; C = 32: 55 / 20; C = 64 on 8x8:
    50 / 60; C = 128 on 8x8: 137 / 218. In the chunks the norms run in (``conv_chunks``),
    CPU time of one thread, the CIFAR-10 CNN's layers at n = 256, ms unfold / grouped, two
    rounds: C = 3: 35 / 33; C = 32 on 32x32: 202, 176 / 155, 137; C = 32 on 16x16: 101, 100
    / 79, 73; C = 64 on 16x16: 168, 155 / 144, 112. PyTorch's grouped weight-gradient kernel
    wins for moderate channel counts (up to 64) and loses when each group is tiny or wider.

    Depthwise layers (one channel per group), one thread, ms unfold / grouped / depthwise:
    7x7 on 16x16, C = 8, n = 16 (ConvNeXt): 6.3 / 11 / 0.46; 5x5 stride 2 on 16x16, C = 64,
    n = 64: 38 / 32 / 13; 1-d k = 9, L = 64: 0.73 / 4.6 / 0.39; 3x3 stride 1 on 32x32,
    C = 32, n = 64: 217 / 19 / 29; 3x3 on 7x7, C = 256, n = 256: 404 / 25 / 50; 5x5 on a 1x1
    input (one output position, MobileNetV3): 0.17 / 0.60 / 4.5. So: one output position,
    unfold; a 3x3 (or smaller) kernel at stride 1, grouped; else the depthwise convolution.

    1x1 kernels (BiT's and ResNet bottlenecks' projections), one thread, ms unfold / grouped,
    best of three (2026-11-29): n = 16, C = 32 -> 8 on 8x8: 0.29 / 0.79; C = 8 -> 32 on 8x8:
    0.22 / 0.32; C = 64 -> 16 on 4x4: 0.15 / 0.29; C = 32 -> 64 at stride 2: 0.14 / 0.26;
    n = 256, C = 64 -> 64 on 8x8: 7.6 / 8.6. There the unfold is the input itself: unfold.
    """
    depthwise = is_depthwise(layer)
    if ROUTE != "auto" and (ROUTE != "depthwise" or depthwise):
        return ROUTE
    if depthwise and a is not None:
        if output_positions(layer, a.shape[2:]) == 1:
            return "unfold"
        small = math.prod(layer.kernel_size) <= 3 ** len(layer.kernel_size)
        return "grouped" if small and set(layer.stride) == {1} else "depthwise"
    channels = layer.in_channels // layer.groups
    if math.prod(layer.kernel_size) == 1:
        return "unfold"  # a 1x1 kernel: the unfold is a view (or a strided copy), then a bmm
    return "grouped" if 4 < channels <= 64 else "unfold"


def conv_grad_sampler(layer, activations, backprops):
    """{'weight': (n, *W.shape), 'bias': (n, p)}: the grad rule, chunk by chunk."""
    a = activations[0]
    out = {}
    if layer.weight.requires_grad:
        n, route = a.shape[0], choose_route(layer, a)
        per_sample = scratch_per_sample(layer, a, route)
        parts = chunks(n, per_sample, scratch_budget(a, backprops, per_sample))
        if len(parts) == 1:  # the whole batch at once: the route's own output, no copy
            out["weight"] = WEIGHT_GRADS[route](layer, a, backprops).contiguous()
        else:
            w = a.new_empty(n, *layer.weight.shape)  # (n, *W.shape), filled chunk by chunk
            for part in parts:
                w[part] = WEIGHT_GRADS[route](layer, a[part], backprops[part])
            out["weight"] = w
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = backprops.flatten(2).sum(dim=2)  # (n, p)
    return out


__all__ = ["CONV", "ROUTE", "WEIGHT_GRADS", "choose_route", "conv_grad_sampler",
           "depthwise_weight_grads", "grouped_weight_grads", "unfold_weight_grads"]
