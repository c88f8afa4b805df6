"""A convolution's per-sample weight-gradient norm (norm rule): the Gram route or materialised.

After unfolding (``conv_geometry.unfold``) a convolution is a Linear layer over the L output
positions: per group, A_i = U(a_i)ᵀ is (L, C k / G) and B_i is (L, p / G), so (Li et al.
2022, arXiv 2110.05679, §4; the Gram identity of ``rules/linear.py``)

    ||g_i||² = Σ_groups <A_i A_iᵀ, B_i B_iᵀ>    when 2 L² < (p / G)(C k / G)

and otherwise the per-sample weight gradient is materialised by a grad-rule route
(``conv_grads``), normed and dropped. For most early image convolutions L² is large, so
materialising wins; the Gram route pays off for small late feature maps with many channels
and for long 1-d signals with many channels.

U Uᵀ itself has two ways (``gram_way``): from the unfolded copy, (C k / G) L² multiplications
per group, or from the Gram of the padded input's S positions, P = aᵀ a, (C / G) S², summed
over the k kernel offsets, shifted (``shifted_gram``). At stride 1 S ≈ L, so the shifted way
is about k times cheaper; a stride s makes L about s^D times smaller than S, and unfolding
wins.

Notation: n batch, C input channels, p output channels, k = k_1...k_D kernel size,
L output positions, S padded input positions, G groups, a activations (n, C, *spatial),
b backprops (n, p, *out).
"""

import itertools
import math

import torch

from workbench.clipping.flat import sample_squares
from workbench.rules._rule import Route
from workbench.rules.conv_chunks import chunks, scratch_budget, scratch_per_sample
from workbench.rules.conv_geometry import (
    conv_dims,
    output_positions,
    pad_input,
    padded_positions,
    unfold,
)
from workbench.rules.conv_grads import WEIGHT_GRADS, choose_route
from workbench.rules.linear import gram_is_cheaper


def gram_scratch(layer, call) -> int:
    """2·G·L²: the (n, G, L, L) Grams U Uᵀ and B Bᵀ, per sample (an upper bound: the norm
    runs in chunks whose scratch is at most a quarter of the call's a and b, ``chunks``)."""
    return 2 * layer.groups * conv_dims(layer, call.args[0])[0] ** 2


def gram_flops(layer, call) -> int:
    """L²·(C k + p): multiply-adds per sample of the G pairs of (L, L) Grams (the unfolded way;
    an upper bound where ``gram_way`` picks the shifted one)."""
    L, p, ck = conv_dims(layer, call.args[0])
    return layer.groups * L ** 2 * (ck + p)


GRAM = Route("gram", gram_scratch, flops=gram_flops)
"""Li et al. §4 per group: two (L, L) Grams for each of the G groups."""

GRAM_ROUTE = "auto"
"""How the Gram route forms U Uᵀ: 'auto' (``gram_way``'s rule), or force 'unfolded' or
'shifted' (tests, teaching, benchmarks)."""


def gram_way(layer, a: torch.Tensor) -> str:
    """'shifted' when the padded input's Gram is the smaller product, S² < k L² (both times
    C / G multiplications), else 'unfolded' (``GRAM_ROUTE`` overrides).

    CPU time of one thread, the CIFAR-10 CNN's Gram-route layers at n = 256 in chunks of 32,
    ms shifted / unfolded: C = 64 on 8x8: 44 / 61; C = 128 on 8x8: 38 / 76; C = 128 on 4x4:
    14 / 37; C = 256 on 4x4: 20 / 68 (S² / k L² = 0.27, 0.27, 0.56, 0.56)."""
    if GRAM_ROUTE != "auto":
        return GRAM_ROUTE
    S, L = padded_positions(layer, a.shape[2:]), output_positions(layer, a.shape[2:])
    return "shifted" if S * S < math.prod(layer.kernel_size) * L * L else "unfolded"


def unfolded_gram(layer, a: torch.Tensor) -> torch.Tensor:
    """U Uᵀ (n, G, L, L) per group, from the unfolded input (n, G, C k / G, L): the slow twin
    of ``shifted_gram``."""
    n, G = a.shape[0], layer.groups
    U = unfold(layer, a).reshape(n, G, -1, output_positions(layer, a.shape[2:]))
    return torch.einsum("ngkl,ngkm->nglm", U, U)


def shifted_gram(layer, a: torch.Tensor) -> torch.Tensor:
    """U Uᵀ (n, G, L, L) per group without unfolding: the Gram of the padded input's pixels,
    P[x, y] = Σ_c a_c[x] a_c[y] (n, G, S, S), summed over the kernel offsets u, shifted:

        (U Uᵀ)[l, m] = Σ_u Σ_c a_c[s l + d u] a_c[s m + d u] = Σ_u P[s l + d u, s m + d u]

    (s stride, d dilation, per spatial dim). One (S, C/G) x (C/G, S) product per sample and
    group instead of the (C k / G, L) unfolded copy and its (L, C k / G) x (C k / G, L)
    product: S² C/G against L² C k / G numbers multiplied, about k times fewer at stride 1."""
    n, C, G = a.shape[0], a.shape[1], layer.groups
    a = pad_input(layer, a)  # (n, C, *S_j)
    spatial = a.shape[2:]
    a = a.reshape(n, G, C // G, -1)  # (n, G, C/G, S)
    P = (a.transpose(2, 3) @ a).reshape(n, G, *spatial, *spatial)  # (n, G, *S_j, *S_j)
    sizes = [(size - d * (k - 1) - 1) // st + 1 for size, k, st, d in  # L_j per dim
             zip(spatial, layer.kernel_size, layer.stride, layer.dilation)]
    UU = None
    for u in itertools.product(*(range(k) for k in layer.kernel_size)):
        at = tuple(slice(d * o, d * o + st * (m - 1) + 1, st) for o, d, st, m in
                   zip(u, layer.dilation, layer.stride, sizes))  # s l + d u, l < L_j
        part = P[(slice(None), slice(None), *at, *at)]  # (n, G, *L_j, *L_j)
        UU = part.clone() if UU is None else UU.add_(part)
    return UU.reshape(n, G, math.prod(sizes), math.prod(sizes))


def input_gram(layer, a: torch.Tensor) -> torch.Tensor:
    """U Uᵀ (n, G, L, L) by the way ``gram_way`` picks."""
    return (shifted_gram if gram_way(layer, a) == "shifted" else unfolded_gram)(layer, a)


def gram_squares(layer, a: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Σ_groups <U Uᵀ, B Bᵀ> (n,) for a (n, C, *spatial), B (n, G, p/G, L) (Li et al. §4)."""
    UU = input_gram(layer, a)  # (n, G, L, L)
    BB = B.transpose(2, 3) @ B  # (n, G, L, L)
    return (UU * BB).sum((1, 2, 3))


def weight_squares(layer, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||∂ℓ_i/∂W||² (n,): the weight-gradient norm, by the Gram route or by materialising,
    chunk by chunk (``chunks``): neither the unfolded input nor all n per-sample gradients
    are ever alive at once."""
    n, G = a.shape[0], layer.groups
    B = b.reshape(n, G, layer.out_channels // G, -1)  # (n, G, p/G, L)
    L, p, d = B.shape[-1], B.shape[2], layer.weight[0].numel()
    squares = a.new_zeros(n, dtype=torch.float64)
    if gram_is_cheaper(L, p, d):
        S = padded_positions(layer, a.shape[2:])
        # U or P, U Uᵀ, B Bᵀ and their product; the padded input
        per_sample = G * (max(d * L, S * S) + 3 * L * L) + a[0].numel() * S // a[0, 0].numel()
        for part in chunks(n, per_sample, scratch_budget(a, b, per_sample)):
            squares[part] = gram_squares(layer, a[part], B[part]).double()
        return squares
    route = choose_route(layer, a)
    per_sample = scratch_per_sample(layer, a, route) + layer.weight.numel()  # + its g_i
    for part in chunks(n, per_sample, scratch_budget(a, b, per_sample)):
        squares[part] = sample_squares(WEIGHT_GRADS[route](layer, a[part], b[part]))
    return squares


__all__ = ["GRAM", "GRAM_ROUTE", "gram_flops", "gram_scratch", "gram_squares", "gram_way",
           "input_gram", "shifted_gram", "unfolded_gram", "weight_squares"]
