"""A statistic over the batch's records inside the forward pass that gradients flow through.

Invariant: record i's gradient is the gradient of its own loss on its own data. A forward
pass that reduces over the records (a max, norm, std... over dim 0 of a tensor computed from
the batch) and lets the result's gradient flow breaks it even when the *outputs* do not
depend on the statistic: HF Nystromformer starts its iterative pseudo-inverse from
``1 / torch.max(torch.sum(key, dim=-2))``, a max over the whole batch; the iteration converges
to the same outputs whatever the start (a record alone and in the batch agree to 2e-15), so
the halves check (``selfcheck.check_model_halves``, which compares outputs) cannot see it,
but every record's loss sends gradient through the max to the argmax record's keys: that
record's clipped gradient carries the others' (1.9e-5 of the clipped sum, silently, in every
method, until 2026-11-30).

The use tracker (``uses.py``) notes each such reduction as it runs, with its autograd node
held; when the forward pass ends, ``refuse_reached`` walks the graph from the model's outputs
and raises ``SampleMixingError`` naming the op and the layer if one was reached. Seen:

- the non-linear reductions of ``REDUCTIONS`` (max, norm, std, logsumexp, ...) with no
  ``dim`` or a ``dim`` that includes 0;
- of a tensor whose dim 0 holds two or more records: its rows followed from the inputs
  (``flat_rows.py``: a batch flattened to (n·T, ...) too), or computed from the batch with
  n rows.

Not: linear ones (sum, mean): a sum over the records changes every record's outputs, or its
gradient is zero too, and the in-model losses of Hugging Face reduce so (``model_loss.py``);
nor a reduction whose result is detached or never reaches an output (no gradient flows, and
the halves check sees what it changes).
"""

import os
import sys

import torch

from workbench.errors import SampleMixingError

# name -> position of ``dim`` among the positional arguments
REDUCTIONS = {
    "max": 1, "min": 1, "amax": 1, "amin": 1, "median": 1, "nanmedian": 1, "prod": 1,
    "logsumexp": 1, "std": 1, "var": 1, "std_mean": 1, "var_mean": 1, "norm": 2,
    "linalg_vector_norm": 2, "linalg_norm": 2, "quantile": 2, "nanquantile": 2,
}


def over_records(name: str, args, kwargs, rows_of, tainted, n: int | None) -> bool:
    """``name(*args, **kwargs)`` reduces over dim 0 of a tensor holding two or more records."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return False
    pos = REDUCTIONS[name]
    dim = kwargs["dim"] if "dim" in kwargs else args[pos] if len(args) > pos else None
    if isinstance(dim, torch.Tensor):  # torch.max(a, b): elementwise
        return False
    if isinstance(dim, bool):  # x.std(True): unbiased, over every dim
        dim = None
    if dim is not None:
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        if not any(isinstance(d, int) and d % x.dim() == 0 for d in dims):
            return False
    rows = rows_of(x)
    if rows is not None:
        return rows[0] >= 2
    return n is not None and n >= 2 and x.shape[0] == n and tainted(x)


_HERE = os.path.dirname(os.path.dirname(__file__))
_SKIPPED = (os.path.dirname(torch.__file__), *(os.path.join(_HERE, d) + os.sep for d in (
    "per_sample", "dpsgd", "clipping")))


def caller() -> str:
    """The innermost frame of the model's own code (not torch's, not the workbench's):
    ``file:line (function)``, for the message."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    if frame is None:
        return "an unknown place"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def noted(result):
    """The autograd node of a reduction's result (its values: ``max(x, dim)`` returns values
    and indices), or None when no gradient flows from it."""
    t = result[0] if isinstance(result, (tuple, list)) and result else result
    return t.grad_fn if isinstance(t, torch.Tensor) and t.requires_grad else None


def refuse_reached(notes: list, outputs, graph_nodes) -> None:
    """Raise ``SampleMixingError`` if the graph from ``outputs`` (tensors) reaches a noted
    reduction's node. ``notes``: [(node, description)], the nodes held since the op (so their
    ids are theirs: ``derived.graph_nodes``)."""
    if not notes:
        return
    held = {id(node): (node, what) for node, what in notes}
    starts = [t for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in graph_nodes(starts):
        hit = held.get(id(node))
        if hit is not None and hit[0] is node:
            raise SampleMixingError(
                f"the model couples the records: {hit[1]}, and the model's output depends on "
                f"it with gradient. Even where the outputs do not change with it (an "
                f"iteration started from it converges: HF Nystromformer's pseudo-inverse), "
                f"every record's loss sends gradient through it to the records that hold the "
                f"statistic (the argmax), so a record's clipped gradient carries the others' "
                f"and per-record clipping bounds nothing. Reduce over each record's own dims "
                f"(dim >= 1, keepdim=True), as Nystromformer's 'exact' start does)")


__all__ = ["REDUCTIONS", "caller", "noted", "over_records", "refuse_reached"]
