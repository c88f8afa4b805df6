"""A batch-free output repeated to the batch and concatenated with it: prompt tuning's meeting.

Prompt tuning (Lester et al. 2021, arXiv 2104.08691) and P-tuning (Liu et al. 2021, arXiv
2103.10385) learn v virtual token embeddings. PEFT computes them once, without the batch,
o = E(arange(v)) (1, v, d), repeats them to the batch and puts them before every sample's
token embeddings a (n, T, d):

    D = o.repeat(n, 1, 1)        h = cat([D, a], dim=1)        (n, v + T, d)

D's dim 0 is n, but its rows are copies of o: a selection of o (``shape_ops.py``, π its
positions in o, π[i] = π[0] for every row i), so row i of D is sample i's copy only. h_i
holds D_i in its first v positions along dim 1, so, as for an add (``broadcast.py``),

    ∂ℓ_i/∂o = scatter_{π[0]}( ∂ℓ_i/∂h_i [positions of D_i along the cat dim] )         (1)

exact when the model does not mix samples after h (the assumption of every hook rule; the
self-check verifies it). ``concat_part`` says where D sits in h (the cat dim, D's start and
length along it), ``Meeting.reduce`` narrows h's gradient there before the usual sum and
scatter, and ``row_positions`` checks that D's rows are copies of one (π's rows equal) and
gives that row's π: a D whose rows differ (o itself had dim 0 = n) is not converted, and the
call keeps its exact fallback.

A cat along dim 0 stacks batches (the rows would be other samples'): never a meeting.

Notation: n batch size, v virtual tokens, T sequence length, d width, o the batch-free output,
D a tensor derived from o by shape-only ops, π D's positions in o.
"""

import torch

CATS = {"cat", "concat", "concatenate"}


def concat_part(func, args, kwargs, t: torch.Tensor, result) -> tuple | None:
    """(dim, start, length) of t in ``result = cat(tensors, dim)`` when dim ≥ 1, t carries
    result's dim 0 and some other tensor does too; else None."""
    if getattr(func, "__name__", "") not in CATS or not args or not isinstance(result,
                                                                               torch.Tensor):
        return None
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    if (type(tensors) not in (list, tuple) or not isinstance(dim, int) or result.dim() < 2
            or not result.requires_grad):
        return None
    dim = dim % result.dim()
    n = result.shape[0]
    if dim == 0 or t.dim() != result.dim() or t.shape[0] != n:
        return None
    start, found, batched = 0, None, False
    for other in tensors:
        if other is t:
            if found is not None:
                return None  # t twice: no single position
            found = start
        elif isinstance(other, torch.Tensor) and other.dim() == result.dim() \
                and other.shape[0] == n:
            batched = True
        if not isinstance(other, torch.Tensor):
            return None
        if other.dim() == result.dim():
            start += other.shape[dim]
        elif other.numel():  # only torch's legacy empty (0,) tensor is skipped by cat
            return None  # (Hugging Face's cache starts from torch.tensor([]))
    if found is None or not batched:
        return None
    return dim, found, t.shape[dim]


def row_positions(index: torch.Tensor | None, n: int) -> torch.Tensor | bool:
    """π[0] flattened when every row of π (D's positions in o, (n, ...) flattened) is the
    same: D's rows are copies of one; else False."""
    if index is None or index is False or index.numel() % n:
        return False
    rows = index.view(n, -1)
    if not bool((rows == rows[:1]).all()):
        return False
    return rows[0]


__all__ = ["CATS", "concat_part", "row_positions"]
