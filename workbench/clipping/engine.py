"""The one clipping engine: Σ_i c_i g_i from a recording, for every method and the optimizer.

Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1: c_i = min(1, C / ||g_i||), and the sum
Σ_i c_i g_i that noise is added to. From one recording (``per_sample.recording``) of a batch:

- ``microbatch`` / ``vmap`` / ``einsum``: materialise each layer's per-sample gradients (a
  loop over samples, ``vmap``, or the registered grad sampler), then norm, clip and sum;
- ``ghost`` / ``bookkeeping``: norms from (a, b) by the norm samplers (``ghost.py``), then each
  layer's clipped sum as its *ordinary* weight gradient with backprops c_i b_i (Bu, Wang, Zha,
  Karypis 2023, arXiv 2210.00038, §3):  Σ_i c_i g_i(a_i, b_i) = Σ_i g_i(a_i, c_i b_i).
  The backward pass has freed the graph by then (``wb.clipped_grad_sum``'s book-keeping does
  not retain it; the optimizer comes after the user's backward): ``nn.Linear``'s weight
  gradient is one matmul of its stored inputs and c ⊙ b (Bu et al. Eq. 3), ``nn.Embedding``'s
  one ``index_add_`` of c ⊙ b at the token ids, and any other layer alone is re-run on its
  stored inputs.

Parameters materialised anyway (exact fallback, or used in several calls) enter as
Σ_i c_i g_i from their (n, *shape) tensors.

**Per-layer clipping** (a C_g per parameter group; McMahan et al. 2018, arXiv 1710.06963,
§3): each group's part of g_i is clipped to C_g, so the clipped gradient has norm at most
||C||₂ = (Σ_g C_g²)^½, the sensitivity the noise is scaled to.

**Norms and non-finite records.** Squared norms are float64 and overflow-safe (``flat.py``);
a record whose norm is NaN or inf in any group gets c_i = 0 in *every* group and is masked,
not multiplied, out of each product (``nonfinite.py``), so it cannot turn the sum into NaN.

Notation: n batch, g_i per-sample gradient, c_i clip factor, C max_grad_norm, b backprops.
"""

import torch
from torch import nn
from torch.utils._pytree import tree_map

from workbench.clipping.flat import clip_factors, sample_squares
from workbench.clipping.ghost import squared_norms_by
from workbench.clipping.nonfinite import bad_records, finite_values, masked
from workbench.methods import CLIP_METHODS, MATERIALISING
from workbench.per_sample.einsum import sample_layer
from workbench.per_sample.functional import layer_vmap_grad_sampler
from workbench.per_sample.microbatch import layer_microbatch_grad_sampler
from workbench.per_sample.precision import in_full_precision

MODES = CLIP_METHODS  # ghost and bookkeeping: one path here (the graph is gone by now)


@in_full_precision  # the layers re-run on widened inputs (per_sample/precision.py)
def materialise(rec, mode: str) -> dict[int, torch.Tensor]:
    """{id(param): (n, *shape)} per-sample gradients of the rule parameters, summed over each
    parameter's calls."""
    grads: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for _, layer, call in list(rec.calls()):
            own = dict(rec.own(layer))
            if not own:
                continue
            if mode == "einsum":
                local = sample_layer(layer, call, keep=own)
            elif mode == "vmap":
                local = layer_vmap_grad_sampler(layer, call.args, call.kwargs, call.backprops)
            else:
                local = layer_microbatch_grad_sampler(layer, call.args, call.kwargs,
                                                      call.backprops)
            for name, g in local.items():
                if name in own:
                    key = id(own[name])
                    grads[key] = g if key not in grads else grads[key] + g
    return grads


def _weighted(b, c, ok=None):
    cb = c.to(b.dtype).view(-1, *[1] * (b.dim() - 1)) * b  # c_i b_i
    return cb if ok is None else masked(cb, ok)  # a non-finite record's row: 0, not 0 · NaN


def linear_weight_grads(layer, call, weighted: torch.Tensor, own: list, ok=None) -> dict:
    """nn.Linear without its graph: Σ_i c_i B_iᵀ A_i = (c ⊙ B)ᵀ A (Bu et al. 2023, Eq. 3), one
    matmul over the n·T rows, as PyTorch's own weight gradient (no forward re-run).
    ``ok`` (n,): records to keep when some are non-finite (the others' rows of A are zeroed)."""
    a = call.args[0] if call.args else call.kwargs["input"]  # (n, ..., d)
    if ok is not None:
        a = masked(a, ok)
    B = weighted.reshape(-1, weighted.shape[-1])  # (n T, p)  c_i b_{i,t}
    grads = {}
    if any(p is layer.weight for p in own):
        grads[id(layer.weight)] = B.T @ a.reshape(-1, a.shape[-1]).to(B.dtype)  # (p, d)
    if layer.bias is not None and any(p is layer.bias for p in own):
        grads[id(layer.bias)] = B.sum(0)  # (p,)
    return grads


def embedding_weight_grads(layer, call, weighted: torch.Tensor, own: list) -> dict:
    """nn.Embedding without its graph: Σ_i c_i g_i = Σ_{i,t} e_{x_it} (c_i b_it)ᵀ, one
    ``index_add_`` of the (n T, d) reweighted backprops into a zero (V, d), padding row zeroed
    (what PyTorch's dense embedding backward computes; no forward re-run). Options whose
    gradient differs (sparse, scale_grad_by_freq, max_norm) are refused before any work
    (``samplers/embedding.check_embedding``)."""
    if not any(p is layer.weight for p in own):
        return {}
    ids = call.args[0] if call.args else call.kwargs["input"]  # (n, ...)
    B = weighted.reshape(-1, weighted.shape[-1])  # (n T, d)  c_i b_{i,t}
    grad = torch.zeros(layer.weight.shape, dtype=B.dtype, device=B.device)
    grad.index_add_(0, ids.reshape(-1), B)  # (V, d)
    if layer.padding_idx is not None:
        grad[layer.padding_idx] = 0
    return {id(layer.weight): grad}


@in_full_precision
def reweighted_weight_grads(layer, call, c, own: list, ok=None) -> dict:
    """{id(param): Σ_i c_i g_i} for ``own`` parameters of one call, by one weight gradient
    from the call's stored inputs (the backward pass has freed the graph). ``ok`` (n,), when
    some records are non-finite: the others' backprops are masked to 0 and the stored inputs'
    NaN and inf entries replaced by 0, so no 0 · NaN enters the weight gradient."""
    b = call.backprops
    weighted = [_weighted(t, c, ok) for t in (b if isinstance(b, tuple) else (b,))]
    if type(layer) is nn.Linear:
        with torch.no_grad():
            return linear_weight_grads(layer, call, weighted[0], own, ok)
    if type(layer) is nn.Embedding and not (layer.sparse or layer.scale_grad_by_freq
                                            or layer.max_norm is not None):
        with torch.no_grad():
            return embedding_weight_grads(layer, call, weighted[0], own)
    detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
    args, kwargs = tree_map(detach, call.args), tree_map(detach, call.kwargs)
    if ok is not None:
        args, kwargs = finite_values(args), finite_values(kwargs)
    with torch.enable_grad():
        out = layer.forward(*args, **kwargs)
    outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(outputs, own, grad_outputs=weighted, allow_unused=True)
    return {id(p): g for p, g in zip(own, grads) if g is not None}


def clipped_sum(rec, max_grad_norm, mode: str, group_of=None, exact=None):
    """({id(param): Σ_i c_i g_i}, norms (n,), clip factors (n,)) for one recorded batch.

    ``max_grad_norm``: one C, or {group: C_g} with ``group_of(param)`` naming each parameter's
    group. ``exact``: {id(param): (n, *shape)} of the fallback parameters. The returned clip
    factors are, per sample, the smallest over the groups.
    """
    per_group = isinstance(max_grad_norm, dict)
    C = max_grad_norm if per_group else {None: max_grad_norm}
    group_of = group_of if per_group else (lambda p: None)
    params = {id(p): p for p in rec.params.values()}
    zeros = torch.zeros(rec.n, dtype=torch.float64, device=rec.device)  # squares: flat.py
    exact = exact or {}
    if mode in MATERIALISING:
        grads = {**materialise(rec, mode), **exact}
        squares: dict = {}
        for key, g in grads.items():
            group = group_of(params[key])
            squares[group] = squares.get(group, zeros) + sample_squares(g)
    else:
        squares, grads = squared_norms_by(rec, group_of, exact)
    norms = sum(squares.values(), zeros).sqrt()  # (n,) NaN or inf if any group is
    bad = bad_records(norms)
    ok = ~bad if bad.any() else None  # None: the usual case, nothing to mask
    c = {group: clip_factors(sq.sqrt(), C[group]) for group, sq in squares.items()}
    if ok is not None:  # a non-finite record: 0 in every group, not only in its bad one
        c = {group: masked(cg, ok) for group, cg in c.items()}
    sums = {}
    if mode not in MATERIALISING:
        for _, layer, call in list(rec.calls()):
            for group in {group_of(p) for _, p in rec.own(layer)} & set(c):
                own = [p for _, p in rec.own(layer)
                       if id(p) not in grads and group_of(p) == group]
                if own:
                    for key, g in reweighted_weight_grads(layer, call, c[group], own,
                                                          ok).items():
                        sums[key] = g if key not in sums else sums[key] + g
            call.backprops = None  # used: free it before the next layer's weight gradient
    with torch.no_grad():
        for key, g in grads.items():  # materialised: Σ_i c_i g_i directly
            g = g if ok is None else masked(g, ok)
            sums[key] = torch.tensordot(c[group_of(params[key])].to(g.dtype), g, dims=1)
    factors = torch.stack(list(c.values())).min(0).values if c else zeros + 1
    return sums, norms, factors


__all__ = [
    "MODES", "clipped_sum", "embedding_weight_grads", "linear_weight_grads", "materialise",
    "reweighted_weight_grads",
]
