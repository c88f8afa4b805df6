"""Clipped gradients: per-sample norms and clipped sums, with and without materialising.

``per_sample_grad_norms(model, loss_fn, inputs, targets, method=...)`` -> Tensor(n,) of
||g_i|| over all trainable parameters; ``clipped_grad_sum(..., max_grad_norm=C, method=...)``
-> {param_name: Σ_i min(1, C / ||g_i||) g_i}.

| method        | how                                                     | file            |
|---------------|---------------------------------------------------------|-----------------|
| microbatch    | per-sample gradients by a loop, then norm / clip        | engine.py       |
| vmap, einsum  | per-sample gradients materialised, then norm / clip     | engine.py       |
| ghost         | norms from (a, b); clipped sum by a 2nd backward pass   | ghost, engine   |
| bookkeeping   | norms from (a, b); clipped sum from the same (a, b)     | bookkeeping.py  |

Every clipped sum is computed in ``engine.py`` (the optimizer's too); C is validated once,
here.

All methods share ``flat.clip_factors`` (exact, no stabiliser), so they agree to rounding,
and ``flat.sample_norms`` (float32 gradients above 1e19 are normed without overflow).
A record whose gradient holds NaN or inf has a NaN or inf norm; ``clipped_grad_sum`` raises
``NonFiniteGradientError`` naming it (``nonfinite.py``; the DP optimizer skips and counts it).
"""

import torch

from workbench import rules  # noqa: F401  (registers the built-in layer rules)
from workbench.checks import check_max_grad_norm
from workbench.clipping.bookkeeping import bookkeeping_clipped_sum
from workbench.clipping.engine import clip_materialised, ghost_clipped_sum
from workbench.clipping.flat import clip_factors, grad_norms, norm_dtype
from workbench.clipping.ghost import ghost_norms
from workbench.clipping.registry import NORM_SAMPLERS, register_norm_sampler
from workbench.clipping.routes import ghost_routes
from workbench.clipping.snapshot import (
    ClippingResult,
    clip_at,
    clipping_snapshot,
    per_sample_snapshot,
)
from workbench.methods import CLIP_METHODS, NORM_METHODS
from workbench.per_sample import per_sample_gradients
from workbench.per_sample.checks import check_batch, check_no_sample_mixing
from workbench.per_sample.hooks import refusing_reentrant
from workbench.per_sample.selfcheck import check_option


def _nothing_trainable(model, inputs, targets) -> bool:
    """Nothing to compute; the batch checked. The scan for sample mixing (BatchNorm) is the
    recording's (``per_sample.recording.record``, ``per_sample_gradients``), run here only
    when nothing else will run it."""
    check_batch(inputs, targets)
    if any(p.requires_grad for p in model.parameters()):
        return False
    check_no_sample_mixing(model)
    return True


@refusing_reentrant
def per_sample_grad_norms(model, loss_fn, inputs, targets, method="ghost", check=True):
    """||g_i|| over all trainable parameters, Tensor(n,): NaN or inf for a record whose
    gradient holds NaN or inf (this finds the records ``clipped_grad_sum`` refuses).

    ``check`` (einsum and ghost): compare with micro-batching on one sample the first time a
    model is seen with a given call signature; ``"always"``; ``False`` for benchmarks.

    >>> import torch
    >>> from torch import nn
    >>> model, x = nn.Linear(3, 2), torch.randn(4, 3)
    >>> loss_fn = lambda out, _: out.pow(2).sum(1)
    >>> ghost = per_sample_grad_norms(model, loss_fn, x, None, method="ghost")
    >>> ref = per_sample_grad_norms(model, loss_fn, x, None, method="microbatch")
    >>> bool(torch.allclose(ghost, ref))
    True
    """
    if method not in NORM_METHODS:
        raise ValueError(f"method must be one of {NORM_METHODS}; got {method!r}")
    if _nothing_trainable(model, inputs, targets):
        n = check_batch(inputs, targets)
        return torch.zeros(n)
    check_option(check)
    if method == "ghost":
        return ghost_norms(model, loss_fn, inputs, targets, check=check)
    grads = per_sample_gradients(model, loss_fn, inputs, targets, method=method, check=check)
    dtype = norm_dtype(next(iter(grads.values())).dtype) if grads else torch.float32
    return grad_norms(grads).to(dtype)


@refusing_reentrant
def clipped_grad_sum(model, loss_fn, inputs, targets, max_grad_norm, method="bookkeeping",
                     check=True):
    """{param_name: Σ_i min(1, C / ||g_i||) g_i} for the trainable parameters.

    ``check``: as in ``per_sample_grad_norms`` (einsum, ghost, bookkeeping).
    ``NonFiniteGradientError`` names the records whose gradient holds NaN or inf.
    """
    if method not in CLIP_METHODS:
        raise ValueError(f"method must be one of {CLIP_METHODS}; got {method!r}")
    max_grad_norm = check_max_grad_norm(max_grad_norm)  # once, before any work
    if _nothing_trainable(model, inputs, targets):
        return {}
    check_option(check)
    if method == "ghost":
        return ghost_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm, check=check)
    if method == "bookkeeping":
        return bookkeeping_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm,
                                       check=check)
    grads = per_sample_gradients(model, loss_fn, inputs, targets, method=method, check=check)
    return clip_materialised(grads, max_grad_norm)


__all__ = [
    "CLIP_METHODS", "NORM_METHODS", "NORM_SAMPLERS", "ClippingResult", "clip_at", "clip_factors",
    "clipped_grad_sum", "clipping_snapshot", "ghost_routes", "per_sample_grad_norms",
    "per_sample_snapshot", "register_norm_sampler",
]
