"""Norm sampler for ``nn.Conv1d/2d/3d``: unfold, then the Linear rule.

After unfolding (``per_sample.samplers.conv.unfold``) a convolution is a Linear layer over
the L output positions: per group, A_i = U(a_i)ᵀ is (L, C k / G) and B_i is (L, p / G), so
(Li et al. 2022, arXiv 2110.05679, §4; the Gram identity of ``norms/linear.py``)

    ||g_i||² = Σ_groups <A_i A_iᵀ, B_i B_iᵀ>    when 2 L² < (p / G)(C k / G)

and otherwise the per-sample weight gradient is materialised by the conv grad sampler,
normed and dropped. For most image convolutions L² is large, so materialising wins; the
Gram route pays off for long 1-d signals with many channels.

Notation: n batch, L output positions, C in / p out channels, k kernel size, G groups.
"""

import math

import torch
from torch import nn

from workbench.clipping.flat import sample_squares
from workbench.clipping.norms.linear import gram_is_cheaper
from workbench.clipping.registry import register_norm_sampler
from workbench.per_sample.samplers.conv import conv_grad_sampler, output_positions, unfold


def conv_dims(layer, a) -> tuple[int, int, int]:
    """(L, p/G, C k/G): output positions and the per-group Linear sizes."""
    G = layer.groups
    L = output_positions(layer, a.shape[2:])
    return L, layer.out_channels // G, layer.in_channels // G * math.prod(layer.kernel_size)


def conv_route(layer, activations) -> tuple[str, str]:
    if not layer.weight.requires_grad:
        return "bias only", "the weight is frozen; ||Σ_l b_l||² for the bias"
    L, p, d = conv_dims(layer, activations[0])
    if gram_is_cheaper(L, p, d):
        return "gram", f"2L² = {2 * L * L} < pd = {p * d} (L = {L} output positions)"
    return "materialise", f"2L² = {2 * L * L} >= pd = {p * d} (L = {L} output positions)"


@register_norm_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d, route=conv_route)
def conv_norm_sampler(layer, activations, backprops):
    a = activations[0]
    n, G = a.shape[0], layer.groups
    B = backprops.reshape(n, G, layer.out_channels // G, -1)  # (n, G, p/G, L)
    squares = torch.zeros(n, dtype=B.dtype, device=B.device)
    if layer.weight.requires_grad:
        L, p, d = B.shape[-1], B.shape[2], layer.weight[0].numel()
        if gram_is_cheaper(L, p, d):
            U = unfold(layer, a).reshape(n, G, -1, L)  # (n, G, C k / G, L)
            UU = torch.einsum("ngkl,ngkm->nglm", U, U)  # (n, G, L, L)
            BB = torch.einsum("ngpl,ngpm->nglm", B, B)  # (n, G, L, L)
            squares += (UU * BB).sum((1, 2, 3))
        else:
            w = conv_grad_sampler(layer, activations, backprops)["weight"]
            squares += sample_squares(w)
    if layer.bias is not None and layer.bias.requires_grad:
        squares += B.sum(3).pow(2).sum((1, 2))  # ||Σ_l b_l||²
    return squares


__all__ = ["conv_dims", "conv_norm_sampler", "conv_route"]
