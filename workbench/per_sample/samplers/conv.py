"""Grad sampler for ``nn.Conv1d/2d/3d``: unfold the input, then the Linear rule.

A convolution is a matrix product once every receptive field of the input is laid out as a
column ("unfold" or im2col; Opacus blog "Efficient per-sample gradient computation for more
layers", convolution section; Yousefpour et al. 2021, arXiv 2109.12298, Appendix B):

    o_i = W U(a_i) + c            W: (p, C k), U(a_i): (C k, L), o_i: (p, L)
    ∂ℓ_i/∂W = b_i U(a_i)ᵀ         (n, p, C k)   summed over the L output positions
    ∂ℓ_i/∂c = Σ_l b_{i,:,l}       (n, p)

With G groups the channels split into G independent convolutions, so the product is taken
per group: (n, G, p/G, L) x (n, G, C k / G, L) -> (n, G, p/G, C k / G).

``unfold`` below works for any number of spatial dims with stride, dilation, integer / tuple /
'same' / 'valid' padding and every padding mode (the non-zero modes pad the input exactly as
the layer does, then unfold without padding).

Notation: n batch, C input channels, p output channels, k = k_1...k_D kernel size,
L output positions, G groups, a activations (n, C, *spatial), b backprops (n, p, *out).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.per_sample.registry import register_grad_sampler


def conv_padding(layer) -> list[tuple[int, int]]:
    """(left, right) zero padding per spatial dim, as the layer's forward applies it."""
    dims = len(layer.kernel_size)
    if layer.padding_mode != "zeros":  # the layer pads with F.pad itself, then convolves
        return [(0, 0)] * dims
    if layer.padding == "valid":
        return [(0, 0)] * dims
    if layer.padding == "same":  # total d(k-1), the odd extra on the right (as PyTorch)
        totals = [d * (k - 1) for d, k in zip(layer.dilation, layer.kernel_size)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in layer.padding]


def unfold(layer, a: torch.Tensor) -> torch.Tensor:
    """Receptive fields of ``a`` as columns: (n, C, *spatial) -> (n, C k_1..k_D, L)."""
    n, C = a.shape[:2]
    dims = len(layer.kernel_size)
    if layer.padding_mode != "zeros":
        a = F.pad(a, layer._reversed_padding_repeated_twice, mode=layer.padding_mode)
    pads = [side for pair in reversed(conv_padding(layer)) for side in pair]
    a = F.pad(a, pads)
    for axis, (k, s, d) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        a = a.unfold(2 + axis, d * (k - 1) + 1, s)[..., ::d]  # window of span d(k-1)+1, every d-th
    # a: (n, C, L_1..L_D, k_1..k_D) -> (n, C, k_1..k_D, L_1..L_D)
    a = a.permute(0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims))
    return a.reshape(n, C * math.prod(layer.kernel_size), -1)


@register_grad_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_grad_sampler(layer, activations, backprops):
    a = activations[0]
    n, G = a.shape[0], layer.groups
    b = backprops.reshape(n, G, layer.out_channels // G, -1)  # (n, G, p/G, L)
    out = {}
    if layer.weight.requires_grad:
        U = unfold(layer, a)  # (n, C k, L)
        U = U.reshape(n, G, -1, U.shape[-1])  # (n, G, C k / G, L)
        w = torch.einsum("ngpl,ngkl->ngpk", b, U)  # (n, G, p/G, C k / G)
        out["weight"] = w.reshape(n, *layer.weight.shape)
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = b.sum(dim=3).reshape(n, -1)  # (n, p)
    return out
