"""Where a convolution reads its input: padding, output positions, and the unfold (im2col).

A convolution is a matrix product once every receptive field of the input is laid out as a
column ("unfold" or im2col; Opacus blog "Efficient per-sample gradient computation for more
layers", convolution section; Yousefpour et al. 2021, arXiv 2109.12298, Appendix B):

    o_i = W U(a_i) + c            W: (p, C k), U(a_i): (C k, L), o_i: (p, L)

Output position l of spatial dim j reads the padded input at s_j l + d_j u for the kernel
offsets u < k_j (s stride, d dilation). ``unfold`` works for any number of spatial dims with
stride, dilation, integer / tuple / 'same' / 'valid' padding and every padding mode (the
non-zero modes pad the input exactly as the layer does, then unfold without padding).

Notation: n batch, C input channels, p output channels, k = k_1...k_D kernel size,
L output positions, G groups, a activations (n, C, *spatial).
"""

import math

import torch
import torch.nn.functional as F


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
    if not any(pads):
        return a  # nothing to pad: ``a`` itself, not F.pad's copy (its callers only read it)
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(a, pads, mode=mode)


def padded_input(layer, a: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The input padded as the layer pads it, or the symmetric padding left for the kernel."""
    pads = conv_padding(layer)
    if layer.padding_mode == "zeros" and all(left == right for left, right in pads):
        return a, [left for left, _ in pads]
    return pad_input(layer, a), [0] * len(pads)


def padded_positions(layer, spatial) -> int:
    """S: the number of positions of the padded input, for an input of size ``spatial``."""
    return math.prod(size + lo + hi for size, (lo, hi) in zip(spatial, conv_padding(layer)))


def output_positions(layer, spatial) -> int:
    """L, the number of output positions for an input of spatial size ``spatial``."""
    L = 1
    for size, k, s, d, (lo, hi) in zip(spatial, layer.kernel_size, layer.stride, layer.dilation,
                                       conv_padding(layer)):
        L *= (size + lo + hi - d * (k - 1) - 1) // s + 1
    return L


def conv_dims(layer, a) -> tuple[int, int, int]:
    """(L, p/G, C k/G): output positions and the per-group Linear sizes."""
    G = layer.groups
    L = output_positions(layer, a.shape[2:])
    return L, layer.out_channels // G, layer.in_channels // G * math.prod(layer.kernel_size)


def unfold(layer, a: torch.Tensor) -> torch.Tensor:
    """Receptive fields of ``a`` as columns: (n, C, *spatial) -> (n, C k_1..k_D, L).

    A 1x1 kernel without padding reads one input position per output position: its unfold
    is the input at every s-th position, a view of ``a`` at stride 1 (a Linear over the
    positions), a copy of the L kept positions otherwise; no window dims, no permute."""
    n, C = a.shape[:2]
    dims = len(layer.kernel_size)
    if math.prod(layer.kernel_size) == 1 and not any(lo or hi for lo, hi in conv_padding(layer)):
        kept = a[(Ellipsis, *(slice(None, None, s) for s in layer.stride))]  # (n, C, *L_j)
        return kept.reshape(n, C, -1)
    a = pad_input(layer, a)
    for axis, (k, s, d) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        a = a.unfold(2 + axis, d * (k - 1) + 1, s)[..., ::d]  # window of span d(k-1)+1, every d-th
    # a: (n, C, L_1..L_D, k_1..k_D) -> (n, C, k_1..k_D, L_1..L_D)
    a = a.permute(0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims))
    return a.reshape(n, C * math.prod(layer.kernel_size), -1)


def is_depthwise(layer) -> bool:
    """One input and one output channel per group: W (C, 1, *k), groups = C."""
    return layer.groups == layer.in_channels == layer.out_channels


__all__ = ["conv_dims", "conv_padding", "is_depthwise", "output_positions", "pad_input",
           "padded_input", "padded_positions", "unfold"]
