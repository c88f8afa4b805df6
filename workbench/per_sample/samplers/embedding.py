"""Grad sampler for ``nn.Embedding``: a one-hot matmul, done as a scatter-add.

An embedding is a Linear layer applied to one-hot rows: o_t = Wᵀ e_{x_t}, so by the Linear
rule (Yousefpour et al. 2021, arXiv 2109.12298, Eq. 5; Opacus blog "Efficient per-sample
gradient computation for more layers", embedding section)

    ∂ℓ_i/∂W = Σ_t e_{x_{i,t}} b_{i,t}ᵀ            (n, V, d)

i.e. row v of sample i's gradient is the sum of b_{i,t} over the positions t where x_{i,t} = v.
Building the one-hot matrix costs O(n T V); we add b_{i,t} straight into row (i, x_{i,t}) of a
zero tensor instead, so the cost beyond writing the (n, V, d) output is O(n T d).
Positions equal to ``padding_idx`` contribute nothing, as in PyTorch's own backward.

Notation: n batch, T tokens per sample, V vocabulary size, d embedding dim, x indices (n, T),
b backprops (n, T, d).
"""

import torch
from torch import nn

from workbench.errors import UnsupportedLayerError
from workbench.per_sample.memory import zeros_per_sample
from workbench.per_sample.registry import register_grad_sampler


def check_embedding(layer: nn.Embedding) -> None:
    """Options whose per-sample gradient is not the rule above raise before any work."""
    for option, value, why in (
        ("sparse", layer.sparse, "per-sample gradients are dense (n, V, d) tensors"),
        ("scale_grad_by_freq", layer.scale_grad_by_freq,
         "the batch's token frequencies would mix samples"),
        ("max_norm", layer.max_norm is not None,
         "it renormalises the weight in place during the forward pass"),
    ):
        if value:
            raise UnsupportedLayerError(
                f"nn.Embedding with {option}={getattr(layer, option)!r} is not supported for "
                f"per-sample gradients ({why}); construct the Embedding without {option}")


def token_rows(layer, activations, backprops):
    """Each token's backprop and its row of the stacked (n V, d) per-sample gradients.

    Returns keys (n T,) = i V + x_{i,t} and b (n T, d), with padding tokens' b set to 0.
    """
    x = activations[0]
    n = x.shape[0]
    V, d = layer.weight.shape
    x = x.reshape(n, -1)  # (n, T)
    b = backprops.reshape(n, -1, d)  # (n, T, d)
    if layer.padding_idx is not None:
        b = b.masked_fill((x == layer.padding_idx).unsqueeze(-1), 0.0)
    keys = (torch.arange(n, device=x.device).unsqueeze(1) * V + x).reshape(-1)  # in [0, nV)
    return keys, b.reshape(-1, d)


@register_grad_sampler(nn.Embedding, check=check_embedding)
def embedding_grad_sampler(layer, activations, backprops):
    n = activations[0].shape[0]
    V, d = layer.weight.shape
    keys, b = token_rows(layer, activations, backprops)  # (n T,), (n T, d)
    grad = zeros_per_sample((n * V, d), like=b)  # see memory.py
    grad.index_add_(0, keys, b)  # row (i, x_it) += b_it
    return {"weight": grad.view(n, V, d)}


__all__ = ["check_embedding", "embedding_grad_sampler", "token_rows"]
