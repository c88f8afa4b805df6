"""Norm samplers for the DP layers' parts: ghost clipping through their linear maps.

Every part of ``parts.py`` is a linear map of its input (or a learned row appended to it), so
its per-sample gradient norm follows the Linear rule of ``rules/linear.py`` (Li,
Tramèr, Liang, Hashimoto 2022, arXiv 2110.05679, §4): with A_i the inputs over T positions
and B_i the backprops,

    ||∂ℓ_i/∂W||² = <A_i A_iᵀ, B_i B_iᵀ> (2T² < pd) or ||B_iᵀ A_i||² (materialised),
    ||∂ℓ_i/∂b||² = ||Σ_t b_{i,t}||²

- InputProjection: the input x over T steps; both RNN/LSTM biases get Σ_t b_t.
- RecurrentProjection: in the one-call form (``recurrence.py``, used whenever hooks record
  the layer) one call on all T previous states, so the rule sees T positions at once; in the
  per-step form its T calls share W_hh and the engine materialises (still exact).
- InProjection: the rule per q / k / v block (separate inputs and weight blocks).
- SequenceBias: the appended row's backprop, ||b_{i,S}||².

Notation: n batch, T positions, A activations, B backprops, W (p, d) weight.
"""

from types import SimpleNamespace

import torch
from torch.nn import Linear

from workbench.clipping.registry import register_norm_sampler
from workbench.layers.parts import InProjection, InputProjection, RecurrentProjection, SequenceBias
from workbench.rules._rule import Route
from workbench.rules.linear import BIAS_ONLY, sequence_route, sequence_view, weight_squared_norms


def _trainable(layer, *names):
    return [getattr(layer, n) for n in names
            if getattr(layer, n, None) is not None and getattr(layer, n).requires_grad]


def linear_part_route(layer, activations) -> tuple[Route, str]:
    a = activations[0]
    if layer.weight is None or not layer.weight.requires_grad:
        return BIAS_ONLY, "the weight is frozen; ||Σ_t b_t||² for the biases"
    p, d = layer.weight.shape
    return sequence_route(a[0].numel() // a.shape[-1], p, d)


def linear_part_squared_norms(layer, a, b, bias_names=("bias",)) -> torch.Tensor:
    A, B = sequence_view(a, b)  # (n, T, d), (n, T, p)
    squares = torch.zeros(A.shape[0], dtype=B.dtype, device=B.device)
    if _trainable(layer, "weight"):
        squares += weight_squared_norms(A, B)
    bias_square = B.sum(1).pow(2).sum(1)  # ||Σ_t b_t||², the same for every bias added
    for _ in _trainable(layer, *bias_names):
        squares += bias_square
    return squares


@register_norm_sampler(InputProjection, route=linear_part_route)
def input_projection_norm_sampler(layer, activations, backprops):
    return linear_part_squared_norms(layer, activations[0], backprops, ("bias", "bias_hh"))


@register_norm_sampler(RecurrentProjection, route=linear_part_route)
def recurrent_projection_norm_sampler(layer, activations, backprops):
    return linear_part_squared_norms(layer, activations[0], backprops)


def block_routes(layer, activations) -> list[Route]:
    """The Linear rule's route of each q, k, v block (inputs (n, L or S, E))."""
    return [sequence_route(a.shape[1], W.shape[0], W.shape[1])[0]
            for a, W in zip(activations, layer.weights())]


def blocks_scratch(layer, call) -> int:
    """Σ over the q, k, v blocks of each block's route's scratch, on that block's call."""
    L, S = call.args[0].shape[1], call.args[1].shape[1]
    total = 0
    for a, b, W, route in zip(call.args, call.backprops.split([L, S, S], dim=1),
                              layer.weights(), block_routes(layer, call.args)):
        block = Linear(W.shape[1], W.shape[0], bias=False, device="meta")  # shapes only
        total += route.scratch(block, SimpleNamespace(args=(a,), backprops=b))
    return total


def in_projection_route(layer, activations) -> tuple[Route, str]:
    if len(activations) == 1:
        return linear_part_route(layer, activations)
    names = "/".join(sorted({route.name for route in block_routes(layer, activations)}))
    return Route(names, blocks_scratch), "the Linear rule per q, k, v block"


@register_norm_sampler(InProjection, route=in_projection_route)
def in_projection_norm_sampler(layer, activations, backprops):
    if len(activations) == 1:  # self-attention: one Linear with the packed weight
        return linear_part_squared_norms(layer, activations[0], backprops)
    L, S = activations[0].shape[1], activations[1].shape[1]
    blocks = backprops.split([L, S, S], dim=1)  # q̄ (n, L, E), k̄, v̄ (n, S, E)
    n = backprops.shape[0]
    squares = torch.zeros(n, dtype=backprops.dtype, device=backprops.device)
    packed = layer.weight is not None
    names = ("weight",) * 3 if packed else ("q_weight", "k_weight", "v_weight")
    for a, b, name in zip(activations, blocks, names):
        if _trainable(layer, name):
            squares += weight_squared_norms(*sequence_view(a, b))
    if _trainable(layer, "bias"):
        squares += sum(b.sum(1).pow(2).sum(1) for b in blocks)  # the 3E bias, block by block
    return squares


ROW = Route("row", lambda layer, call: call.backprops.shape[-1])  # b_{i,S} squared: d numbers


@register_norm_sampler(SequenceBias, route=lambda layer, a: (ROW, "the appended row's b"))
def sequence_bias_norm_sampler(layer, activations, backprops):
    n = backprops.shape[0]
    if not layer.bias.requires_grad:
        return torch.zeros(n, dtype=backprops.dtype, device=backprops.device)
    return backprops[:, -1].pow(2).sum(1)  # ||b_{i,S}||²


__all__ = [
    "in_projection_norm_sampler", "in_projection_route", "input_projection_norm_sampler",
    "linear_part_route", "linear_part_squared_norms", "recurrent_projection_norm_sampler",
    "sequence_bias_norm_sampler",
]
