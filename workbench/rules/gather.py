"""A parameter's rows picked by an index that carries the batch: ``W[ids]``.

Mixtral's experts keep their weights as one 3-D parameter per projection, W of shape
(E, p, d) for E experts, and Hugging Face's batched experts pick each token's experts' weights
with ``W[expert_ids]``, ids of shape (n·T·k,) (each token's k chosen experts, tokens flattened
sample-major; Jiang et al. 2024, arXiv 2401.04088, §2.1), before one batched product. The pick
is an embedding lookup of a table whose rows are matrices: o_r = W[x_r], so, as for
``nn.Embedding`` (``embedding.py``; Yousefpour et al. 2021, arXiv 2109.12298, Eq. 5 on one-hot
rows),

    ∂ℓ_i/∂W[e] = Σ_{r of sample i : x_r = e} b_r                 (n, E, *W.shape[1:])

where b_r = ∂ℓ/∂o_r is row r's backprop, sample i's own because samples do not mix (the
self-check verifies it on every new call signature). The use tracker records the op as a call
of a ``ParameterRows`` layer on the indices (``per_sample/tied.py``) when the indices' rows are
proved to be the batch's (``flat_rows.py``: each sample's R rows together, ``rows``), so the
rule sees x as (n, R) and b as (n, R, *W.shape[1:]).

The per-sample gradient is a scatter-add of b into row (i, x_r) of a zero (n·E, ...) table; its
norm, the embedding's segment sums over equal indices (``embedding.py``'s norm rule on the rows
flattened to (n, R, P), P = numel(W[0])); book-keeping's clipped sum one ``index_add_`` of c ⊙ b
into a zero W (no re-run). Negative indices pick rows from the end, as in PyTorch: they are
taken modulo E first.

Notation: n batch, R index rows per sample, E rows of W, P = numel of one row, x indices,
b backprops.
"""

import torch

from workbench.per_sample.memory import zeros_per_sample
from workbench.per_sample.tied import ParameterRows
from workbench.rules._rule import LayerRule, register_rule
from workbench.rules.embedding import SEGMENT_SUM, segment_squares


def rows_of(layer, activations, backprops):
    """(x (n, R) non-negative, b (n, R, P)) of a call."""
    x = activations[0]
    n, E = x.shape[0], layer.weight.shape[0]
    x = x.reshape(n, -1).remainder(E)  # W[-1] is W[E - 1]
    return x, backprops.reshape(n, x.shape[1], -1)


def gather_grad_sampler(layer, activations, backprops):
    if not layer.weight.requires_grad:
        return {}
    x, b = rows_of(layer, activations, backprops)
    n, E = x.shape[0], layer.weight.shape[0]
    keys = (torch.arange(n, device=x.device).unsqueeze(1) * E + x).reshape(-1)  # i E + x_r
    grad = zeros_per_sample((n * E, b.shape[-1]), like=b)
    grad.index_add_(0, keys, b.reshape(-1, b.shape[-1]))  # row (i, x_r) += b_r
    return {"weight": grad.view(n, *layer.weight.shape)}


def gather_norm_sampler(layer, activations, backprops):
    x, b = rows_of(layer, activations, backprops)
    return segment_squares(x, b)  # (n,) ||g_i||², repeats summed first


def gather_route(layer, activations):
    return SEGMENT_SUM, "backprops summed over equal indices per sample, nothing of size E"


def gather_weight_grads(layer, call, weighted: torch.Tensor, own: list, ok=None) -> dict:
    """Σ_i c_i g_i: the reweighted backprops (n·R, ...) added into a zero W at their rows."""
    if not any(p is layer.weight for p in own):
        return {}
    x = call.args[0].reshape(-1).remainder(layer.weight.shape[0])  # (n R,)
    grad = torch.zeros(layer.weight.shape, dtype=weighted.dtype, device=weighted.device)
    grad.index_add_(0, x, weighted.reshape(len(x), *layer.weight.shape[1:]))
    return {id(layer.weight): grad}


RULE = register_rule(LayerRule(
    "parameter rows picked by the batch's indices", (ParameterRows,),
    grad=gather_grad_sampler, norm=gather_norm_sampler, route=gather_route,
    routes=(SEGMENT_SUM,), weight_grads=gather_weight_grads, rows=True))


__all__ = [
    "RULE", "SEGMENT_SUM", "ParameterRows", "gather_grad_sampler", "gather_norm_sampler",
    "gather_route", "gather_weight_grads", "rows_of",
]
