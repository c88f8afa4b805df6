"""Shape-only ops on a batch-free output: where each element of the result came from.

T5's relative position bias (Raffel et al. 2020, JMLR 21(140), §2.1) is an Embedding looked
up on a (T_q, T_k) bucket matrix, o = E[buckets] (T_q, T_k, H), then *re-arranged* before it
meets the batch: D = o.permute(2, 0, 1).unsqueeze(0) (1, H, T_q, T_k), added to every layer's
attention scores (``broadcast.py``). A shape-only op (permute, unsqueeze, view, expand,
repeat, indexing, ...) copies elements of its input without arithmetic, so D is a selection of o:

    D[k] = o[π(k)]        π: positions of D -> flat positions of o          (D.shape)

and the per-sample gradient at o is the scatter of the one at D,

    ∂ℓ_i/∂o[j] = Σ_{k: π(k) = j} ∂ℓ_i/∂D[k]           (index_add over π; an expand repeats j)

π is found by running the same op on π of its input, an integer tensor (o's own π: arange
over o's elements in o's shape), so no op needs an inverse written for it: whatever the op
does to positions it does to π. Only ops that select elements are listed (``SHAPE_OPS``),
and ``where(cond, t, c)`` with a constant cond and c (π = -1 where c is chosen: ``masked``).
An add of a constant of t's shape or smaller (``constant_add``) leaves π as it is.
The ops are only noted during the forward pass (``op_of``); π is computed (``replay``) after
it, for the outputs that met the batch and were used in no other way;
in-place ops on the watched tensor (``unsqueeze_``, ``mul_``) change it under its π and are
never followed (``in_place``).

Notation: o the batch-free output, D a tensor derived from o by shape-only ops, π its
positions in o (int64, D's shape).
"""

import torch

from workbench.per_sample.flat_rows import AUGMENTED

# ops whose result's elements are elements of the first argument, by position only
SHAPE_OPS = {
    "permute", "unsqueeze", "squeeze", "view", "reshape", "view_as", "reshape_as", "expand",
    "expand_as", "broadcast_to", "transpose", "t", "swapaxes", "swapdims", "movedim",
    "moveaxis", "flatten", "unflatten", "contiguous", "clone", "__getitem__", "narrow",
    "select", "repeat",
}


def in_place(func, args, t: torch.Tensor) -> bool:
    """Does ``func(*args)`` overwrite t (``t.mul_(2)``, ``t += x``, ``t.unsqueeze_(0)``)?"""
    name = getattr(func, "__name__", "")
    return bool(args) and args[0] is t and (
        (name.endswith("_") and not name.endswith("__")) or name in AUGMENTED)


def op_of(func, args, kwargs, t: torch.Tensor, result) -> tuple | None:
    """``result = func(..., t, ...)`` as an op to replay on π later (``replay``): (func, args
    with t replaced by None, kwargs, where t was, masked), when func is a shape-only op of t
    (its first argument) or ``where(cond, t, c)`` with a constant cond and c (``masked``);
    else None. A cheap check: π itself is only computed for a call that is converted."""
    if not isinstance(result, torch.Tensor):
        return None
    name = getattr(func, "__name__", "")
    if name == "where":
        k = masked(args, kwargs, t, result)
        return None if k is None else (func, (*args[:k], None, *args[k + 1:]), {}, k, True)
    if (name not in SHAPE_OPS or not args or args[0] is not t
            or any(a is t for a in (*args[1:], *kwargs.values()))):
        return None
    return func, (None, *args[1:]), kwargs, 0, False


def constant_add(func, args, kwargs, t: torch.Tensor, result) -> tuple | None:
    """``t + c`` with c a constant (no gradient) that leaves t's shape (an older T5's causal
    mask merged into the bias, (1, 1, T, T)): ∂result/∂t = I, so π is unchanged. Checked
    before a meeting: with a result of t's shape, dim 0 of size 1 is not a batch of many."""
    if (getattr(func, "__name__", "") not in ("add", "__add__", "__radd__") or len(args) != 2
            or kwargs or not isinstance(result, torch.Tensor) or result.shape != t.shape):
        return None
    c = args[1] if args[0] is t else args[0]
    if c is t or (isinstance(c, torch.Tensor) and c.requires_grad):
        return None
    return None, (None,), {}, 0, False  # replay: π itself


def masked(args, kwargs, t: torch.Tensor, result: torch.Tensor) -> int | None:
    """Where t is in ``where(cond, t, c)`` / ``where(cond, c, t)`` (a causal mask on T5's
    bias, as Hugging Face's SDPA path writes it; replayed with c = -1, no position in o, no
    gradient), when cond and c are constants (no gradient) and the result has t's shape: a
    cond carrying the batch would make π differ per sample. Else None."""
    if kwargs or len(args) != 3 or args[0] is t or result.shape != t.shape:
        return None
    cond, k = args[0], (1 if args[1] is t else 2)
    other = args[3 - k]
    if (not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool or other is t
            or (isinstance(other, torch.Tensor) and other.requires_grad)):
        return None
    return k


def chosen_by_batch(func, args, kwargs, t: torch.Tensor, result) -> torch.Tensor | None:
    """``h = where(cond, t, c)`` with cond carrying the batch (a padding mask (n, 1, T, T) on
    T5's bias, Hugging Face's SDPA path) and c a constant: a meeting of t with the batch in
    which h_i takes t where cond_i chooses it, so ∂ℓ_i/∂t = Σ_{broadcast dims} (∂ℓ_i/∂h_i where
    chosen, else 0). Returns where t is chosen (cond, or ~cond for ``where(cond, c, t)``)."""
    if (getattr(func, "__name__", "") != "where" or kwargs or len(args) != 3 or args[0] is t
            or not isinstance(result, torch.Tensor) or result.dim() < 1
            or not result.requires_grad or result.shape == t.shape):
        return None  # t's shape: a constant cond (1, ...), followed (``masked``), no meeting
    cond, k = args[0], (1 if args[1] is t else 2)
    other = args[3 - k]
    if (not isinstance(cond, torch.Tensor) or cond.dtype != torch.bool or other is t
            or (isinstance(other, torch.Tensor) and other.requires_grad)):
        return None
    carries = cond.dim() == result.dim() and cond.shape[0] == result.shape[0]
    broadcast = 1 <= t.dim() < result.dim() or (t.dim() == result.dim() and t.shape[0] == 1)
    if not (carries and broadcast):
        return None
    return cond if k == 1 else ~cond


def replay(op: tuple, index: torch.Tensor, shape: tuple) -> torch.Tensor | None:
    """π of an op's result from π of its input t (``index``; ``op_of``); None when the op on
    π fails or does not give an int64 tensor of the result's ``shape``."""
    func, args, kwargs, k, is_masked = op
    if func is None:  # constant_add: π unchanged
        return index if tuple(index.shape) == tuple(shape) else None
    args = list(args)
    args[k] = index
    if is_masked:
        args[3 - k] = torch.full((), -1, dtype=torch.long, device=index.device)
    with torch._C.DisableTorchFunction():  # book-keeping, not a use of the model
        try:
            moved = func(*args, **kwargs)
        except (RuntimeError, TypeError, IndexError, ValueError):
            return None
    if (not isinstance(moved, torch.Tensor) or moved.dtype != torch.long
            or tuple(moved.shape) != tuple(shape)):
        return None
    return moved


__all__ = ["SHAPE_OPS", "chosen_by_batch", "constant_add", "in_place", "masked", "op_of", "replay"]
