"""``nn.Conv1d/2d/3d``: unfold the input, then the Linear rule (grad and norm).

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

The same gradient is also one *grouped* convolution (Rochette, Manoel, Tramel 2019, arXiv
1912.06015, §3): ∂ℓ_i/∂W is the cross-correlation of a_i with b_i, so stacking the n samples
along channels and running PyTorch's weight-gradient kernel with n·G groups gives all of them
at once, without the (n, C k, L) unfolded tensor. A depthwise convolution (one channel per
group) has a third route: the same cross-correlation as one depthwise *forward* convolution
of the inputs with the backprops as kernels (``depthwise_weight_grads``).
``conv_grad_sampler`` picks the route per call (``choose_route``); all three are tested
against micro-batching.

Norm rule. After unfolding (``unfold`` above) a convolution is a Linear layer over
the L output positions: per group, A_i = U(a_i)ᵀ is (L, C k / G) and B_i is (L, p / G), so
(Li et al. 2022, arXiv 2110.05679, §4; the Gram identity of ``rules/linear.py``)

    ||g_i||² = Σ_groups <A_i A_iᵀ, B_i B_iᵀ>    when 2 L² < (p / G)(C k / G)

and otherwise the per-sample weight gradient is materialised by the conv grad sampler,
normed and dropped. For most image convolutions L² is large, so materialising wins; the
Gram route pays off for long 1-d signals with many channels.

Memory. Every per-sample route has scratch several times the call's size (the unfolded
input is k_1...k_D times the input), so the per-sample gradients and the norms run over the
batch in chunks whose scratch is at most a quarter of the call's own a and b
(``scratch_budget``, ``chunks``); the norm of a materialised call is taken chunk by chunk, so
its n per-sample gradients are never alive at once. Book-keeping streams a convolution whose
per-sample gradients are smaller than its a and b (``clipping/bookkeeping.py``,
``smaller_materialised``): a CNN's first, wide-image layers are materialised in the backward
pass and their a and b let go.

Book-keeping's clipped sum (Bu et al. 2023, arXiv 2210.00038, Eq. 3) needs no re-run of the
layer: Σ_i c_i ∂ℓ_i/∂W is the ordinary weight gradient with the backprops c_i b_i, so
``conv_weight_grads`` calls PyTorch's weight-gradient kernel (``convolution_backward``, the
one the user's backward ran) on the stored input and the reweighted backprops, without the
forward re-run and autograd graph of the generic path (``clipping/engine.py``).

Notation: n batch, C input channels, p output channels, k = k_1...k_D kernel size,
L output positions, G groups, a activations (n, C, *spatial), b backprops (n, p, *out).
"""

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.clipping.flat import sample_squares
from workbench.clipping.nonfinite import masked
from workbench.rules._rule import MATERIALISE, LayerRule, Route, register_rule
from workbench.rules.linear import BIAS_ONLY, gram_is_cheaper


def conv_padding(layer) -> list[tuple[int, int]]:
    """(left, right) padding per spatial dim, as the layer's forward applies it."""
    dims = len(layer.kernel_size)
    if layer.padding_mode != "zeros":  # the layer pads with F.pad(mode) itself, then convolves
        flat = layer._reversed_padding_repeated_twice  # last dim first: [l_D, r_D, l_D-1, ...]
        return [(flat[2 * (dims - 1 - i)], flat[2 * (dims - 1 - i) + 1]) for i in range(dims)]
    if layer.padding == "valid":
        return [(0, 0)] * dims
    if layer.padding == "same":  # total d(k-1), the odd extra on the right (as PyTorch)
        totals = [d * (k - 1) for d, k in zip(layer.dilation, layer.kernel_size)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in layer.padding]


def pad_input(layer, a: torch.Tensor) -> torch.Tensor:
    """``a`` padded exactly as the layer pads it (any padding mode)."""
    pads = [side for pair in reversed(conv_padding(layer)) for side in pair]
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(a, pads, mode=mode)


def output_positions(layer, spatial) -> int:
    """L, the number of output positions for an input of spatial size ``spatial``."""
    L = 1
    for size, k, s, d, (lo, hi) in zip(spatial, layer.kernel_size, layer.stride, layer.dilation,
                                       conv_padding(layer)):
        L *= (size + lo + hi - d * (k - 1) - 1) // s + 1
    return L


def unfold(layer, a: torch.Tensor) -> torch.Tensor:
    """Receptive fields of ``a`` as columns: (n, C, *spatial) -> (n, C k_1..k_D, L)."""
    n, C = a.shape[:2]
    dims = len(layer.kernel_size)
    a = pad_input(layer, a)
    for axis, (k, s, d) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        a = a.unfold(2 + axis, d * (k - 1) + 1, s)[..., ::d]  # window of span d(k-1)+1, every d-th
    # a: (n, C, L_1..L_D, k_1..k_D) -> (n, C, k_1..k_D, L_1..L_D)
    a = a.permute(0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims))
    return a.reshape(n, C * math.prod(layer.kernel_size), -1)


def padded_input(layer, a: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The input padded as the layer pads it, or the symmetric padding left for the kernel."""
    pads = conv_padding(layer)
    if layer.padding_mode == "zeros" and all(left == right for left, right in pads):
        return a, [left for left, _ in pads]
    return pad_input(layer, a), [0] * len(pads)


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
    w = torch.einsum("ngpl,ngkl->ngpk", b, U)  # (n, G, p/G, C k / G)
    return w.reshape(n, *layer.weight.shape)


def is_depthwise(layer) -> bool:
    """One input and one output channel per group: W (C, 1, *k), groups = C."""
    return layer.groups == layer.in_channels == layer.out_channels


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


def choose_route(layer, a: torch.Tensor | None) -> str:
    """'unfold', 'grouped' or 'depthwise' for this layer and input (``ROUTE`` overrides;
    a forced 'depthwise' applies to depthwise layers only, the others take the rule).

    Measured on a 2-core CPU (torch 2.13, n = 256, 3x3 kernels, ms unfold / grouped):
    C = 3: 13 / 41; C = 8: 4.5 / 1.9; C = 16: 28 / 9; C = 32: 55 / 20; C = 64 on 8x8:
    50 / 60; C = 128 on 8x8: 137 / 218. PyTorch's grouped weight-gradient kernel wins for
    moderate channel counts and loses when each group is tiny or very wide.

    Depthwise layers (one channel per group), one thread, ms unfold / grouped / depthwise:
    7x7 on 16x16, C = 8, n = 16 (ConvNeXt): 6.3 / 11 / 0.46; 5x5 stride 2 on 16x16, C = 64,
    n = 64: 38 / 32 / 13; 1-d k = 9, L = 64: 0.73 / 4.6 / 0.39; 3x3 stride 1 on 32x32,
    C = 32, n = 64: 217 / 19 / 29; 3x3 on 7x7, C = 256, n = 256: 404 / 25 / 50; 5x5 on a 1x1
    input (one output position, MobileNetV3): 0.17 / 0.60 / 4.5. So: one output position,
    unfold; a 3x3 (or smaller) kernel at stride 1, grouped; else the depthwise convolution.
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
    return "grouped" if 4 < channels < 64 else "unfold"


ROUTE = "auto"
"""'auto' (choose_route's rule), or force 'unfold' / 'grouped' / 'depthwise' (tests,
teaching, benchmarks)."""

GRAM_ROUTE = "unfolded"
"""How the Gram route forms U Uᵀ: 'unfolded' (the default) or 'shifted' (``shifted_gram``:
no unfolded copy, k times fewer multiplications at stride 1, but k^D strided additions of
(L, L) blocks). Measured on the CIFAR-10 CNN's Gram-route layers (2-core CPU, n = 64, ms
shifted / unfolded, a loaded machine): C = 128 on 8x8: 95 / 54; C = 64 on 16x16: 129 / 133;
C = 256 on 4x4: 26 / 35. No clear winner, so the simpler route stays the default."""

SCRATCH = None
"""None: each call's per-sample work runs in chunks whose scratch is at most a quarter of the
call's own a and b (``scratch_budget``, ``chunks``); an int forces that many numbers per
chunk (tests: one-sample and uneven chunks)."""

WEIGHT_GRADS = {"unfold": unfold_weight_grads, "grouped": grouped_weight_grads,
                "depthwise": depthwise_weight_grads}
"""route name -> (layer, a, b) -> (n, *W.shape)."""


def scratch_per_sample(layer, a: torch.Tensor, route: str) -> int:
    """Temporary numbers per sample of one route besides its (C k, p/G) output: the unfolded
    input (C k L) for 'unfold', the weight copy (P) and a padded input for 'grouped', the
    padded input and an over-long output for 'depthwise'."""
    per_input = a[0].numel() if a.shape[0] else 0
    if route == "unfold":
        return layer.weight[0].numel() * layer.groups * output_positions(layer, a.shape[2:])
    if route == "grouped":
        return layer.weight.numel() + 2 * per_input
    return 3 * per_input


def scratch_budget(a: torch.Tensor, b: torch.Tensor, per_sample: int) -> int:
    """Scratch numbers one chunk may use: a quarter of the call's own a and b, all of which
    may still be alive when the norms are taken (book-keeping keeps every call's a and b until
    ``step()``), so the scratch adds at most a quarter to them; at least ``MIN_CHUNK``
    samples' worth, so that a small late layer is not cut into one-sample chunks (the
    CIFAR-10 CNN's last conv at n = 256: 256 chunks of one sample took 4x the time of its
    weight gradient)."""
    return max((a.numel() + b.numel()) // SCRATCH_SHARE, MIN_CHUNK * per_sample)


SCRATCH_SHARE = 4
MIN_CHUNK = 16  # samples
"""The call's a and b over the chunk scratch: CIFAR-10 CNN, one book-keeping step's peak
over plain SGD's (``bench.peak_memory`` after a few steps in one loop), b = 64 / 256:
1.35x / 1.43x with the whole a and b as the budget, 1.31x / 1.38x with a quarter (``bench
training --memory`` reads 1.54x / 1.58x for the same code: its peak step runs after the
interleaved timing, outside the candidates' own function-mode stacks)."""


def chunks(n: int, per_sample: int, budget: int) -> list[slice]:
    """Slices of the batch with at most ``budget`` scratch numbers each (one sample at
    least): the per-sample work runs chunk by chunk, so its scratch is bounded by a share of
    the call's own size (``scratch_budget``), not n times a route's blow-up (the 9x unfolded
    input of a 3x3 kernel)."""
    if SCRATCH is not None:
        budget = SCRATCH
    m = max(1, budget // max(per_sample, 1))
    return [slice(i, min(i + m, n)) for i in range(0, n, m)]


def conv_grad_sampler(layer, activations, backprops):
    a = activations[0]
    out = {}
    if layer.weight.requires_grad:
        n, route = a.shape[0], choose_route(layer, a)
        w = a.new_empty(n, *layer.weight.shape)  # (n, *W.shape), filled chunk by chunk
        per_sample = scratch_per_sample(layer, a, route)
        for part in chunks(n, per_sample, scratch_budget(a, backprops, per_sample)):
            w[part] = WEIGHT_GRADS[route](layer, a[part], backprops[part])
        out["weight"] = w
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = backprops.flatten(2).sum(dim=2)  # (n, p)
    return out


def conv_dims(layer, a) -> tuple[int, int, int]:
    """(L, p/G, C k/G): output positions and the per-group Linear sizes."""
    G = layer.groups
    L = output_positions(layer, a.shape[2:])
    return L, layer.out_channels // G, layer.in_channels // G * math.prod(layer.kernel_size)


def gram_scratch(layer, call) -> int:
    """2·G·L²: the (n, G, L, L) Grams U Uᵀ and B Bᵀ, per sample (an upper bound: the norm
    runs in chunks whose scratch is at most a quarter of the call's a and b, ``chunks``)."""
    return 2 * layer.groups * conv_dims(layer, call.args[0])[0] ** 2


def gram_flops(layer, call) -> int:
    """L²·(C k + p): multiply-adds per sample of the G pairs of (L, L) Grams."""
    L, p, ck = conv_dims(layer, call.args[0])
    return layer.groups * L ** 2 * (ck + p)


GRAM = Route("gram", gram_scratch, flops=gram_flops)
"""Li et al. §4 per group: two (L, L) Grams for each of the G groups."""


def conv_route(layer, activations) -> tuple[Route, str]:
    if not layer.weight.requires_grad:
        return BIAS_ONLY, "the weight is frozen; ||Σ_l b_l||² for the bias"
    L, p, d = conv_dims(layer, activations[0])
    if gram_is_cheaper(L, p, d):
        return GRAM, f"2L² = {2 * L * L} < pd = {p * d} (L = {L} output positions)"
    return MATERIALISE, f"2L² = {2 * L * L} >= pd = {p * d} (L = {L} output positions)"


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

    (s stride, d dilation, per spatial dim; S padded positions). One (S, C/G) x (C/G, S)
    product per sample and group instead of the (C k / G, L) unfolded copy and its
    (L, C k / G) x (C k / G, L) product: S² C/G against L² C k / G numbers multiplied,
    about k times fewer at stride 1."""
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
    L = math.prod(sizes)
    return UU.reshape(n, G, L, L)


def input_gram(layer, a: torch.Tensor) -> torch.Tensor:
    """U Uᵀ (n, G, L, L) by the route ``GRAM_ROUTE`` names."""
    return (shifted_gram if GRAM_ROUTE == "shifted" else unfolded_gram)(layer, a)


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
        S = math.prod(size + lo + hi for size, (lo, hi) in zip(a.shape[2:],
                                                               conv_padding(layer)))
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


def conv_norm_sampler(layer, activations, backprops):
    a = activations[0]
    n = a.shape[0]
    squares = torch.zeros(n, dtype=backprops.dtype, device=backprops.device)
    if layer.weight.requires_grad:
        squares += weight_squares(layer, a, backprops).to(squares.dtype)
    if layer.bias is not None and layer.bias.requires_grad:
        B = backprops.reshape(n, layer.out_channels, -1)  # (n, p, L)
        squares += B.sum(2).pow(2).sum(1)  # ||Σ_l b_l||²
    return squares


def conv_weight_grads(layer, call, weighted: torch.Tensor, own: list, ok=None) -> dict | None:
    """{id(param): Σ_i c_i g_i} for a convolution without its graph: one weight-gradient
    kernel on the stored input a (n, C, *spatial) and ``weighted`` = c ⊙ b (n, p, *out), the
    gradient PyTorch's backward computes with those backprops (Bu et al. 2023, Eq. 3).
    ``ok`` (n,): records to keep when some are non-finite (the others' inputs zeroed). None
    (the generic re-run) for an input without a batch dim."""
    a = call.args[0] if call.args else call.kwargs["input"]
    if a.dim() != len(layer.kernel_size) + 2:
        return None
    if ok is not None:
        a = masked(a, ok)
    want = [any(p is q for p in own) for q in (layer.weight, layer.bias)]
    if not any(want):
        return {}
    a, padding = padded_input(layer, a.to(weighted.dtype))
    W = layer.weight.detach().to(weighted.dtype)
    bias_sizes = [layer.out_channels] if want[1] else None
    _, w, c = torch.ops.aten.convolution_backward(
        weighted, a, W, bias_sizes, list(layer.stride), padding, list(layer.dilation), False,
        [0] * len(padding), layer.groups, [False, want[0], want[1]])
    params = (layer.weight, layer.bias)
    return {id(p): g for p, g, keep in zip(params, (w, c), want) if keep}


RULE = register_rule(LayerRule(
    "convolution", (nn.Conv1d, nn.Conv2d, nn.Conv3d), grad=conv_grad_sampler,
    norm=conv_norm_sampler, route=conv_route, routes=(GRAM, MATERIALISE, BIAS_ONLY),
    weight_grads=conv_weight_grads))


__all__ = [
    "GRAM", "GRAM_ROUTE", "ROUTE", "RULE", "MIN_CHUNK", "SCRATCH", "SCRATCH_SHARE",
    "WEIGHT_GRADS",
    "choose_route", "chunks", "conv_dims", "conv_grad_sampler", "conv_norm_sampler",
    "conv_padding", "conv_route", "conv_weight_grads", "depthwise_weight_grads",
    "gram_scratch", "gram_squares", "grouped_weight_grads", "input_gram", "is_depthwise",
    "output_positions", "pad_input", "padded_input", "scratch_budget", "scratch_per_sample",
    "shifted_gram", "unfold", "unfold_weight_grads", "unfolded_gram", "weight_squares",
]
