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

The use tracker (``uses.py``) notes each such reduction as it runs, its result and input
held; when the forward pass ends, ``refuse_reached`` walks the graph from the model's outputs
and, for a reduction it reaches, measures the share of the gradient that flows through it,
raising ``SampleMixingError`` naming the op and the layer above the pass's tolerance. Seen:

- the non-linear reductions of ``REDUCTIONS`` (max, norm, std, logsumexp, ...) and the
  orders, cumulative ops and softmaxes of ``DIMS`` (``NOTED``) with no ``dim`` or a ``dim``
  that includes 0;
- of a tensor whose dim 0 holds two or more records: its rows followed from the inputs
  (``flat_rows.py``: a batch flattened to (n·T, ...) too);
- whose gradient is not zero: a statistic the outputs' gradient does not depend on (a
  global max subtracted before a softmax, shift-invariant) is let through, measured at the
  precision of the pass (``refuse_reached``).

The linear ones (sum, mean: ``LINEAR``) too, measured through every output of one or more
dims: the in-model losses of Hugging Face reduce over the records by design
(``model_loss.py``), so 0-dim outputs are left out here, and a 0-dim output a per-record loss
reads is refused where the loss is known (``checks.scalar_output_problem``, the optimizer's
``output_rows_problem``). Outputs of other than n rows were left out too until 2026-12-02: a
router's balance vector ``p.mean(0)``, shape (E,), added to each record's loss passed ghost
clipping silently (``tests/per_sample/test_batch_wide_outputs.py``). The halves check sees
a sum over the records in the outputs, but only on a checked call: a term whose factor a
schedule raises later (0 or 1e-9, then 0.5) keeps the signature. Not: a reduction whose
result is detached or never reaches an output (no gradient flows, and the halves check sees
what it changes).
"""

import os
import sys

import torch

from workbench.errors import LossCouplingError, SampleMixingError
from workbench.per_sample.precision import tolerance_of

#: reductions -> (position of ``dim`` among the positional arguments, its default: None is
#: every dim). One table for the forward pass's statistics (``REDUCTIONS``) and the loss
#: window's reductions over the records (``dpsgd/record_reduction.py``: ``PICKS``).
DIMS = {
    "max": (1, None), "min": (1, None), "amax": (1, None), "amin": (1, None),
    "aminmax": (1, None), "median": (1, None), "nanmedian": (1, None), "prod": (1, None),
    "logsumexp": (1, None), "std": (1, None), "var": (1, None), "std_mean": (1, None),
    "var_mean": (1, None), "norm": (2, None), "linalg_vector_norm": (2, None),
    "linalg_norm": (2, None), "quantile": (2, None), "nanquantile": (2, None),
    "cumsum": (1, None), "cumprod": (1, None), "cummax": (1, None), "cummin": (1, None),
    "logcumsumexp": (1, None), "softmax": (1, None), "log_softmax": (1, None),
    "sort": (1, -1), "msort": (9, 0), "topk": (2, -1), "kthvalue": (2, -1), "mode": (1, -1),
}
#: the linear reductions (not in ``DIMS``: the loss window's sum and mean over the records
#: are the loss's own reduction, no pick); the forward pass notes them too, measured on the
#: outputs with one row per record only (``refuse_reached``)
LINEAR = {"sum": (1, None), "mean": (1, None), "nansum": (1, None), "nanmean": (1, None)}
#: the statistics the use tracker notes in the forward pass (a softmax or a cumulative sum
#: over the records changes every record's outputs: the halves check's)
REDUCTIONS = frozenset({
    "max", "min", "amax", "amin", "median", "nanmedian", "prod", "logsumexp", "std", "var",
    "std_mean", "var_mean", "norm", "linalg_vector_norm", "linalg_norm", "quantile",
    "nanquantile", *LINEAR})
#: every op the use tracker notes over the records, measured by its share of the gradient: the
#: statistics and the orders, cumulative ops and softmaxes of ``DIMS`` (a prefix sum whose
#: value a straight-through term cancels, ``s - (s + 0).detach()`` with s = o.cumsum(0),
#: changes no value the halves check compares, and coupled records at full strength in every
#: batched method until 2026-12-02, probe AH)
NOTED = frozenset({*REDUCTIONS, *DIMS})


def reduces_dim0(name: str, args, kwargs, x: torch.Tensor) -> bool:
    """``name(x, ...)`` (a ``DIMS`` reduction) reduces over x's dim 0: no ``dim`` where the
    default is every dim, or a ``dim`` that includes 0; ``torch.max(a, b)`` is elementwise,
    ``x.std(True)`` (unbiased) reduces every dim."""
    at, default = DIMS[name] if name in DIMS else LINEAR[name]
    dim = kwargs["dim"] if "dim" in kwargs else kwargs["axis"] if "axis" in kwargs else \
        args[at] if len(args) > at else default  # axis=: NumPy's name, which torch takes
    if isinstance(dim, torch.Tensor):
        return False
    if dim is None or isinstance(dim, bool):
        return True
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return any(isinstance(d, int) and d % x.dim() == 0 for d in dims)


def over_records(name: str, args, kwargs, rows_of) -> bool:
    """``name(*args, **kwargs)`` reduces over dim 0 of a tensor holding two or more records:
    its rows proved to be the batch's (``rows_of``, ``flat_rows.py``). A tensor whose dim 0
    merely has n entries (time-major steps, ensemble members, a record's own positions) is
    not taken for the records: a reduction over it raised at random n until 2026-11-30."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not reduces_dim0(name, args, kwargs,
                                                                              x):
        return False
    rows = rows_of(x)
    return rows is not None and rows[0] >= 2


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
    """The tensor of a reduction's result that gradients flow through (its values: ``max(x,
    dim)`` returns values and indices), or None when none does."""
    t = result[0] if isinstance(result, (tuple, list)) and result else result
    return t if isinstance(t, torch.Tensor) and t.requires_grad else None


def loss_window_tolerance(dtype, device) -> float:
    """The share of the losses' gradient a reduction over the records in loss_fn may carry:
    rounding, 64 ulps of its dtype (float32 7.6e-6, float64 1.4e-14), at most the pass's
    tolerance. A per-record loss reduces over no records, so only a shift-invariant one (a
    global max subtracted before a softmax: 1e-16 in float64) has a share, and it is rounding;
    at the pass's tolerance (float32's 1e-3) a router balance term on the probabilities the
    loss reads, times 1e-4, passed until 2026-12-02 (probe AH)."""
    return min(tolerance_of(dtype, device), 64 * torch.finfo(dtype).eps)


def refuse_reached(notes: list, outputs, graph_nodes, paused, tolerance,
                   who: str = "the model") -> None:
    """Raise ``SampleMixingError`` if the outputs' gradient depends on a noted reduction.

    ``notes``: [(result, x, description, n)], each reduction's result and the tensor it
    reduced, held since the op (so their nodes' ids are theirs: ``derived.graph_nodes``),
    and for a linear one (``LINEAR``) the records' count n: measured through the outputs with
    n rows alone. A mixing term switched on by a schedule (``h + g * h.mean(0)``, g tiny at
    the checked step, 0.5 later) was seen by no check after the first until 2026-11-30.
    A note whose node the graph from ``outputs`` (tensors) reaches is measured: with v a
    fixed random direction over the outputs, the part of ∂⟨v, outputs⟩/∂x that flows through
    the reduction, against all of it; above ``tolerance(x.dtype)`` it is refused. A
    shift-invariant use (``h - h.max()`` before a softmax) gets 1e-16 of it in float64 and
    passes; Nystromformer's start gets 1e-5. ``paused``: a context in which the recorders'
    tensor hooks ignore these extra gradient passes; ``tolerance(dtype, device)``: the
    pass's (``precision.tolerance_of``: TF32 on a GPU rounds the products too). ``who``:
    "loss_fn" for the functional API's loss window, measured from the losses (n,): a
    per-record loss reduces over no records, so any such reduction its gradient flows through
    couples them (``LossCouplingError``; a global max subtracted for stability passes)."""
    if not notes:
        return
    starts = [t for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for n in {note[3] for note in notes}:  # None: a non-linear statistic, every output;
        # n: a sum or mean over the records, every output but the 0-dim ones (a loss the
        # model computes inside its forward is a mean over the records by design:
        # model_loss.py; a 0-dim output a per-record loss reads is refused by
        # ``checks.scalar_output_problem``). Outputs of other than n rows were left out until
        # 2026-12-02: a router's balance vector p.mean(0), (E,), added to every record's loss
        # passed ghost clipping silently.
        mine = [t for t in starts if n is None or t.dim()]
        _measure([note[:3] for note in notes if note[3] == n], mine, graph_nodes, paused,
                 tolerance, who)


def _measure(notes, starts, graph_nodes, paused, tolerance, who) -> None:
    """``refuse_reached`` for the notes measured on the outputs ``starts``."""
    held = {id(r.grad_fn): (r, x, what) for r, x, what in notes}
    reached = [hit for node in graph_nodes(starts)
               for hit in [held.get(id(node))] if hit is not None and hit[0].grad_fn is node]
    if not reached:
        return
    outs = [t for t in starts if t.is_floating_point()]
    gen = torch.Generator().manual_seed(0)
    v = [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in outs]
    for r, x, what in reached:
        with paused(), torch.enable_grad():
            g_r, g_x = torch.autograd.grad(outs, [r, x], grad_outputs=v, retain_graph=True,
                                           allow_unused=True)
            if g_r is None:
                continue
            (through,) = torch.autograd.grad(r, x, grad_outputs=g_r, retain_graph=True,
                                             allow_unused=True)
        if through is None:
            continue
        part = float(through.double().norm())
        whole = float(g_x.double().norm()) if g_x is not None else 0.0
        if part <= tolerance(x.dtype, x.device) * max(whole, part) or part == 0.0:
            continue
        raise (SampleMixingError if who == "the model" else LossCouplingError)(
            f"{who} couples the records: {what}, and the "
            f"{'outputs' if who == 'the model' else 'losses'}' gradient flows through "
            f"it ({part / max(whole, 1e-300):.3g} of the gradient there). Every record's "
            f"loss then sends gradient through it to the other records (even where the "
            f"outputs hardly change with it: an iteration started from it that converges, HF "
            f"Nystromformer's pseudo-inverse; a term whose factor was small when the model "
            f"was checked), so a record's clipped gradient carries the others' and per-record "
            f"clipping bounds nothing. Reduce over each record's own dims (dim >= 1, "
            f"keepdim=True), or use constants of the data set")


__all__ = ["DIMS", "LINEAR", "NOTED", "REDUCTIONS", "caller", "loss_window_tolerance", "noted",
           "over_records", "reduces_dim0", "refuse_reached"]
