"""``nn.Embedding``: a one-hot matmul, done as a scatter-add; its norm by segment sums.

An embedding is a Linear layer applied to one-hot rows: o_t = Wᵀ e_{x_t}, so by the Linear
rule (Yousefpour et al. 2021, arXiv 2109.12298, Eq. 5; Opacus blog "Efficient per-sample
gradient computation for more layers", embedding section)

    ∂ℓ_i/∂W = Σ_t e_{x_{i,t}} b_{i,t}ᵀ            (n, V, d)

i.e. row v of sample i's gradient is the sum of b_{i,t} over the positions t where x_{i,t} = v.
Building the one-hot matrix costs O(n T V); we add b_{i,t} straight into row (i, x_{i,t}) of a
zero tensor instead, so the cost beyond writing the (n, V, d) output is O(n T d).
Positions equal to ``padding_idx`` contribute nothing, as in PyTorch's own backward.

Norm rule. Sample i's gradient has row v equal to Σ_{t: x_{i,t} = v} b_{i,t} (the grad rule
above), so

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

Book-keeping's clipped sum needs no forward re-run: Σ_i c_i g_i = Σ_{i,t} e_{x_it} (c_i b_it)ᵀ,
one ``index_add_`` (``embedding_weight_grads``). The optimizer's rule weights b itself, a chunk
of samples at a time (``embedding_reweighted``): the reweighted (n, T, d) copy, the size of b,
was the step's peak (``bench training --memory``, b = 256: 1.70x a plain step).

Notation: n batch, T tokens per sample, V vocabulary size, d embedding dim, x indices (n, T),
b backprops (n, T, d).
"""

import torch
from torch import nn

from workbench.clipping.nonfinite import masked
from workbench.errors import UnsupportedLayerError
from workbench.per_sample.memory import zeros_per_sample
from workbench.rules._rule import LayerRule, Route, register_rule


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


def embedding_grad_sampler(layer, activations, backprops):
    n = activations[0].shape[0]
    V, d = layer.weight.shape
    keys, b = token_rows(layer, activations, backprops)  # (n T,), (n T, d)
    grad = zeros_per_sample((n * V, d), like=b)  # see memory.py
    grad.index_add_(0, keys, b)  # row (i, x_it) += b_it
    return {"weight": grad.view(n, V, d)}


SEGMENT_SUM = Route("segment sum", lambda layer, call: call.backprops[0].numel(),  # T·d sums
                    flops=lambda layer, call: call.backprops[0].numel())  # T·d adds


def embedding_route(layer, activations) -> tuple[Route, str]:
    T = activations[0][0].numel()
    return SEGMENT_SUM, f"O(nTd) sums over equal indices (T = {T}), nothing of size V"


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


def embedding_norm_sampler(layer, activations, backprops):
    """(n,) ||g_i||², ``NORM_CHUNKS`` chunks of samples at a time: the sorts' int64 (k, T)
    scratch is half the size of b at d = 16 (bench training, imdb_embedding) if made for all n
    at once."""
    x = activations[0]
    n, d = x.shape[0], layer.weight.shape[1]
    x = x.reshape(n, -1)  # (n, T)
    b = backprops.reshape(n, -1, d)  # (n, T, d), read only: no (n, T, d) scratch below
    step = max(1, -(-n // NORM_CHUNKS))
    pad = layer.padding_idx
    parts = [segment_squares(x[s:s + step], b[s:s + step], pad) for s in range(0, n, step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


NORM_CHUNKS = 4


def segment_squares(x, b, padding_idx=None):
    """(k,) ||g_i||² of k samples: indices x (k, T), backprops b (k, T, d); tokens equal to
    ``padding_idx`` add nothing (``rules/gather.py`` uses it with none)."""
    d = b.shape[-1]
    rep, run = repeated(x)  # (k, T), (k, T)
    skip = rep if padding_idx is None else rep | (x == padding_idx)  # pad: no term
    tokens = torch.linalg.vector_norm(b, dim=-1).square_()  # (k, T) ||b_it||², one reduction
    squares = tokens.masked_fill_(skip, 0.0).sum(1)  # (k,) tokens of unique indices
    if padding_idx is not None:
        rep = rep & (x != padding_idx)
    i, t = rep.nonzero(as_tuple=True)  # the K tokens of repeated (non-padding) indices
    if len(i):
        keys, slot = torch.unique(i * x.shape[1] + run[i, t], return_inverse=True)
        rows = b.new_zeros(len(keys), d).index_add_(0, slot, b[i, t])  # Σ b per (i, v)
        squares.index_add_(0, keys // x.shape[1], rows.pow(2).sum(1))  # Σ_v ||row||²
    return squares


def embedding_weight_grads(layer, call, weighted: torch.Tensor, own: list, ok=None) -> dict:
    """nn.Embedding without its graph: Σ_i c_i g_i = Σ_{i,t} e_{x_it} (c_i b_it)ᵀ, one
    ``index_add_`` of the (n T, d) reweighted backprops into a zero (V, d), padding row zeroed
    (what PyTorch's dense embedding backward computes; no forward re-run). None for the
    options whose gradient differs (refused before any work anyway, ``check_embedding``)."""
    return _into_table(layer, call, own, weighted, lambda ids: [(ids, weighted)])


def embedding_reweighted(layer, call, c: torch.Tensor, own: list, ok=None) -> dict:
    """``embedding_weight_grads`` of c ⊙ b without the (n, T, d) copy: Σ_i c_i g_i is a sum
    over samples, so each chunk of ``CHUNK_SAMPLES`` samples (scratch at most 1/16 of b) is
    reweighted (masked where ``ok`` is False) and added into the one (V, d) gradient."""
    b = call.backprops  # (n, ..., d)
    c = c.to(b.dtype).view(-1, *[1] * (b.dim() - 1))  # (n, 1, ..., 1)
    step = max(1, -(-len(b) // CHUNK_SAMPLES))

    def chunks(ids):  # ids (n, ...)
        for s in range(0, len(b), step):
            cb = c[s:s + step] * b[s:s + step]  # (k, ..., d) c_i b_it
            yield ids[s:s + step], cb if ok is None else masked(cb, ok[s:s + step])  # not 0·NaN

    return _into_table(layer, call, own, b, chunks)


def _into_table(layer, call, own: list, like: torch.Tensor, rows) -> dict | None:
    """{id(weight): (V, d)}: every (indices, rows (..., d)) of ``rows(ids)`` added into one
    zero table (``like``'s dtype and device), padding row zeroed; None for the options whose
    gradient differs, {} when the weight is not among ``own``."""
    if layer.sparse or layer.scale_grad_by_freq or layer.max_norm is not None:
        return None
    if not any(p is layer.weight for p in own):
        return {}
    ids = call.args[0] if call.args else call.kwargs["input"]  # (n, ...)
    grad = torch.zeros(layer.weight.shape, dtype=like.dtype, device=like.device)  # (V, d)
    for x, B in rows(ids):
        grad.index_add_(0, x.reshape(-1), B.reshape(-1, B.shape[-1]))
    if layer.padding_idx is not None:
        grad[layer.padding_idx] = 0
    return {id(layer.weight): grad}


CHUNK_SAMPLES = 16  # chunks per clipped sum: scratch b / 16, 16 index_adds


RULE = register_rule(LayerRule(
    "embedding", (nn.Embedding,), grad=embedding_grad_sampler, norm=embedding_norm_sampler,
    route=embedding_route, routes=(SEGMENT_SUM,), weight_grads=embedding_weight_grads,
    reweighted=embedding_reweighted, check=check_embedding))


__all__ = [
    "CHUNK_SAMPLES", "NORM_CHUNKS", "RULE", "SEGMENT_SUM", "check_embedding",
    "embedding_grad_sampler", "embedding_norm_sampler", "embedding_reweighted",
    "embedding_route", "embedding_weight_grads", "repeated", "segment_squares", "token_rows",
]
