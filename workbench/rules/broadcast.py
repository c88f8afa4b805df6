"""A parameter broadcast into the batch: ``cls_token.expand(n, -1, -1)``, ``x + pos_embed``.

Vision transformers use some parameters directly in their forward pass, not through a layer
(timm's ``VisionTransformer`` and Hugging Face's ``ViTEmbeddings``: a class token
``torch.cat([cls.expand(n, -1, -1), x], 1)`` and a learned position table ``x + pos``, both
of shape (1, ..., d)). The op's output e carries the batch, p does not: e_i = p broadcast
(``expand``), or h_i = x_i + p (``add``, coefficient 1). So

    ∂ℓ_i/∂p = Σ_{broadcast dims} ∂ℓ_i/∂e_i                 (n, *p.shape)

(``Tensor.sum_to_size``; row i of ∂(Σ_j ℓ_j)/∂e is ∂ℓ_i/∂e_i because samples do not mix, the
assumption of every hook rule), the bias rule of a Linear layer. The use tracker records such
an op as a call of a ``BroadcastParameter`` layer holding p (``per_sample/tied.py``), so the
layer that owns p (the whole model, for timm's ViT) is not run under vmap for it.

A parameter *multiplied* into the batch, a layer scale (timm's ConvNeXt block
``x.mul(gamma.reshape(1, -1, 1, 1))``, ``x * gamma``): h_i = x_i ⊙ v with v = p.reshape(s),

    ∂ℓ_i/∂p = reshape_p( Σ_{broadcast dims} ∂ℓ_i/∂h_i ⊙ x_i )        (n, *p.shape)

recorded as a ``BroadcastProduct`` call on x (its activation). Same sum, of b ⊙ x.

Book-keeping's clipped sum needs no re-run: Σ_i c_i g_i = (c ⊙ b) summed to p's shape.

Notation: n batch, p the parameter, e = the op's output (n, ...), b = ∂(Σ ℓ)/∂e, c_i clip
factor.
"""

import torch

from workbench.clipping.nonfinite import masked
from workbench.per_sample.tied import BroadcastParameter, BroadcastProduct
from workbench.rules._rule import LayerRule, Route, own_gradient_size, register_rule


def per_sample_sum(layer, b: torch.Tensor) -> torch.Tensor:
    """(n, *p.shape): b (n, ...) summed over the dims along which p (as used: a
    ``BroadcastProduct``'s ``shape``) was broadcast."""
    shape = getattr(layer, "shape", None) or tuple(layer.weight.shape)
    n, rest, out = b.shape[0], b.dim() - 1, (b.shape[0], *layer.weight.shape)
    if len(shape) == rest + 1:  # p (1, ...): dim 0 was broadcast to n
        return b.sum_to_size(n, *shape[1:]).reshape(out)
    lead = rest - len(shape)  # p aligned to the right of b's dims 1..
    return b.sum_to_size(n, *[1] * lead, *shape).reshape(out)


def product(layer, activations, b: torch.Tensor, ok=None) -> torch.Tensor:
    """b ⊙ x for a ``BroadcastProduct`` (x its activation (n, ...)), b itself otherwise."""
    if not isinstance(layer, BroadcastProduct):
        return b
    x = activations[0]
    if ok is not None:
        x = masked(x, ok)
    return b * x.to(b.dtype)


def broadcast_grad_sampler(layer, activations, backprops):
    if not layer.weight.requires_grad:
        return {}
    return {"weight": per_sample_sum(layer, product(layer, activations, backprops))}


def broadcast_norm_sampler(layer, activations, backprops):
    g = per_sample_sum(layer, product(layer, activations, backprops))
    return g.reshape(len(g), -1).pow(2).sum(1)  # (n,) ||g_i||²; a 0-d weight's g is (n,)


SUMMED = Route("broadcast sum", own_gradient_size)


def broadcast_route(layer, activations):
    return SUMMED, "the backprop summed over the broadcast dims: P numbers per sample"


def broadcast_weight_grads(layer, call, weighted: torch.Tensor, own: list, ok=None) -> dict:
    """Σ_i c_i g_i: the reweighted backprops (n, ...) summed to p's shape."""
    if not any(p is layer.weight for p in own):
        return {}
    activations = call.args if isinstance(layer, BroadcastProduct) else ()
    b = product(layer, activations, weighted, ok)  # (n, ...) c_i b_i (⊙ x_i)
    return {id(layer.weight): per_sample_sum(layer, b).sum(0)}


RULE = register_rule(LayerRule(
    "parameter broadcast into the batch", (BroadcastParameter, BroadcastProduct),
    grad=broadcast_grad_sampler, norm=broadcast_norm_sampler, route=broadcast_route,
    routes=(SUMMED,), weight_grads=broadcast_weight_grads))


__all__ = [
    "RULE", "SUMMED", "BroadcastParameter", "BroadcastProduct", "product",
    "broadcast_grad_sampler", "broadcast_norm_sampler", "broadcast_route",
    "broadcast_weight_grads", "per_sample_sum",
]
