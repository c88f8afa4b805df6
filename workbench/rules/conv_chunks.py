"""Bounded scratch for a convolution's per-sample work: the batch in chunks.

Every per-sample route of a convolution has scratch several times the call's size (the
unfolded input is k_1...k_D times the input), so the per-sample gradients and the norms run
over the batch in chunks whose scratch is at most a quarter of the call's own a and b
(``scratch_budget``, ``chunks``); the norm of a materialised call is taken chunk by chunk,
so its n per-sample gradients are never alive at once. The behaviour rules whose grad rule
re-runs the layer (``affine.py``: A(a) and B(a); ``norm_activation.py``: the normalised input,
the activation's vector-Jacobian product) take their per-sample gradients the same way
(``in_chunks``), so that book-keeping may materialise them in the backward pass
(``LayerRule.streams``).

Notation: n batch, k = k_1...k_D kernel size, L output positions, G groups,
a activations (n, C, *spatial), b backprops (n, p, *out).
"""

import contextlib
import contextvars

from workbench.rules.conv_geometry import output_positions

SCRATCH = None
"""None: each call's per-sample work runs in chunks whose scratch is at most a quarter of the
call's own a and b (``scratch_budget``, ``chunks``); an int forces that many numbers per
chunk (tests: one-sample and uneven chunks)."""

SCRATCH_SHARE = 4
MIN_CHUNK = 16  # samples
"""The call's a and b over the chunk scratch: CIFAR-10 CNN, one book-keeping step's peak
over plain SGD's (``bench.peak_memory`` after a few steps in one loop), b = 64 / 256:
1.35x / 1.43x with the whole a and b as the budget, 1.31x / 1.38x with a quarter (``bench
training --memory`` reads 1.54x / 1.58x for the same code: its peak step runs after the
interleaved timing, outside the candidates' own function-mode stacks)."""


_STRICT = contextvars.ContextVar("conv_chunks_strict", default=False)


@contextlib.contextmanager
def strict():
    """Inside the block the ``MIN_CHUNK`` floor is capped at the call's own a and b: a chunk's
    scratch never exceeds them. Book-keeping's streaming materialises a call in the backward
    pass (``clipping/bookkeeping.materialise_call``), while the forward pass's activations are
    still alive, so its scratch adds to the step's peak, where at ``step()`` it mostly does
    not: BiT's stem (7x7 on 3 channels, n = 16) unfolded 2.3 MiB at once, next to a plain
    step's 2.4 MiB peak (``bench real``, base: 1.60x that peak; 1.12x in chunks of 4)."""
    token = _STRICT.set(True)
    try:
        yield
    finally:
        _STRICT.reset(token)


def scratch_per_sample(layer, a, route: str) -> int:
    """Temporary numbers per sample of one route besides its (C k, p/G) output: the unfolded
    input (C k L) for 'unfold', the weight copy (P) and a padded input for 'grouped', the
    padded input and an over-long output for 'depthwise'."""
    per_input = a.shape[1:].numel() if a.shape[0] else 0  # shapes: no tensor op
    if route == "unfold":
        return layer.weight.shape[1:].numel() * layer.groups * output_positions(layer,
                                                                               a.shape[2:])
    if route == "grouped":
        return layer.weight.numel() + 2 * per_input
    return 3 * per_input


def scratch_budget(a, b, per_sample: int) -> int:
    """Scratch numbers one chunk may use: a quarter of the call's own a and b, all of which
    may still be alive when the norms are taken (book-keeping keeps every call's a and b until
    ``step()``), so the scratch adds at most a quarter to them; at least ``MIN_CHUNK``
    samples' worth, so that a small late layer is not cut into one-sample chunks (the
    CIFAR-10 CNN's last conv at n = 256: 256 chunks of one sample took 4x the time of its
    weight gradient); in the backward pass (``strict``) that floor is capped at a and b."""
    own = a.numel() + b.numel()
    floor = MIN_CHUNK * per_sample
    return max(own // SCRATCH_SHARE, min(floor, own) if _STRICT.get() else floor)


def in_chunks(rule, layer, a, b, per_sample: int, capped: bool = True) -> dict:
    """``rule(layer, (a,), b)`` ({name: (n, *shape)}), chunk by chunk (``chunks``) where its
    scratch, ``per_sample`` numbers per sample, exceeds the budget (``scratch_budget``; with
    ``capped`` False its ``MIN_CHUNK`` floor is never capped by ``strict``): each chunk's
    per-sample gradients are written into (n, *shape) buffers. Exact for a rule whose sample
    i reads a_i and b_i alone, as every grad rule's does (the self-check holds them to it)."""
    n = a.shape[0] if a.dim() else 0
    if not n:
        return rule(layer, (a,), b)
    own = a.numel() + b.numel()
    budget = scratch_budget(a, b, per_sample) if capped else max(
        own // SCRATCH_SHARE, MIN_CHUNK * per_sample)
    parts = chunks(n, per_sample, budget)
    if len(parts) == 1 or b.shape[:1] != a.shape[:1]:
        return rule(layer, (a,), b)
    out = {}
    for part in parts:
        for name, g in rule(layer, (a[part],), b[part]).items():
            if name not in out:
                out[name] = g.new_empty(n, *g.shape[1:])
            out[name][part] = g
    return out


def chunks(n: int, per_sample: int, budget: int) -> list[slice]:
    """Slices of the batch with at most ``budget`` scratch numbers each (one sample at
    least): the per-sample work runs chunk by chunk, so its scratch is bounded by a share of
    the call's own size (``scratch_budget``), not n times a route's blow-up (the 9x unfolded
    input of a 3x3 kernel)."""
    if SCRATCH is not None:
        budget = SCRATCH
    m = max(1, budget // max(per_sample, 1))
    return [slice(i, min(i + m, n)) for i in range(0, n, m)]


__all__ = ["MIN_CHUNK", "SCRATCH", "SCRATCH_SHARE", "chunks", "in_chunks", "scratch_budget",
           "scratch_per_sample", "strict"]
