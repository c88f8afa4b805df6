"""Ghost clipping: per-sample gradient norms from activations and backprops alone.

DP-SGD needs only ||g_i|| and Σ_i c_i g_i, never the n per-sample gradients themselves.
Ghost clipping (Goodfellow 2015, arXiv 1510.01799; Li, Tramèr, Liang, Hashimoto 2022,
arXiv 2110.05679, §4) gets both with two backward passes over one forward pass:

1. a backward pass of Σ_i ℓ_i that keeps each layer's backprops b; each layer's
   *norm sampler* turns (a, b) into ||g_i^{layer}||², and ||g_i||² = Σ_layers ||g_i^{layer}||²;
2. c_i = min(1, C / ||g_i||) (``flat.clip_factors``), then an ordinary backward pass of
   Σ_i c_i ℓ_i, whose parameter gradient is Σ_i c_i g_i: the clipped sum.

Layers without a norm sampler (normalisation layers, custom layers) get "fast gradient
clipping" (Opacus blog on fast gradient clipping and ghost clipping, seed 004): their
per-sample gradients are materialised, normed and dropped immediately.

A parameter used in more than one call (a module called twice) has the *sum* of several
layers' gradients as its per-sample gradient; the norm of a sum has cross terms, so such
parameters are materialised per call and summed before taking the norm (a tied head's E:
its Embedding call and its ``F.linear`` call, ``per_sample.tied``). Parameters no per-layer
rule can account for (``per_sample.recording``) are materialised exactly by the whole-model
fallback, and the norms are checked against micro-batching on one sample
(``per_sample.selfcheck``).

Notation: n batch, a activations, b backprops, c clip factors, C max_grad_norm.
"""

import torch
from torch.nn.utils.parametrize import is_parametrized

from workbench.clipping.flat import LOW_PRECISION, clip_factors, sample_squares
from workbench.clipping.registry import find_norm_sampler
from workbench.per_sample import selfcheck
from workbench.per_sample.einsum import fallback_gradients, sample_layer, warn_fallbacks
from workbench.per_sample.recording import Recording, own_parameters
from workbench.per_sample.recording import record as record_forward


def _covered(layer) -> bool:
    return find_norm_sampler(layer) is not None


def record(model, loss_fn, inputs, targets, retain_graph: bool, check=False) -> Recording:
    """Forward, then one backward pass collecting backprops (no parameter gradients).

    Returns the recording with ``exact`` (the fallback parameters' per-sample gradients) and,
    when ``check`` asks for it, ``probe`` (micro-batching's gradient of one sample) set.
    """
    selfcheck.check_option(check)
    rec = record_forward(model, loss_fn, inputs, targets, covered=_covered)
    warn_fallbacks(rec, _covered)
    sig = selfcheck.known(model, rec, check)
    rec.probe = selfcheck.probe(rec, model, loss_fn, inputs, targets) if sig else None
    rec.signature = sig
    rec.recorder.backward(rec.losses.sum(), retain_graph=retain_graph)
    rec.exact = fallback_gradients(rec, model, loss_fn, inputs, targets)
    return rec


def verify_norms(model, rec: Recording, squares: torch.Tensor) -> None:
    """The probed sample's norm against micro-batching (deterministic models); remember."""
    if rec.signature is None:
        return
    if not rec.random:
        selfcheck.compare_norm(rec, squares[rec.n - 1].sqrt(), rec.probe)
    selfcheck.remember(model, rec.signature, dict(rec.fallback))


def squared_norms(rec: Recording, exact=None):
    """(||g_i||² (n,), {id(param): (n, *shape)} materialised: shared and exact)."""
    squares, materialised = squared_norms_by(rec, lambda p: None, exact)
    return squares.get(None, torch.zeros(rec.n, dtype=rec.dtype, device=rec.device)), \
        materialised


def squared_norms_by(rec: Recording, group_of, exact=None):
    """Like ``squared_norms``, with ||g_i||² split by ``group_of(param)`` (per-layer clipping).

    Returns ({group: (n,)}, materialised). A norm sampler gives one number per layer, so a
    layer whose rule parameters lie in different groups, or that has parameters left to the
    fallback, is materialised instead.
    """
    shared = rec.shared_ids()
    squares: dict = {}
    materialised: dict[int, torch.Tensor] = dict(exact or {})
    params = {id(p): p for p in rec.params.values()}

    def add(group, value):
        squares[group] = value if group not in squares else squares[group] + value

    with torch.no_grad():
        for _, layer, call in rec.calls():
            own = dict(rec.own(layer))
            if not own:
                continue
            sampler = None if is_parametrized(layer) else find_norm_sampler(layer)
            everything = len(own) == len(own_parameters(layer))
            groups = {group_of(p) for p in own.values()}
            if (sampler is not None and everything and len(groups) == 1
                    and not any(id(p) in shared for p in own.values())):
                args, b = widen(call.args), widen(call.backprops)  # float16 -> float32
                add(groups.pop(), sampler(layer, args, b))  # ghost norm
                continue
            for name, g in sample_layer(layer, call, keep=own).items():  # fast gradient clipping
                p = own[name]
                if id(p) in shared:  # summed over its uses before the norm
                    materialised[id(p)] = materialised.get(id(p), 0) + g
                else:
                    add(group_of(p), sample_squares(g))  # normed, then dropped
    for key, g in materialised.items():
        add(group_of(params[key]), sample_squares(g))
    return squares, materialised


def widen(x):
    """float16/bfloat16 tensors (in tuples) as float32: squared norms above 256² fit."""
    if isinstance(x, (tuple, list)):
        return type(x)(widen(t) for t in x)
    if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION:
        return x.float()
    return x


def ghost_norms(model, loss_fn, inputs, targets, check=True) -> torch.Tensor:
    """||g_i|| (n,) from one forward and one backward pass."""
    rec = record(model, loss_fn, inputs, targets, retain_graph=False, check=check)
    squares = squared_norms(rec, rec.exact)[0]
    verify_norms(model, rec, squares)
    return squares.sqrt()


def ghost_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm, check=True):
    """{name: Σ_i c_i g_i} by a second backward pass of Σ_i c_i ℓ_i."""
    rec = record(model, loss_fn, inputs, targets, retain_graph=True, check=check)
    squares, materialised = squared_norms(rec, rec.exact)
    verify_norms(model, rec, squares)
    c = clip_factors(squares.sqrt(), max_grad_norm)  # (n,)
    for call in rec.recorder.all_calls():
        call.backprops = None  # not needed by the second pass: free them before it runs
    names = [k for k, p in rec.params.items() if id(p) not in rec.exact]
    grads = torch.autograd.grad((c.detach() * rec.losses).sum(),
                                [rec.params[k] for k in names], allow_unused=True) if names else ()
    sums = {k: torch.zeros_like(rec.params[k]) if g is None else g for k, g in zip(names, grads)}
    with torch.no_grad():
        for key, g in rec.exact.items():  # the fallback's own g_i: the norms' g_i
            sums[next(k for k, p in rec.params.items() if id(p) == key)] = \
                torch.tensordot(c.to(g.dtype), g, dims=1)
    return {name: sums[name] for name in rec.params}
