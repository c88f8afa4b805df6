"""``nn.Conv1d/2d/3d``: unfold the input, then the Linear rule (grad and norm).

A convolution is a matrix product once every receptive field of the input is laid out as a
column ("unfold" or im2col; Opacus blog "Efficient per-sample gradient computation for more
layers", convolution section; Yousefpour et al. 2021, arXiv 2109.12298, Appendix B):

    o_i = W U(a_i) + c            W: (p, C k), U(a_i): (C k, L), o_i: (p, L)
    ∂ℓ_i/∂W = b_i U(a_i)ᵀ         (n, p, C k)   summed over the L output positions
    ∂ℓ_i/∂c = Σ_l b_{i,:,l}       (n, p)

The rule is five files:

- ``conv_geometry``: padding, output positions, the unfold (any D, stride, dilation,
  padding and padding mode);
- ``conv_grads``: the grad rule, by three routes (unfold, one grouped weight-gradient kernel,
  one depthwise forward convolution; ``choose_route``);
- ``conv_gram``: the norm rule, by the Gram route (Li et al. 2022, arXiv 2110.05679, §4;
  U Uᵀ unfolded or from the padded input's shifted Gram, ``gram_way``) or materialised;
- ``conv_chunks``: the batch in chunks whose scratch is at most a quarter of the call's own
  a and b;
- this file: the route report, the bias, book-keeping's fast clipped sum and the rule.

Memory. Book-keeping streams a convolution whose per-sample gradients are smaller than its
a and b (``clipping/bookkeeping.py``, ``smaller_materialised``): a CNN's first, wide-image
layers are materialised in the backward pass and their a and b let go.

Book-keeping's clipped sum (Bu et al. 2023, arXiv 2210.00038, Eq. 3) needs no re-run of the
layer: Σ_i c_i ∂ℓ_i/∂W is the ordinary weight gradient with the backprops c_i b_i, so
``conv_weight_grads`` calls PyTorch's weight-gradient kernel (``convolution_backward``, the
one the user's backward ran) on the stored input and the reweighted backprops, without the
forward re-run and autograd graph of the generic path (``clipping/engine.py``).

Notation: n batch, C input channels, p output channels, k = k_1...k_D kernel size,
L output positions, G groups, a activations (n, C, *spatial), b backprops (n, p, *out).
"""

import sys
import types

import torch
from torch import nn

from workbench.clipping.nonfinite import masked
from workbench.rules import conv_chunks, conv_grads, conv_gram
from workbench.rules._rule import MATERIALISE, LayerRule, register_rule
from workbench.rules.conv_chunks import chunks, scratch_budget, scratch_per_sample
from workbench.rules.conv_geometry import (
    conv_dims,
    conv_padding,
    is_depthwise,
    output_positions,
    pad_input,
    padded_input,
    padded_positions,
    unfold,
)
from workbench.rules.conv_grads import (
    CONV,
    WEIGHT_GRADS,
    choose_route,
    conv_grad_sampler,
    depthwise_weight_grads,
    grouped_weight_grads,
    unfold_weight_grads,
)
from workbench.rules.conv_gram import (
    GRAM,
    gram_scratch,
    gram_squares,
    gram_way,
    input_gram,
    shifted_gram,
    unfolded_gram,
    weight_squares,
)
from workbench.rules.linear import BIAS_ONLY, gram_is_cheaper


def conv_route(layer, activations):
    """(Route, reason): the Gram route, materialising, or the bias alone."""
    if not layer.weight.requires_grad:
        return BIAS_ONLY, "the weight is frozen; ||Σ_l b_l||² for the bias"
    L, p, d = conv_dims(layer, activations[0])
    if gram_is_cheaper(L, p, d):
        return GRAM, f"2L² = {2 * L * L} < pd = {p * d} (L = {L} output positions)"
    return MATERIALISE, f"2L² = {2 * L * L} >= pd = {p * d} (L = {L} output positions)"


def conv_norm_sampler(layer, activations, backprops):
    """Σ over the trainable parameters of ||g_i||² (n,), without the n gradients at once."""
    a = activations[0]
    n = a.shape[0]
    squares = None  # (n,) in b's dtype; no zeros to add to (two ops fewer per call)
    if layer.weight.requires_grad:
        squares = weight_squares(layer, a, backprops).to(backprops.dtype)
    if layer.bias is not None and layer.bias.requires_grad:
        B = backprops.reshape(n, layer.out_channels, -1)  # (n, p, L)
        bias = B.sum(2).pow(2).sum(1)  # ||Σ_l b_l||²
        squares = bias if squares is None else squares.add_(bias)
    if squares is None:
        return torch.zeros(n, dtype=backprops.dtype, device=backprops.device)
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

SETTINGS = {"ROUTE": conv_grads, "GRAM_ROUTE": conv_gram, "SCRATCH": conv_chunks,
            "SCRATCH_SHARE": conv_chunks, "MIN_CHUNK": conv_chunks}
"""Setting name -> the module that reads it: ``conv.ROUTE = 'grouped'`` (or monkeypatch)
sets it there, so the old single-file spelling keeps working."""


def _forwarded(name):
    """A property that reads and writes ``name`` in its home module (``SETTINGS``)."""
    home = SETTINGS[name]
    return property(lambda self: getattr(home, name),
                    lambda self, value: setattr(home, name, value))


class _Settings(types.ModuleType):
    """This module, with its settings read from and written to their homes (``SETTINGS``);
    data descriptors, so ``monkeypatch.setattr`` restores them too."""


for _name in SETTINGS:
    setattr(_Settings, _name, _forwarded(_name))
sys.modules[__name__].__class__ = _Settings

__all__ = [
    "CONV", "GRAM", "RULE", "SETTINGS", "WEIGHT_GRADS",  # and the SETTINGS, through them
    "choose_route", "chunks", "conv_dims", "conv_grad_sampler", "conv_norm_sampler",
    "conv_padding", "conv_route", "conv_weight_grads", "depthwise_weight_grads",
    "gram_scratch", "gram_squares", "gram_way", "grouped_weight_grads", "input_gram",
    "is_depthwise", "output_positions", "pad_input", "padded_input", "padded_positions",
    "scratch_budget", "scratch_per_sample", "shifted_gram", "unfold", "unfold_weight_grads",
    "unfolded_gram", "weight_squares",
]
