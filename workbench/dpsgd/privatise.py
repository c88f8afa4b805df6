"""The DP-SGD update from one batch's recorded layer calls: clip per sample, sum, add noise.

Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1, with Poisson sampling (``sampling.py``):

    c_i = min(1, C / ||g_i||)                                  clip factors (clipping/flat.py)
    ḡ   = (Σ_i c_i g_i + N(0, σ² C² I)) / B                     B = q N, the expected batch size

The recorded calls (``per_sample.hooks``, captured during the user's own ``loss.backward()``)
give every layer's activations a and backprops b. ``clipped_sum`` turns them into Σ_i c_i g_i
by the chosen mode:

- ``microbatch`` / ``vmap`` / ``einsum``: materialise each layer's per-sample gradients (a
  loop over samples, ``vmap``, or the registered grad sampler), then norm, clip and sum;
- ``ghost`` / ``bookkeeping``: norms from (a, b) by the norm samplers (``clipping.ghost``),
  then each layer's clipped sum as its weight gradient with backprops c_i b_i (Bu et al. 2023,
  arXiv 2210.00038). The user's backward pass has already freed the graph, so that weight
  gradient comes from re-running the layer alone on its stored inputs (one layer forward);
  in this setting the two modes do the same work. (``wb.clipped_grad_sum`` shows the
  difference: there ghost runs a second backward pass.)

**Per-layer clipping** (a C_g per parameter group; McMahan et al. 2018, arXiv 1710.06963,
§3): each group's part of g_i is clipped to C_g, so the whole clipped gradient has norm at
most ||C||₂ = (Σ_g C_g²)^½, and that is the sensitivity the noise is scaled to: σ ||C||₂.

Notation: n batch, g_i per-sample gradient, C max_grad_norm, σ noise multiplier, q sample
rate, N data set size, B = qN.
"""

import torch
from torch.utils._pytree import tree_map

from workbench.clipping.flat import clip_factors, sample_squares
from workbench.clipping.ghost import LayerCalls, squared_norms_by
from workbench.per_sample.einsum import sample_layer
from workbench.per_sample.functional import layer_vmap_grad_sampler
from workbench.per_sample.microbatch import layer_microbatch_grad_sampler

MODES = ("microbatch", "vmap", "einsum", "ghost", "bookkeeping")


def materialise(calls: LayerCalls, mode: str) -> dict[int, torch.Tensor]:
    """{id(param): (n, *shape)} per-sample gradients, summed over each parameter's calls."""
    grads: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for _, layer, call in list(calls.calls()):
            if mode == "einsum":
                local = sample_layer(layer, call)
            elif mode == "vmap":
                local = layer_vmap_grad_sampler(layer, call.args, call.kwargs, call.backprops)
            else:
                local = layer_microbatch_grad_sampler(layer, call.args, call.kwargs,
                                                      call.backprops)
            for name, g in local.items():
                p = getattr(layer, name)
                if p.requires_grad:
                    grads[id(p)] = g if id(p) not in grads else grads[id(p)] + g
    return grads


def reweighted_weight_grads(layer, call, c: torch.Tensor, skip: set[int], keep=None):
    """{id(param): Σ_i c_i g_i} of the layer's own parameters (those ``keep(p)`` accepts):
    re-run the layer on its stored (detached) inputs and backpropagate c_i b_i through it."""
    own = [p for p in layer.parameters(recurse=False)
           if p.requires_grad and id(p) not in skip and (keep is None or keep(p))]
    if not own:
        return {}
    detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
    b = call.backprops
    with torch.enable_grad():
        out = layer.forward(*tree_map(detach, call.args), **tree_map(detach, call.kwargs))
    weighted = c.to(b.dtype).view(-1, *[1] * (b.dim() - 1)) * b  # c_i b_i
    grads = torch.autograd.grad(out, own, grad_outputs=weighted, allow_unused=True)
    return {id(p): g for p, g in zip(own, grads) if g is not None}


def clipped_sum(calls: LayerCalls, max_grad_norm, mode: str, group_of=None):
    """({id(param): Σ_i c_i g_i}, norms (n,), clip factors (n,)) for one batch.

    ``max_grad_norm``: one C (flat clipping), or {group: C_g} with ``group_of(param)`` naming
    each parameter's group (per-layer clipping: each group's part of g_i is clipped to C_g).
    The returned clip factors are, per sample, the smallest over the groups.
    """
    per_group = isinstance(max_grad_norm, dict)
    C = max_grad_norm if per_group else {None: max_grad_norm}
    group_of = group_of if per_group else (lambda p: None)
    params = {id(p): p for _, layer, _ in calls.calls() for p in layer.parameters(recurse=False)}
    zeros = torch.zeros(calls.n, dtype=calls.dtype, device=calls.device)
    if mode in ("microbatch", "vmap", "einsum"):
        grads = materialise(calls, mode)
        squares: dict = {}
        for key, g in grads.items():
            group = group_of(params[key])
            squares[group] = squares.get(group, zeros) + sample_squares(g)
        c = {group: clip_factors(sq.sqrt(), C[group]) for group, sq in squares.items()}
        with torch.no_grad():
            sums = {key: torch.tensordot(c[group_of(params[key])].to(g.dtype), g, dims=1)
                    for key, g in grads.items()}
    else:
        squares, shared = squared_norms_by(calls, group_of)
        c = {group: clip_factors(sq.sqrt(), C[group]) for group, sq in squares.items()}
        sums = {}
        for _, layer, call in calls.calls():
            for group in {group_of(p) for p in layer.parameters(recurse=False)} & set(c):
                keep = lambda p, group=group: group_of(p) == group  # noqa: E731
                for key, g in reweighted_weight_grads(layer, call, c[group], set(shared),
                                                      keep).items():
                    sums[key] = g if key not in sums else sums[key] + g
        with torch.no_grad():
            for key, g in shared.items():
                sums[key] = torch.tensordot(c[group_of(params[key])].to(g.dtype), g, dims=1)
    norms = sum(squares.values(), zeros).sqrt()
    factors = torch.stack(list(c.values())).min(0).values if c else zeros + 1
    return sums, norms, factors


def gaussian_noise(param: torch.Tensor, std: float, generator=None) -> torch.Tensor:
    """N(0, std² I) shaped like ``param`` (drawn on CPU from ``generator`` when given; a
    ``secure.SecureGenerator`` gives a freshly seeded generator for every draw)."""
    if hasattr(generator, "next"):
        generator = generator.next()
    if generator is not None and generator.device != param.device:
        noise = torch.normal(0.0, std, param.shape, generator=generator, dtype=param.dtype)
        return noise.to(param.device)
    return torch.normal(0.0, std, param.shape, generator=generator, dtype=param.dtype,
                        device=param.device)
