"""Shape-only ops on a batch-free output: where each element of the result came from.

T5's relative position bias (Raffel et al. 2020, JMLR 21(140), §2.1) is an Embedding looked
up on a (T_q, T_k) bucket matrix, o = E[buckets] (T_q, T_k, H), then *re-arranged* before it
meets the batch: D = o.permute(2, 0, 1).unsqueeze(0) (1, H, T_q, T_k), added to every layer's
attention scores (``broadcast.py``). A shape-only op (permute, unsqueeze, view, expand,
indexing, ...) copies elements of its input without arithmetic, so D is a selection of o:

    D[k] = o[π(k)]        π: positions of D -> flat positions of o          (D.shape)

and the per-sample gradient at o is the scatter of the one at D,

    ∂ℓ_i/∂o[j] = Σ_{k: π(k) = j} ∂ℓ_i/∂D[k]           (index_add over π; an expand repeats j)

π is found by running the same op on π of its input, an integer tensor (o's own π: arange
over o's elements in o's shape), so no op needs an inverse written for it: whatever the op
does to positions it does to π. Only ops that select elements are listed (``SHAPE_OPS``),
and ``where(cond, t, c)`` with a constant cond and c (π = -1 where c is chosen: ``masked``);
in-place ops on the watched tensor (``unsqueeze_``, ``mul_``) change it under its π and are
never followed (``in_place``).

Notation: o the batch-free output, D a tensor derived from o by shape-only ops, π its
positions in o (int64, D's shape).
"""

import torch

# ops whose result's elements are elements of the first argument, by position only
SHAPE_OPS = {
    "permute", "unsqueeze", "squeeze", "view", "reshape", "view_as", "reshape_as", "expand",
    "expand_as", "broadcast_to", "transpose", "t", "swapaxes", "swapdims", "movedim",
    "moveaxis", "flatten", "unflatten", "contiguous", "clone", "__getitem__", "narrow",
    "select",
}


def in_place(func, args, t: torch.Tensor) -> bool:
    """Does ``func(*args)`` overwrite t (``t.mul_(2)``, ``t += x``, ``t.unsqueeze_(0)``)?"""
    name = getattr(func, "__name__", "")
    return bool(args) and args[0] is t and (
        (name.endswith("_") and not name.endswith("__")) or name.startswith("__i"))


def positions(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """π of t: ``index``, or for o itself (None) arange over its elements in its shape."""
    if index is not None:
        return index
    return torch.arange(t.numel(), device=t.device).view(t.shape)


def follow(func, args, kwargs, t: torch.Tensor, index, result) -> torch.Tensor | None:
    """π of ``result = func(t, *args[1:])`` when func is a shape-only op of t (its first
    argument) and the same op on π gives π of the result's shape; else None."""
    if getattr(func, "__name__", "") == "where":
        return masked(args, kwargs, t, index, result)
    if (getattr(func, "__name__", "") not in SHAPE_OPS or not args or args[0] is not t
            or not isinstance(result, torch.Tensor)
            or any(a is t for a in (*args[1:], *kwargs.values()))):
        return None
    with torch._C.DisableTorchFunction():  # book-keeping, not a use of the model
        try:
            moved = func(positions(t, index), *args[1:], **kwargs)
        except (RuntimeError, TypeError, IndexError, ValueError):
            return None
    if (not isinstance(moved, torch.Tensor) or moved.dtype != torch.long
            or moved.shape != result.shape):
        return None
    return moved


def masked(args, kwargs, t: torch.Tensor, index, result) -> torch.Tensor | None:
    """π of ``where(cond, t, c)`` / ``where(cond, c, t)`` (a causal mask on T5's bias, as
    Hugging Face's SDPA path writes it): t's positions where t is chosen, -1 (no position in
    o: no gradient) elsewhere. Only when cond and c are constants (no gradient) and the
    result has t's shape: a cond carrying the batch would make π differ per sample."""
    if kwargs or len(args) != 3 or args[0] is t or not isinstance(result, torch.Tensor):
        return None
    cond, k = args[0], (1 if args[1] is t else 2)
    other = args[3 - k]
    if (not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool or other is t
            or (isinstance(other, torch.Tensor) and other.requires_grad)
            or result.shape != t.shape):
        return None
    with torch._C.DisableTorchFunction():
        none = torch.full((), -1, dtype=torch.long, device=t.device)
        pair = (positions(t, index), none) if k == 1 else (none, positions(t, index))
        moved = torch.where(cond, *pair)
    return moved if moved.shape == result.shape else None


__all__ = ["SHAPE_OPS", "follow", "in_place", "masked", "positions"]
