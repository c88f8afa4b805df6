"""A layer output that is a view: where its backprops b are read.

torch computes ``F.linear`` on a (n, T, d) input as the (n·T, p) product and returns a *view*
of it, (n, T, p). An in-place op on that view after the call (RoCBert's embeddings:
``h = self.map_inputs_layer(x); h += token_type_embeddings``; any ``h.relu_()``, ``h *= s``)
rebases the view on a ``CopySlices`` node of its base, and the view's own node leaves the
graph: an autograd edge taken at the view before the op receives nothing, the call looks
unused, and its layer's per-sample gradients came out zero (silently, with ``check=False``;
refused by the self-check otherwise).

The gradient of the base's value as the layer computed it does not move: ``CopySlices``
passes the gradient of every overwritten element back to the value it was computed from and
on into the base's own node. So for an output that views the whole of its base (the same
elements in the same order) b is read at the base's edge and reshaped:

    b = ∂L/∂o = reshape(∂L/∂base, o.shape)        o = base.view(o.shape)             (1)

which holds with or without a later in-place op. An output that views part of its base (a
slice, a chunk of a fused projection) has no gradient of its own to read there: when it is
written in place after the call (its version counter moved by the end of the forward pass),
the call's parameters take the exact fallback (``stale``).

Notation: o a layer's output, b = ∂L/∂o its backprops, L the summed loss.
"""

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def whole_view(t: torch.Tensor) -> bool:
    """``t`` views every element of its base, in the base's order (``t.reshape(base.shape)``
    is the base), and the base has a node of its own to read the gradient at."""
    base = t._base
    return (base is not None and base.grad_fn is not None and t.numel() == base.numel()
            and t.is_contiguous() and base.is_contiguous()
            and t.storage_offset() == base.storage_offset())


def capture_edge(t: torch.Tensor) -> tuple[GradientEdge, tuple | None]:
    """(the edge where b of output ``t`` is read, the shape to view it as: None when read at
    ``t`` itself), Eq. (1)."""
    if t._base is not None and whole_view(t):
        return get_gradient_edge(t._base), tuple(t.shape)
    return get_gradient_edge(t), None


def watched(tensors) -> list:
    """[(t, version)] of the outputs that view part of their base: ``stale`` tests them."""
    return [(t, t._version) for t in tensors if t._base is not None and not whole_view(t)]


def stale(watch: list) -> bool:
    """An output viewing part of its base was written in place after the call."""
    return any(t._version != version for t, version in watch)


__all__ = ["capture_edge", "stale", "watched", "whole_view"]
