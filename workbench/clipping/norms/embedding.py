"""Norm sampler for ``nn.Embedding``: segment sums, never a (V, d) tensor per sample.

Sample i's gradient has row v equal to Σ_{t: x_{i,t} = v} b_{i,t} (``per_sample/samplers/
embedding.py``), so

    ||g_i||² = Σ_v ||Σ_{t: x_{i,t} = v} b_{i,t}||² = Σ_{t,s} [x_{i,t} = x_{i,s}] <b_{i,t}, b_{i,s}>

The right-hand form is the Gram route, O(n T² d) (Li et al. 2022, arXiv 2110.05679, §4
treat embeddings this way). We use the left-hand form and split it by whether an index repeats
within its sample. A token whose index appears once in sample i is a row on its own and adds
||b_{i,t}||²; only the tokens of repeated indices need summing first:

  ||g_i||² = Σ_{t: x_{i,t} once in i} ||b_{i,t}||² + Σ_{v repeated in i} ||Σ_{x_{i,t}=v} b_{i,t}||²

Repeats are found by sorting each sample's T indices (n small sorts, no global sort); their
rows are summed with ``index_add_`` over the repeated tokens only. Cost: one pass over the
backprops plus the sorts, O(n T d), and no term of size V: PyTorch's own embedding backward
must zero a (V, d) gradient first. Tokens equal to ``padding_idx`` contribute nothing.

Notation: n batch, T tokens per sample, V vocabulary size, d embedding dim, x indices,
b backprops (n, T, d).
"""

import torch
from torch import nn

from workbench.clipping.registry import register_norm_sampler


def embedding_route(layer, activations) -> tuple[str, str]:
    T = activations[0][0].numel()
    return "segment sum", f"O(nTd) sums over equal indices (T = {T}), nothing of size V"


def repeated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For indices x (n, T): (mask of tokens whose index repeats within their sample (n, T),
    run number of each token among its sample's sorted distinct indices (n, T))."""
    xs, order = x.sort(dim=1)  # (n, T) each sample's indices, ascending
    same = xs[:, 1:] == xs[:, :-1]  # (n, T-1) equal to the next one
    rep = torch.zeros_like(xs, dtype=torch.bool)
    rep[:, 1:] |= same
    rep[:, :-1] |= same
    run = torch.zeros_like(order)
    run[:, 1:] = (~same).cumsum(1)
    back = torch.empty_like(order)  # sorted position -> token order
    return (torch.zeros_like(rep).scatter_(1, order, rep),
            back.scatter_(1, order, run))


@register_norm_sampler(nn.Embedding, route=embedding_route)
def embedding_norm_sampler(layer, activations, backprops):
    x = activations[0]
    n, d = x.shape[0], layer.weight.shape[1]
    x = x.reshape(n, -1)  # (n, T)
    b = backprops.reshape(n, -1, d)  # (n, T, d)
    if layer.padding_idx is not None:
        b = b.masked_fill((x == layer.padding_idx).unsqueeze(-1), 0.0)
    rep, run = repeated(x)  # (n, T), (n, T)
    squares = b.pow(2).sum(-1).masked_fill_(rep, 0.0).sum(1)  # (n,) tokens of unique indices
    i, t = rep.nonzero(as_tuple=True)  # the K tokens of repeated indices
    if len(i):
        keys, slot = torch.unique(i * x.shape[1] + run[i, t], return_inverse=True)
        rows = b.new_zeros(len(keys), d).index_add_(0, slot, b[i, t])  # Σ b per (i, v)
        squares.index_add_(0, keys // x.shape[1], rows.pow(2).sum(1))  # Σ_v ||row||²
    return squares


__all__ = ["embedding_norm_sampler", "embedding_route", "repeated"]
