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
"""How the Gram route forms U Uᵀ: 'auto' (``gram_way``'s rule), or force 'unfolded',
'shifted' or 'strided' (tests, teaching, benchmarks)."""

OP = 8e-6  # s per small tensor op (dispatch, allocation)
MAC = 0.02e-9  # s per multiply-add of a batched product (U Uᵀ, the padded input's Gram)
ADD = 0.5e-9  # s per number of a strided slice added in place (the shifted loop, the unfold)
STRIDED = 4e-9  # s per number of a reduction over an overlapping strided view
OPS = {"unfolded": 12, "pointwise": 4, "strided": 6}  # the shifted loop: 3 + 2k
"""The cost model of ``gram_way`` (one thread, CPU time, 2-core AMD EPYC shared with other
jobs, 2026-11-30): the three ways' times at n = 16, 3x3 kernels, ms unfolded / shifted loop /
strided view: C = 64 on 8x8: 1.70 / 1.20 / 2.82; C = 32 on 8x8: 0.82 / 0.90 / 2.50; C = 32
on 4x4: 0.25 / 0.28 / 0.22; C = 64 on 2x2: 0.30 / 0.17 / 0.09; C = 32 on 8x8 at stride 2:
0.26 / 0.44 / 0.39; C = 32 on 16x16: 6.3 / 7.5 / 36; C = 64 on 16x16: 13.2 / 10.0 / 39
(the model's order agrees on all but the two near-ties, C = 32 on 4x4 and 16x16). On the
real table's base ResNets (n = 16, 1x1 to 8x8 maps) the per-op cost is most of the time."""


def gram_costs(layer, a: torch.Tensor) -> dict[str, float]:
    """Modelled seconds of each way to form U Uᵀ for the input ``a`` (n, C, *spatial):

        unfolded = 12 OP + n L² C k · MAC / G + n C k L · ADD           (U copied, U Uᵀ)
        shifted  = (3 + 2k) OP + n S² C · MAC / G + n G L² k · ADD      (P, k slices added)
        strided  = 6 OP + n S² C · MAC / G + n G L² k · STRIDED         (P, one reduction)

    A 1x1 kernel without padding unfolds to the input itself (``conv_geometry.unfold``): 4 OP,
    and its copy only at a stride (the base ResNets' 1x1 projections, n = 16, ms unfolded /
    shifted / strided: C = 64 on 2x2 at stride 2: 0.038 / 0.061 / 0.054; C = 32 on 4x4 at
    stride 2: 0.054 / 0.072 / 0.060)."""
    n, C, G = a.shape[0], a.shape[1], layer.groups
    S, L = padded_positions(layer, a.shape[2:]), output_positions(layer, a.shape[2:])
    k = math.prod(layer.kernel_size)
    P = n * S * S * C / G * MAC  # the padded input's Gram
    if k == 1 and S == math.prod(a.shape[2:]):  # a 1x1 kernel, no padding: U is a (strided)
        copy = 0 if set(layer.stride) == {1} else n * C * L * ADD
        unfolded = OPS["pointwise"] * OP + n * L * L * C / G * MAC + copy
    else:
        unfolded = OPS["unfolded"] * OP + n * L * L * C * k / G * MAC + n * C * k * L * ADD
    return {"unfolded": unfolded,
            "shifted": (3 + 2 * k) * OP + P + n * G * L * L * k * ADD,
            "strided": OPS["strided"] * OP + P + n * G * L * L * k * STRIDED}


def gram_way(layer, a: torch.Tensor) -> str:
    """The way of the smallest modelled cost (``gram_costs``): 'unfolded', 'shifted' (the
    padded input's Gram P, its k shifted slices added one by one) or 'strided' (P's k shifted
    slices summed by one reduction of a strided view); ``GRAM_ROUTE`` overrides.

    Until 2026-11-30 the rule was S² < k L² ('shifted', else 'unfolded'): multiply-adds only.
    CPU time of one thread, the CIFAR-10 CNN's Gram-route layers at n = 256 in chunks of 32,
    ms shifted / unfolded: C = 64 on 8x8: 44 / 61; C = 128 on 8x8: 38 / 76; C = 128 on 4x4:
    14 / 37; C = 256 on 4x4: 20 / 68 (the model agrees). At small maps the op count decides:
    the base ResNets' 2x2 and 1x1 layers took the unfolded way at 2-4x the strided view's
    time."""
    if GRAM_ROUTE != "auto":
        return GRAM_ROUTE
    costs = gram_costs(layer, a)
    return min(costs, key=costs.get)


def unfolded_gram(layer, a: torch.Tensor) -> torch.Tensor:
    """U Uᵀ (n, G, L, L) per group, from the unfolded input (n, G, C k / G, L): the slow twin
    of ``shifted_gram``."""
    n, G = a.shape[0], layer.groups
    U = unfold(layer, a).reshape(n, G, -1, output_positions(layer, a.shape[2:]))
    return U.transpose(2, 3) @ U  # (n, G, L, L)


def shifted_gram(layer, a: torch.Tensor, strided: bool = False) -> torch.Tensor:
    """U Uᵀ (n, G, L, L) per group without unfolding: the Gram of the padded input's pixels,
    P[x, y] = Σ_c a_c[x] a_c[y] (n, G, S, S), summed over the kernel offsets u, shifted:

        (U Uᵀ)[l, m] = Σ_u Σ_c a_c[s l + d u] a_c[s m + d u] = Σ_u P[s l + d u, s m + d u]

    (s stride, d dilation, per spatial dim). One (S, C/G) x (C/G, S) product per sample and
    group instead of the (C k / G, L) unfolded copy and its (L, C k / G) x (C k / G, L)
    product: S² C/G against L² C k / G numbers multiplied, about k times fewer at stride 1.

    The sum over u is k slices of P added one by one, or (``strided``) one reduction of a
    strided view of P (``shifted_view``): 2k small ops fewer, each of which cost about as
    much as the product itself at the real table's base ResNets (2x2 and 1x1 maps), but a
    reduction over overlapping memory, several times slower per number where L² k is large
    (``gram_costs``)."""
    n, C, G = a.shape[0], a.shape[1], layer.groups
    a = pad_input(layer, a)  # (n, C, *S_j)
    spatial = a.shape[2:]
    a = a.reshape(n, G, C // G, -1)  # (n, G, C/G, S)
    P = (a.transpose(2, 3) @ a).reshape(n, G, *spatial, *spatial)  # (n, G, *S_j, *S_j)
    view = shifted_view(layer, P)  # (n, G, *L_j, *L_j, *k_j)
    dims = len(spatial)
    L = math.prod(view.shape[2:2 + dims])
    if strided:
        return view.sum(tuple(range(-dims, 0))).reshape(n, G, L, L)  # Σ_u
    UU = None
    for u in itertools.product(*(range(k) for k in layer.kernel_size)):
        part = view[(Ellipsis, *u)]  # P[s l + d u, s m + d u]: (n, G, *L_j, *L_j)
        UU = part.clone() if UU is None else UU.add_(part)
    return UU.reshape(n, G, L, L)


def shifted_view(layer, P: torch.Tensor) -> torch.Tensor:
    """P (n, G, *S_j, *S_j), contiguous, viewed as V (n, G, *L_j, *L_j, *k_j) with
    V[l, m, u] = P[s l + d u, s m + d u] per spatial dim j (an ``as_strided`` view, no copy:
    its entries overlap where windows do). With σ_j and τ_j P's strides of the first and the
    second copy of dim j: l_j steps s_j σ_j, m_j steps s_j τ_j, u_j steps d_j (σ_j + τ_j)."""
    dims = len(layer.kernel_size)
    spatial = P.shape[2:2 + dims]
    sizes = [(size - d * (k - 1) - 1) // st + 1 for size, k, st, d in  # L_j per dim
             zip(spatial, layer.kernel_size, layer.stride, layer.dilation)]
    strides = P.stride()
    first, second = strides[2:2 + dims], strides[2 + dims:]
    shape = (*P.shape[:2], *sizes, *sizes, *layer.kernel_size)
    steps = (*strides[:2], *(s * f for s, f in zip(layer.stride, first)),
             *(s * t for s, t in zip(layer.stride, second)),
             *(d * (f + t) for d, f, t in zip(layer.dilation, first, second)))
    return P.as_strided(shape, steps, P.storage_offset())


def input_gram(layer, a: torch.Tensor) -> torch.Tensor:
    """U Uᵀ (n, G, L, L) by the way ``gram_way`` picks."""
    way = gram_way(layer, a)
    if way == "unfolded":
        return unfolded_gram(layer, a)
    return shifted_gram(layer, a, strided=way == "strided")


def gram_squares(layer, a: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Σ_groups <U Uᵀ, B Bᵀ> (n,) for a (n, C, *spatial), B (n, G, p/G, L) (Li et al. §4)."""
    UU = input_gram(layer, a)  # (n, G, L, L)
    BB = B.transpose(2, 3) @ B  # (n, G, L, L)
    return (UU * BB).sum((1, 2, 3))


def weight_squares(layer, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||∂ℓ_i/∂W||² (n,): the weight-gradient norm, by the Gram route or by materialising,
    chunk by chunk (``chunks``): neither the unfolded input nor all n per-sample gradients
    are ever alive at once. A batch that fits one chunk is normed whole, without the chunks'
    float64 buffer and its writes."""
    n, G = a.shape[0], layer.groups
    B = b.reshape(n, G, layer.out_channels // G, -1)  # (n, G, p/G, L)
    L, p, d = B.shape[-1], B.shape[2], layer.weight.shape[1:].numel()  # shapes: no tensor op
    if gram_is_cheaper(L, p, d):
        S = padded_positions(layer, a.shape[2:])
        # U or P, U Uᵀ, B Bᵀ and their product; the padded input
        per_sample = G * (max(d * L, S * S) + 3 * L * L) + a.shape[1] * S
        norm = lambda part: gram_squares(layer, a[part], B[part])  # noqa: E731
    else:
        route = choose_route(layer, a)
        per_sample = scratch_per_sample(layer, a, route) + layer.weight.numel()  # + its g_i
        norm = lambda part: sample_squares(WEIGHT_GRADS[route](layer, a[part], b[part]))  # noqa: E731
    parts = chunks(n, per_sample, scratch_budget(a, b, per_sample))
    if len(parts) == 1:
        return norm(slice(None)).double()
    squares = a.new_zeros(n, dtype=torch.float64)
    for part in parts:
        squares[part] = norm(part).double()
    return squares


__all__ = ["ADD", "GRAM", "GRAM_ROUTE", "MAC", "OP", "OPS", "STRIDED", "gram_costs",
           "gram_flops", "gram_scratch", "gram_squares", "gram_way", "input_gram",
           "shifted_gram", "shifted_view", "unfolded_gram", "weight_squares"]
