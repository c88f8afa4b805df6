"""Norm sampler for ``nn.Embedding``: segment sums, never a (V, d) tensor per sample.

Sample i's gradient has row v equal to Σ_{t: x_{i,t} = v} b_{i,t} (``per_sample/samplers/
embedding.py``), so

    ||g_i||² = Σ_v ||Σ_{t: x_{i,t} = v} b_{i,t}||² = Σ_{t,s} [x_{i,t} = x_{i,s}] <b_{i,t}, b_{i,s}>

The right-hand form is the Gram route, O(n T² d) (Li et al. 2022, arXiv 2110.05679, §4
treat embeddings this way). We take the left-hand form: sort the (sample, index) keys, add
each token's b into its key's row, square and sum: O(n T d) plus a sort of n T keys, and
no term of size V. Tokens equal to ``padding_idx`` contribute nothing, as in PyTorch.

Notation: n batch, T tokens per sample, V vocabulary size, d embedding dim, x indices,
b backprops (n, T, d).
"""

import torch
from torch import nn

from workbench.clipping.registry import register_norm_sampler
from workbench.per_sample.samplers.embedding import token_rows


def embedding_route(layer, activations) -> tuple[str, str]:
    T = activations[0][0].numel()
    return "segment sum", f"O(nTd) sums over equal indices (T = {T}), nothing of size V"


@register_norm_sampler(nn.Embedding, route=embedding_route)
def embedding_norm_sampler(layer, activations, backprops):
    n = activations[0].shape[0]
    V, d = layer.weight.shape
    keys, b = token_rows(layer, activations, backprops)  # (n T,) = i V + x_it, (n T, d)
    unique_keys, slot = torch.unique(keys, return_inverse=True)  # one slot per (i, v)
    rows = torch.zeros(len(unique_keys), d, dtype=b.dtype, device=b.device)
    rows.index_add_(0, slot, b)  # Σ_{t: x_t = v} b_t for each (i, v)
    squares = torch.zeros(n, dtype=b.dtype, device=b.device)
    return squares.index_add_(0, unique_keys // V, rows.pow(2).sum(1))  # Σ_v ||row||² per i
