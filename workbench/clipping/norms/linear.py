"""Norm sampler for ``nn.Linear``: the per-sample gradient norm without the gradient.

For one position per sample (a_i: (d,), b_i: (p,)), g_i = b_i a_iᵀ has rank one and

    ||g_i||² = ||b_i||² ||a_i||²                        Goodfellow 2015, arXiv 1510.01799

For T positions (A_i: (T, d), B_i: (T, p)), g_i = B_iᵀ A_i and ("ghost norm", Li, Tramèr,
Liang, Hashimoto 2022, arXiv 2110.05679, §4, Eq. 4)

    ||g_i||² = tr(A_iᵀ B_i B_iᵀ A_i) = <A_i A_iᵀ, B_i B_iᵀ>_F      two (T, T) Gram matrices

The Gram route stores 2T² numbers per sample, materialising g_i stores p·d; we take the
Gram route exactly when 2T² < p·d, per layer and per call (``linear_route`` says which and
why). The bias gradient Σ_t b_{i,t} is always cheap: ||Σ_t b_{i,t}||².

A Linear stored input-first (o = a W + c, GPT-2's ``Conv1D``) has the transposed gradient,
of the same norm: the same rule (``transposed_linear_norm_sampler``).

Notation: n batch, T positions, a activations (n, T, d), b backprops (n, T, p).
"""

import torch
from torch import nn

from workbench.clipping.registry import register_norm_by_behaviour, register_norm_sampler
from workbench.per_sample.samplers.linear import is_transposed_linear


def gram_is_cheaper(T: int, p: int, d: int) -> bool:
    """The ghost-clipping rule: two (T, T) Grams are smaller than one (p, d) gradient."""
    return 2 * T * T < p * d


def sequence_view(a: torch.Tensor, b: torch.Tensor):
    """(n, ..., d), (n, ..., p) -> (n, T, d), (n, T, p)."""
    n = a.shape[0]
    return a.reshape(n, -1, a.shape[-1]), b.reshape(n, -1, b.shape[-1])


def sequence_route(T: int, p: int, d: int) -> tuple[str, str]:
    """The route ``weight_squared_norms`` takes for T positions and a (p, d) weight, and why."""
    if T == 1:
        return "norm product", "one position per sample: ||g_i|| = ||b_i|| ||a_i|| (Goodfellow)"
    if gram_is_cheaper(T, p, d):
        return "gram", f"2T² = {2 * T * T} < pd = {p * d}: (T, T) Grams are smaller"
    return "materialise", f"2T² = {2 * T * T} >= pd = {p * d}: the (p, d) gradient is smaller"


def linear_route(layer, activations) -> tuple[str, str]:
    a = activations[0]
    if not layer.weight.requires_grad:
        return "bias only", "the weight is frozen; ||Σ_t b_t||² for the bias"
    p, d = layer.weight.shape
    return sequence_route(a[0].numel() // a.shape[-1], p, d)


def weight_squared_norms(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """||B_iᵀ A_i||²_F for (n, T, d), (n, T, p), by the cheaper route. Returns (n,)."""
    n, T, d = A.shape
    p = B.shape[-1]
    if T == 1:
        return A.pow(2).sum((1, 2)) * B.pow(2).sum((1, 2))  # ||a_i||² ||b_i||²
    if gram_is_cheaper(T, p, d):
        AA = torch.bmm(A, A.transpose(1, 2))  # (n, T, T)
        BB = torch.bmm(B, B.transpose(1, 2))  # (n, T, T)
        return (AA * BB).sum((1, 2))  # <A Aᵀ, B Bᵀ>  Li et al. Eq. 4
    return torch.bmm(B.transpose(1, 2), A).pow(2).sum((1, 2))  # (n, p, d), normed, dropped


@register_norm_sampler(nn.Linear, route=linear_route)
def linear_norm_sampler(layer, activations, backprops):
    A, B = sequence_view(activations[0], backprops)
    squares = torch.zeros(A.shape[0], dtype=B.dtype, device=B.device)
    if layer.weight.requires_grad:
        squares += weight_squared_norms(A, B)
    if layer.bias is not None and layer.bias.requires_grad:
        squares += B.sum(1).pow(2).sum(1)  # ||Σ_t b_t||²
    return squares


def transposed_route(layer, activations) -> tuple[str, str]:
    if not layer.weight.requires_grad:
        return "bias only", "the weight is frozen; ||Σ_t b_t||² for the bias"
    d, p = layer.weight.shape
    return sequence_route(activations[0][0].numel() // d, p, d)


@register_norm_by_behaviour(is_transposed_linear, route=transposed_route)
def transposed_linear_norm_sampler(layer, activations, backprops):
    """o = a W + c (GPT-2's Conv1D): ||A_iᵀ B_i|| = ||B_iᵀ A_i||, the same rule."""
    return linear_norm_sampler(layer, activations, backprops)


__all__ = [
    "gram_is_cheaper", "linear_norm_sampler", "linear_route", "sequence_route", "sequence_view",
    "transposed_linear_norm_sampler", "transposed_route", "weight_squared_norms",
]
