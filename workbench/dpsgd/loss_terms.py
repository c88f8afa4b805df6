"""Batch statistics inside the loss: a normalisation computed from the other records' data.

The loss window's coupling test (``loss_watch.py``) differentiates the loss twice through the
model's output o: it sees every way record i's ∂L/∂o_i moves with o_j. A hand-written
normalisation by a *data-derived* batch constant escapes it, because the constant carries no
gradient:

    L = Σ_i w_{y_i} ℓ_i / Σ_j w_{y_j}     L = Σ_t m_t ℓ_t / Σ_t m_t     L = Σ_i ℓ(o_i, y_i / max y)

(class weights by label, an ``ignore_index`` count, a mask from targets or inputs, a batch
scale of the targets). Record i's gradient is then scaled (or its target moved) by a number
that depends on every other record's labels: removing record j moves every other record's
contribution to the clipped sum, and the sensitivity is no longer C (Abadi et al. 2016,
arXiv 1607.00133: ∇ℓ_i must be a function of record i alone).

**The invariant:** the loss passed to ``backward`` depends on the batch's data only through
terms with one record each. ``BatchStatistics`` follows the window's operations (a
``TorchFunctionMode`` sees each call): a *reduction over the records* (dim 0, or all dims,
of a tensor with n·m rows, m rows per record) of a tensor without gradient, or the detached
copy (``.detach()``, ``.data``) of such a reduction with gradient, is a **batch statistic**;
every tensor computed from one is one too, and so is every Python number read from one
(``.item()``, ``float()``) when it multiplies or divides (matched by value). Numbers read
from the model's outputs (an accuracy count, a logged loss) and numbers equal to a row count
(the ordinary mean's n or n·T) are not matched: a loop dividing by a constant that happens
to equal them must not be refused.
``loss.backward()`` on a batch statistic raises ``LossCouplingError`` naming the statistic.
The loss's own reduction (``loss_none.mean()``, carrying gradient) is not one: its gradient
is linear in the records' terms.

A statistic computed before the model's forward pass (a Trainer's ``num_items_in_batch``) is
followed from the moment the engine's loader hands out the batch (``loss_watch.watched``),
or from the optimizer's boundary (created, ``zero_grad``, ``step``) with a loader the engine
does not own, n then unknown until the forward pass (``settle``), and carried into the window.
A number read from a statistic is followed into a multiplication, division or shift.

**Where the batch leaves torch** (a tensor of the batch with >= 2 records exported to NumPy or
Python: ``.numpy()``, ``__array__``, ``tolist()``), what the loop computes from it there (a
batch mean in NumPy, ``np.bincount``, a ``Counter``) cannot be followed. So after such an
export in the window, a tensor made from host values (``torch.tensor``, ``as_tensor``,
``asarray``, ``new_tensor``, ``torch.from_numpy``: no mode sees the last, so it is wrapped while
a window that saw an export is followed, ``_follow_host``) is a statistic named by what left
torch and what came back (``LEFT_TORCH``): a model input or loss computed from it is refused
with its own message (``left_torch_message``). Inputs standardised per batch in NumPy moved
one record's influence to 3.75 C, silently, until 2026-11-30. Not refused: an export of the
model's outputs (an accuracy) or of a tensor made in the window from no data (timm's
per-record mixup ``torch.linspace(0.5, 0.9, n).tolist()``, ``made``), an export no host-made
tensor follows (labels logged), a
tensor made before the export or before the window (constants), a zero scalar (an
accumulator), and tensors made from host values when nothing of the batch left torch (a
tokenizer in the collate_fn or on a prompt).
A Python number brought back (``x / float(np.abs(a).max())``, ``max(x.tolist())``) is no
tensor: the export's own whole-batch statistics (max, min, |max|, |min|, mean, std, sum, norm,
the mean and sum of |x|, and their reciprocals: ``host_numbers``) are kept, and a non-integer
number equal to one of them (relative 1e-9) in a multiplication, division or shift marks the
result as a statistic (a literal such as 255.0 matches none of them; a per-column statistic
comes back as an array). Other statistics read back as numbers (a median, a percentile) are
not matched.

Notation: n records, m rows per record (positions), o model output, ℓ a record's term.
"""

import math
import weakref

import torch
from torch.utils._pytree import tree_flatten

from workbench.dpsgd.row_mixing import RowOrder
from workbench.errors import LossCouplingError
from workbench.per_sample.flat_rows import ELEMENTWISE
from workbench.per_sample.leaves import call_leaves, leaves

#: reductions (by function name) that combine the records when applied over dim 0
REDUCTIONS = {"sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "aminmax",
              "count_nonzero", "std", "var", "std_mean", "var_mean", "norm", "logsumexp",
              "prod", "median", "nanmedian", "quantile", "nanquantile", "linalg_vector_norm",
              "all", "any", "cumsum", "cumprod", "softmax", "log_softmax", "bincount", "histc",
              "histogram", "unique", "unique_consecutive", "mode", "sort", "argsort",
              "kthvalue", "msort", "topk"}
DETACH = {"detach", "detach_"}
TO_NUMBER = {"item", "__float__", "__int__", "__index__", "tolist"}
CARRY = {"item", "tolist"}
"""Reads whose numbers carry where they came from (``BatchNumber``, ``BatchInt``)."""
PLAIN_READS = {"__float__", "__int__", "__index__"}
"""Reads Python makes plain numbers of, followed by value (``BatchStatistics.float_read``)."""
ARITHMETIC = {"div", "div_", "mul", "mul_", "true_divide", "__truediv__", "__rtruediv__",
              "__mul__", "__rmul__", "__itruediv__", "__imul__", "__rdiv__", "__div__",
              "multiply", "divide",
              # a shift by a number read from a statistic (x - x.median().item())
              "sub", "sub_", "__sub__", "__rsub__", "__isub__", "subtract", "add", "add_",
              "__add__", "__radd__", "__iadd__"}
GATES = {"gt", "ge", "lt", "le", "eq", "ne", "__gt__", "__ge__", "__lt__", "__le__", "__eq__",
         "__ne__", "greater", "greater_equal", "less", "less_equal", "not_equal", "maximum",
         "minimum", "clamp", "clamp_min", "clamp_max", "clip", "fmax", "fmin"}
"""A comparison or a bound: against a reduction over the records (with gradient, or its
number), record i's term switches with the others' (``l[l > l.mean()]``: one record moved
the released sum by 6 C, silently, until 2026-11-30; the detached mean was refused)."""
EXPORTS = {"numpy", "__array__", "tolist"}
"""The batch leaving torch for NumPy or Python, where no mode follows it."""
FROM_HOST = {"tensor", "as_tensor", "asarray", "new_tensor", "from_numpy"}
"""A tensor made from host values: what comes back into the step after ``EXPORTS``."""
LEFT_TORCH = "after the batch left torch"
PICKERS = {"__getitem__", "index_select", "take", "gather", "take_along_dim", "masked_select"}
"""Picking the records by an index computed from a reduction over them (``l.argsort()``)."""
LAST_DIM = {"sort", "argsort", "topk", "kthvalue"}  # ops whose dim defaults to the last
DIM_THIRD = {"norm", "linalg_vector_norm", "quantile", "nanquantile", "kthvalue",
             "topk"}  # (x, p or q or k, dim)


PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "cdist"}
"""Products pairing the rows of their first operand with the columns of their second
(``cdist``: with its rows): ``_crossed`` reads where each operand's records land."""
CROSSED_ELEMENTWISE = ELEMENTWISE | {"cosine_similarity", "pairwise_distance", "mse_loss",
                                     "l1_loss", "smooth_l1_loss", "huber_loss", "lerp",
                                     "addcmul", "addcdiv", "fmax", "fmin", "hypot"}
"""Broadcasting ops: two operands' records on different dims from the right pair them."""


SELECTED_MEANS = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
                  "binary_cross_entropy", "binary_cross_entropy_with_logits",
                  "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss",
                  "multilabel_soft_margin_loss", "multi_margin_loss",
                  "multilabel_margin_loss", "hinge_embedding_loss", "cosine_embedding_loss",
                  "margin_ranking_loss", "triplet_margin_loss", "cross_entropy", "nll_loss"}
"""Loss functions whose default reduction is a mean over every element (``_selection``)."""


NORMS = {"batch_norm", "layer_norm", "normalize", "rms_norm"}
"""Normalisations computed in one fused call: over dim 0 (``_normalised``) they are batch
statistics as a ``mean`` and ``std`` there are. A ``BatchNorm`` in training mode outside the
private model (a distillation teacher left in ``.train()``, a preprocessing module) or
``F.batch_norm(x, None, None, training=True)`` on the inputs moved one record's influence to
1.7-1.8 C, silently, until 2026-12-01 (``x.std(0)`` was refused)."""


def _normalised(name: str, args, kwargs, ndim: int) -> set:
    """The dims a ``NORMS`` call normalises over (``F.batch_norm``, ``torch.batch_norm``:
    training at position 5 in both; with running statistics and not training none)."""
    def arg(i, key, default=None):
        return kwargs[key] if key in kwargs else args[i] if len(args) > i else default
    if name == "batch_norm":
        training = arg(5, "training", False)
        stats = arg(1, "running_mean"), arg(2, "running_var")
        if name == "batch_norm" and len(args) > 3 and isinstance(args[3], torch.Tensor) \
                and args[3].dim() == 1 and "running_mean" not in kwargs:  # torch.batch_norm:
            stats = args[3], args[4] if len(args) > 4 else None  # (x, w, b, rm, rv, ...)
        return {d for d in range(ndim) if d != 1} if training or None in stats else set()
    if name == "normalize":
        dim = arg(2, "dim", 1)
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return {d % ndim for d in dims if isinstance(d, int)}
    shape = arg(1, "normalized_shape", ())  # layer_norm, rms_norm: the trailing dims
    k = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (tuple, list,
                                                                         torch.Size)) else 0
    return set(range(max(ndim - k, 0), ndim))


def _dims(func, args, kwargs, ndim: int):
    """The reduced dimensions (all of them when none is given)."""
    name = getattr(func, "__name__", "")
    at = 2 if name in DIM_THIRD else 1
    dim = kwargs.get("dim", args[at] if len(args) > at else None)
    if dim is None and name in LAST_DIM and ndim:
        return {ndim - 1}  # (o.argsort(): over each record's classes, not the records)
    if dim is None or ndim == 0:
        return set(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return {d % ndim for d in dims if isinstance(d, int)}


def written(name: str, args, out) -> list:
    """What ``name(*args)`` leaves holding its result: ``out``, and for a write in place
    (``x[box] = x[perm][box]``: CutMix, ``x.copy_(...)``, ``x.add_(stat)``) the tensor written
    and the base it views: ``__setitem__`` returns None, so CutMix's pasted batch carried no
    mark into the model, silently, until 2026-11-30."""
    found = [out]
    if (name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))) \
            and args and isinstance(args[0], torch.Tensor):
        t, base = args[0], args[0]._base
        found.append(t)
        if base is not None and t.dim() and base.dim() and t.shape[0] == base.shape[0] \
                and t.stride(0) == base.stride(0):  # a view over the base's rows (a box of
            found.append(base)  # every record), not one record's (``for r in x: r.add_``)
    return found


class BatchNumber(float):
    """A Python number read in the loss window by ``item()`` or ``tolist()`` from a batch
    statistic, a reduction with gradient or the model's outputs, carrying ``what`` it was
    read from through Python's arithmetic (``1 + acc.item()``, ``loss / loss.item()``,
    ``round``, ``math.floor``, ``max``), so that where it enters an op of the window the
    result is a statistic of the batch (``BatchStatistics.after``): a loss scaled by it
    weights every record by the others. Probe AL: ``loss * (1 + (y == 0).double().mean()
    .item())`` released 1.21-1.50x the clipped sum, ``loss / loss.item()`` 0.84-0.93x,
    silently, until 2026-12-02 (a number was matched by its value only, and one read from the
    outputs, an accuracy, not at all); a count (``(y == 0).sum().item()``, an int:
    ``BatchInt``) and ``tolist()`` carried nothing until 2026-12-02 (evening). What Python
    makes a plain number cannot carry it: ``float(t)`` and ``int(t)`` (Python converts what
    ``__float__`` returns to an exact float), ``math.exp`` and the other math functions,
    NumPy scalars; those are followed by value (``BatchStatistics.float_read``)."""

    what: str = ""

    def __new__(cls, value, what: str):
        number = super().__new__(cls, value)
        number.what = what
        return number

    def __reduce__(self):
        return float, (float(self),)  # a pickle or a copy is the plain number


class BatchInt(int):
    """``BatchNumber``'s integer twin: a count read by ``item()`` (``(y == 0).sum().item()``,
    the correct predictions of a batch), carried through arithmetic the same way (a true
    division gives a ``BatchNumber``)."""

    what: str = ""

    def __new__(cls, value, what: str):
        number = super().__new__(cls, value)
        number.what = what
        return number

    def __reduce__(self):
        return int, (int(self),)


def carried(value, what: str):
    """``value`` (a Python number, or a list of them from ``tolist()``) as numbers that carry
    ``what``; a bool, or anything else, as it is (bool cannot be subclassed)."""
    if type(value) is float:
        return BatchNumber(value, what)
    if type(value) is int:
        return BatchInt(value, what)
    if type(value) is list:
        return [carried(v, what) for v in value]
    return value


def _short(value: float, digits: int) -> bool:
    """Whether ``value`` is a decimal of at most ``digits`` significant digits (0.5, 2,
    1e-3, 0.125), up to the rounding of one addition."""
    short = float(f"{value:.{digits}g}")
    return abs(value - short) <= 1e-12 * max(1.0, abs(value))


def _carrying(base_type, op: str):
    base = getattr(base_type, op)

    def method(self, *others):
        out = base(self, *others)
        if out is NotImplemented:
            return out
        if type(out) is tuple:  # (divmod)
            return tuple(carried(v, self.what) for v in out)
        return carried(out, self.what)

    method.__name__ = op
    return method


_ARITHMETIC_OPS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                   "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
                   "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__",
                   "__divmod__", "__rdivmod__", "__round__", "__trunc__", "__floor__",
                   "__ceil__")
for _op in _ARITHMETIC_OPS:
    setattr(BatchNumber, _op, _carrying(float, _op))
for _op in _ARITHMETIC_OPS + ("__lshift__", "__rlshift__", "__rshift__", "__rrshift__",
                              "__and__", "__rand__", "__or__", "__ror__", "__xor__",
                              "__rxor__", "__invert__"):
    setattr(BatchInt, _op, _carrying(int, _op))
del _op


class BatchStatistics:
    """The batch statistics of one loss window (module docstring)."""

    #: attributes that are ops to ``after`` (``l.mean().data``, ``o.T``, ``o.mT``)
    ATTRIBUTES = frozenset({"data", "T", "mT"})

    def __init__(self, before: bool = False, earlier=None):
        self.before = before  # the window from the loader's batch to the forward pass
        self.earlier = earlier  # row_mixing.Earlier: the records of earlier batches
        self.reset(0)

    def reset(self, n: int | None, outputs=()) -> None:
        """n records (None: not known yet, ``settle`` names it at the forward pass)."""
        self.n, self.on = n, n is None or n >= 2
        self.derived: dict[int, tuple] = {}  # id -> (weakref, ""): computed from the outputs
        self._mark(self.derived, list(outputs), "")
        self.stats: dict[int, tuple] = {}  # id -> (weakref, what): batch statistics
        self.reductions: dict[int, tuple] = {}  # id -> (weakref, what): with gradient
        self.numbers: dict[float, str] = {}  # Python numbers read from a statistic
        self.plain: dict[float, str] = {}  # read by float(t), int(t): value, what (float_read)
        self.gates: dict[float, str] = {}  # numbers read from a reduction with gradient
        self.rows: set[int] = {n}  # row counts seen: n, n·T (the ordinary mean's constant)
        self.source: dict[str, int] = {}  # what -> rows of the reduced tensor (n unknown)
        self.order = RowOrder(self.before, self.earlier)  # rows of two records combined
        self.exported: tuple | None = None  # (what left torch, its rows): EXPORTS
        self.host_numbers: list[tuple] = []  # the exports' statistics (numbers)
        self.made: dict[int, tuple] = {}  # id -> (weakref, ""): made in the window, no data
        self.selected: dict[int, tuple] = {}  # id -> (weakref, what): the records a mask of
        # the batch's data kept (``o[y > 0]``): a mean over them divides by their count
        self.branched: str | None = None  # a statistic the loop branched on (``__bool__``)
        _follow_host(self, False)

    def _batch(self, rows: int) -> bool:
        """A tensor of ``rows`` rows may hold the records (n·m rows; any, n not known yet)."""
        return rows % self.n == 0 if self.n is not None else rows >= 2

    def settle(self, n: int, shape) -> None:
        """The forward pass names n (its input's ``shape``): of the statistics followed with n
        unknown, keep those over n·m rows, m a product of the input's leading feature dims
        (n, n·T): a per-record normalisation in the data set (an audio clip's own mean over
        its 16000 samples) is not one of the batch."""
        if self.n is not None or not self.on:
            return
        valid, m = set(), 1
        for size in (1, *shape[1:]):
            m *= int(size)
            valid.add(n * m)
        kept = tuple(w for w, r in self.source.items()
                     if (r & valid if isinstance(r, frozenset) else r in valid))
        self.stats = {k: v for k, v in self.stats.items() if v[1].endswith(kept)}
        rows = self.exported[1] if self.exported is not None else None
        if self.exported is not None and not (rows & valid if isinstance(rows, frozenset)
                                              else rows in valid):
            self.exported = None  # (not the batch's rows: a per-record array of the data set)
            _follow_host(self, False)
        self.reductions = {k: v for k, v in self.reductions.items() if v[1].endswith(kept)}
        self.numbers = {v: w for v, w in self.numbers.items() if w.endswith(kept)}
        self.plain = {v: w for v, w in self.plain.items() if w.endswith(kept)}
        if self.branched is not None and not self.branched.endswith(kept):
            self.branched = None  # (a branch on a tensor not of the batch's rows)
        self.n, self.on = n, n >= 2  # an empty batch (n = 0) follows nothing, keeps no rows
        self.rows = {r for r in self.rows if r and n and r % n == 0} | {n}

    def _find(self, table, t):
        entry = table.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _has(self, table, t) -> bool:
        entry = table.get(id(t))
        return entry is not None and entry[0]() is t

    def _mark(self, table, out, what: str) -> None:
        for t in leaves(out):
            if isinstance(t, torch.Tensor):
                table[id(t)] = (weakref.ref(t), what)

    def follow(self, func, args, kwargs, out):
        """``after``, then ``out`` as the caller returns it: a number read from the batch by
        ``item()`` or ``tolist()`` as a ``BatchNumber`` or ``BatchInt`` that carries where it
        came from. ``float(t)`` and ``int(t)`` cannot carry (Python converts what they return
        to a plain number): ``float_read`` follows their value."""
        self.after(func, args, kwargs, out)
        if not self.on or not args or not isinstance(args[0], torch.Tensor):
            return out
        name = getattr(func, "__name__", "")
        if name not in CARRY and name not in PLAIN_READS:
            return out
        t = args[0]
        what = self._find(self.stats, t) or self._find(self.reductions, t)
        if what is None and self._has(self.derived, t):
            what = f"a {tuple(t.shape)} tensor computed from the model's outputs"
        if what is None:
            return out
        if name in PLAIN_READS:
            self.float_read(out, what)
            return out
        if type(out) in (float, int):
            return carried(out, f"the number {out:g} read from {what}")
        return carried(out, f"a number read back {LEFT_TORCH} by {name}() of {what}")

    def float_read(self, out, what: str) -> None:
        """A number read by ``float(t)`` or ``int(t)`` from a statistic, a reduction with
        gradient or the model's outputs: Python hands back a plain number, so it is matched
        by value where it enters an op (``loss / float(loss)``, ``loss * float(acc)``), unless
        it is a decimal of two digits (0.5, 2, 0.25: as often a constant of the code; an
        accuracy of 4 in 8 is missed) or a row count. Shifted or scaled by a short constant
        (``1 + float(acc)``), it is matched as such (``_related``); through more arithmetic
        than that it is not seen: ``.item()`` carries it (``BatchNumber``)."""
        if isinstance(out, bool) or not isinstance(out, (int, float)) \
                or not math.isfinite(out) or out in self.rows or _short(out, 2):
            return
        what = f"the number {out:g} read by float() from {what}"
        self.numbers.setdefault(float(out), what)
        self.plain.setdefault(float(out), what)

    def _related(self, flat) -> str | None:
        """A plain number of ``flat`` that is one read by ``float(t)`` (``plain``) shifted
        or scaled by a short decimal: ``1 + float(acc)``, ``1 - v``, ``2 * v``, ``1 / v``,
        ``v + 1e-3``. A constant of the code is itself a short decimal, and one that is not
        differs from a read number by a short decimal by chance only."""
        for s in flat:
            if type(s) is not float or not math.isfinite(s) or _short(s, 2):
                continue
            for v, what in self.plain.items():
                if v and any(a and _short(a, 3) for a in (s - v, s + v, s / v, s * v)):
                    return f"{what} (the loss's factor {s:g} is it shifted or scaled by a " \
                           f"constant)"
        return None

    def after(self, func, args, kwargs, out) -> None:
        """Follow one call of the window: ``out = func(*args, **kwargs)``."""
        if not self.on:
            return
        name = getattr(func, "__name__", "")
        if func == torch.Tensor.data.__get__:  # (a new method-wrapper each access: ==)
            name = "detach"
        elif func == torch.Tensor.T.__get__ and args and isinstance(args[0], torch.Tensor):
            name, args = "permute", (args[0], tuple(range(args[0].dim() - 1, -1, -1)))
        elif func == torch.Tensor.mT.__get__ and args and isinstance(args[0], torch.Tensor):
            name, args = "transpose", (args[0], -2, -1)
        flat = call_leaves(args, kwargs)  # == tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        self.order.derive(name, tensors, out)  # (a running mean of the batches: earlier's)
        for t in tensors:
            if t.dim() and self._batch(t.shape[0]):
                self.rows.add(int(t.shape[0]))
        if all(self._has(self.made, t) for t in tensors):  # (none: a factory, linspace)
            self._mark(self.made, written(name, args, out), "")
        else:  # (data written into a buffer made in the window: buf[:] = x)
            for t in written(name, args, out)[1:]:
                self.made.pop(id(t), None)
        if name in EXPORTS and tensors and tensors[0].dim() and tensors[0].shape[0] >= 2 \
                and self._batch(tensors[0].shape[0]) \
                and not self._has(self.derived, tensors[0]) \
                and not self._has(self.made, tensors[0]) \
                and not self._has(self.stats, tensors[0]):  # (an accuracy, per-record λs; a
            # statistic's export is followed below, with the statistic's rows)
            x = tensors[0]
            left = f"{name}() of a {tuple(x.shape)} {x.dtype} tensor of the batch"
            if self.exported is None:
                self.exported = (left, int(x.shape[0]))
                _follow_host(self, True)
            self.host_numbers += host_numbers(x, left)
        elif name in FROM_HOST and self.exported is not None and not any(
                isinstance(a, torch.Tensor) for a in flat[1 if name == "new_tensor" else 0:]):
            self.host(f"{'Tensor' if name == 'new_tensor' else 'torch'}.{name}()", out)
        if any(self._has(self.derived, t) for t in tensors):
            self._mark(self.derived, out, "")
        what = next((w for t in tensors for w in [self._find(self.stats, t)] if w), None)
        if what is None:  # a number read from the batch, through any arithmetic (BatchNumber)
            what = next((v.what for v in flat if isinstance(v, (BatchNumber, BatchInt))),
                        None)
        if what is None and name in DETACH and tensors:
            what = self._find(self.reductions, tensors[0])
        if what is None and name not in DETACH and name not in TO_NUMBER:  # computed from a
            # reduction with gradient: its detached copy is a statistic as the reduction's
            # is (``o.softmax(1).mean(0, keepdim=True).expand_as(o).detach()``: probe AI,
            # silent until 2026-12-02; only the reduction's own detach was followed)
            reduced = next((w for t in tensors for w in [self._find(self.reductions, t)]
                            if w), None)
            if reduced is not None:
                self._mark(self.reductions, [t for t in leaves(out) if isinstance(
                    t, torch.Tensor) and t.requires_grad], reduced)
        if what is None:
            what = self._selection(name, args, kwargs, tensors, out)
        if what is None and name in GATES and len(tensors) > 1:  # (a bound on the reduction
            # itself, L.clamp(max=t), is record_reduction's "coupled" kind)
            what = next((w for t in tensors for w in [self._find(self.reductions, t)] if w),
                        None)
        if what is None and name in PICKERS and len(tensors) > 1:  # l[l.argsort()[:k]]
            what = next((w for t in tensors[1:] for w in [self._find(self.reductions, t)]
                         if w), None)
        if what is None and name in GATES and tensors:
            what = next((self.gates[float(v)] for v in flat
                                       if isinstance(v, (int, float))
                                       and not isinstance(v, bool) and float(v) in self.gates),
                                      None)
        if what is None and name in TO_NUMBER and tensors:
            reduced = self._find(self.reductions, tensors[0])
            if reduced is not None:  # (l.mean().item(): a gate's threshold, not arithmetic's)
                self._gate(out, reduced)
        if what is None and name in ARITHMETIC:
            what = next((self.numbers[float(v)] for v in flat
                         if isinstance(v, (int, float)) and not isinstance(v, bool)
                         and float(v) in self.numbers), None)
        if what is None and name in ARITHMETIC and self.plain:
            what = self._related(flat)
        if what is None and name in ARITHMETIC and self.host_numbers and tensors:
            what = self._host_number(flat, tensors)
        if what is not None and name == "__bool__" and self.branched is None \
                and self.n is not None and not self._has(self.derived, tensors[0]):
            # ``if x.sum() > 0:`` (n known: at an optimizer boundary of a loop by hand any
            # tensor of >= 2 rows may be the batch, and a check of the last update,
            # ``torch.isfinite(update).all()``, is none of its records')
            self.branched = what
        if what is not None:
            if (name in TO_NUMBER or name in EXPORTS) and self.exported is None \
                    and not self._has(self.derived, tensors[0]):  # a statistic leaving torch:
                # what comes back from host values is one too (``mu = x.mean(0).tolist()``,
                # then ``x - torch.tensor(mu)``: silent until 2026-12-01 unless the columns
                # happened to number n, the only exports followed being the batch's rows)
                self.exported = (f"{name}() of {what}", self.source.get(what, self.n))
                _follow_host(self, True)
            if name in TO_NUMBER:  # not an accuracy count or a logged loss: not the outputs'
                if not self._has(self.derived, tensors[0]):
                    self._number(out, what)
                self._gate(out, what)  # (a gate's threshold all the same: l.detach().mean())
            else:
                self._mark(self.stats, written(name, args, out), what)
            return
        what = self.order.after(name, args, kwargs, tensors, out,
                                lambda t: self._has(self.derived, t))
        rows = (self.order.records or {max(int(t.shape[0]) for t in tensors if t.dim())}) \
            if what is not None else ()  # (slices of a batch: every row count on the way)
        if what is not None and any(self._batch(r) for r in rows):
            self.source[what] = frozenset(rows)
            self._mark(self.stats, written(name, args, out), what)
            return
        what = self._crossed(name, args, tensors)
        if what is not None:
            self.source[what] = self.n
            self._mark(self.stats, written(name, args, out), what)
            return
        x = tensors[0] if tensors and args and args[0] is tensors[0] else None
        at = self.order.records_dim(x) if x is not None and x.dim() else None  # (x.T: 1; a
        # time-major view: 1, a mean over its dim 0 is over time; moved elsewhere by a
        # reshape: not followed. A mean over x.T's dim 1 was no statistic until 2026-12-01)
        if (name in REDUCTIONS or name in NORMS) and at is not None \
                and self._batch(x.shape[at]) and at in (
                    _normalised(name, args, kwargs, x.dim()) if name in NORMS else
                    _dims(func, args, kwargs, x.dim())) and not self.order.made(x):
            what = f"{name}() over the records of a {tuple(x.shape)} {x.dtype} tensor" + (
                f" (the records on its dim {at})" if at else "")
            self.source[what] = int(x.shape[at])
            for t in leaves(out):  # an order or an index of the records (argsort, a
                if isinstance(t, torch.Tensor):  # kthvalue's indices) holds no gradient: a
                    self._mark(self.reductions if x.requires_grad and (  # statistic, with
                        t.is_floating_point() or t.is_complex()) else self.stats, t, what)

    def _selection(self, name: str, args, kwargs, tensors, out) -> str | None:
        """Follow the records a mask of the batch's data keeps (``o[y > 0]``,
        ``masked_select``, ``o[(y > 0).nonzero()]``) through the ops after it; ``what`` at a
        mean over them (``mean``, a loss function's mean): it divides by how many records
        the mask kept, a count of the other records' data (``F.mse_loss(o[keep],
        t[keep])``: probe AI, 0.08-0.18 of the step, silent until 2026-12-02, while
        ``(l * keep).sum() / keep.sum()`` was refused). Their sum is each kept record's own
        term and passes."""
        picked = None
        finds = name in ("nonzero", "argwhere") or (name == "where" and len(args) == 1)
        if (finds or name in ("__getitem__", "masked_select")) and tensors:
            mask = tensors[0] if finds else next(
                (t for t in tensors[1:] if t.dtype == torch.bool), None)
            if mask is not None and mask.dtype == torch.bool and mask.dim() \
                    and self.order.records_dim(mask) == 0 and mask.shape[0] >= 2 \
                    and self._batch(int(mask.shape[0])) and not self.order.made(mask) \
                    and not self.order._free(mask) and not self._has(self.made, mask):
                picked = (f"{name}() of the records a mask of the batch's data kept (a "
                          f"{tuple(mask.shape)} mask)")
        if picked is None and name == "__getitem__" and len(tensors) > 1:
            picked = next((w for t in tensors[1:] if not t.is_floating_point()
                           for w in [self._find(self.selected, t)] if w), None)
        if picked is None and name not in ("sum", "nansum") and tensors:
            picked = next((w for t in tensors for w in [self._find(self.selected, t)] if w),
                          None)
            if picked is not None and name in ("__len__", "numel", "size") and isinstance(
                    out, int):  # how many records the mask kept, as a number: a divisor
                self._number(out, picked)  # (``l[keep].sum() / len(l[keep])``)
                return None
            x = tensors[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            dims = dim if isinstance(dim, (tuple, list)) else (dim,)
            over = dim is None or any(isinstance(d, int) and x.dim() and d % x.dim() == 0
                                      for d in dims)  # (a mean over each record's own
            # features, ``o[keep].mean(1)``, is no mean over the records)
            if picked is not None and ((name in ("mean", "nanmean") and over) or (
                    name in SELECTED_MEANS and (kwargs.get("reduction", "mean") == "mean"))):
                return (f"a mean over {picked}: it divides by how many records the mask "
                        f"kept")
        if picked is not None:
            self._mark(self.selected, [t for t in leaves(out)
                                       if isinstance(t, torch.Tensor) and t.dim()], picked)
        return None

    def _slots(self, name: str, args, tensors) -> list:
        """(tensor, where its records land) for each operand of ``name`` holding the batch's
        records (of this batch, ≥ 2 of them, not a tensor the window made from no data):
        ("row"/"col"/"sum", or a batch dim) for a product, the dim from the right for an
        elementwise op, ("sum",) or an output letter for einsum; [] for any other op."""
        ours = lambda t: self._has(self.derived, t)  # noqa: E731
        held = []
        for k, t in enumerate(tensors):
            if not t.dim():
                continue
            at = self.order.records_dim(t)
            if at is None or t.shape[at] < 2 or not self._batch(int(t.shape[at])) \
                    or self.order.made(t) or self.order._free(t) \
                    or not self.order._batchlike(t, ours):
                continue
            held.append((k, t, at))
        if len(held) < 2 and not (held and name in PRODUCTS | {"einsum"}):
            return []
        slots = []
        if name in PRODUCTS and len(tensors) == 2:
            order = (1, 0) if name == "__rmatmul__" else (0, 1)
            for k, t, at in held:
                side, p = order[k], at - t.dim()
                if t.dim() == 1 or (name == "cdist" and p == -1):
                    slot = ("sum",)
                elif p <= -3:
                    slot = ("batch", p)
                elif side == 0:
                    slot = ("row",) if p == -2 else ("sum",)
                elif name == "cdist":
                    slot = ("col",)
                else:
                    slot = ("col",) if p == -1 else ("sum",)
                slots.append((t, slot))
        elif name == "einsum" and args and isinstance(args[0], str) and "..." not in args[0] \
                and "->" in args[0]:
            inputs, output = args[0].replace(" ", "").split("->")
            inputs = inputs.split(",")
            if len(inputs) != len(tensors):
                return []
            for k, t, at in held:
                letter = inputs[k][at] if at < len(inputs[k]) else None
                slots.append((t, ("sum",) if letter is None or letter not in output
                              else ("out", output.index(letter))))
        elif name in CROSSED_ELEMENTWISE:
            slots = [(t, ("dim", at - t.dim())) for k, t, at in held]
        return slots

    def _crossed(self, name: str, args, tensors) -> str | None:
        """``what`` where an op puts one record's rows against other records' values with no
        gradient between them (``z @ z.detach().T``, InfoNCE on keys from a frozen or
        momentum encoder, ``torch.cdist(z, z.detach())``, ``z[:, None] - z.detach()[None]``):
        the double-backward test sees no coupling there, record i's gradient moves with
        record j's data all the same. Operands with gradient on both sides are the
        coupling test's (``loss_watch.coupling``)."""
        slots = self._slots(name, args, tensors)
        if not slots:
            return None
        quiet = [(t, slot) for t, slot in slots if not t.requires_grad]
        for t, slot in quiet:
            if slot == ("sum",) or any(u is not t and other != slot for u, other in slots):
                return (f"{name}() of one record's rows against every record's values "
                        f"without gradient (a {tuple(t.shape)} tensor of the batch, its "
                        f"records on dim {self.order.records_dim(t)}: z @ z.detach().T, "
                        f"InfoNCE on detached keys or a frozen encoder's, torch.cdist(z, "
                        f"z.detach()), z[:, None] - z.detach()[None])")
        return None

    def host(self, made: str, out) -> None:
        """``made`` (``torch.tensor()``...) returned ``out`` from host values, after the batch
        left torch in this window (``self.exported``): a statistic the window cannot follow."""
        if not self.on or self.exported is None or not isinstance(out, torch.Tensor) or (
                not out.dim() and not out.is_complex() and float(out) == 0):  # (an accumulator)
            return
        left, rows = self.exported
        what = f"{made}, a tensor made from host values {LEFT_TORCH} by {left}"
        self.source[what] = rows
        self._mark(self.stats, out, what)

    def _host_number(self, flat, tensors) -> str | None:
        """A number of ``flat`` equal to a statistic of an export (``host_numbers``). A max or
        min is one record's own value too: not matched on one record's tensor (``x[i] *
        w[i]`` with ``w = weights.tolist()``, a per-record loop)."""
        one = any(self.order._inner(t) is not None for t in tensors)
        for v in flat:
            if isinstance(v, (int, float)) and not isinstance(v, bool) \
                    and math.isfinite(v) and v != int(v):  # (1, 2, n: no value to match)
                for value, stat, element in self.host_numbers:
                    if abs(v - value) <= 1e-9 * abs(value) and not (element and one):
                        self.source.setdefault(
                            (what := f"the number {v:g}, {stat}"), self.exported[1])
                        return what
        return None

    def stop(self) -> None:
        """The window stops following (its loss is checked): no more host-made tensors."""
        self.on = False
        _follow_host(self, False)

    def loss_reduced(self, out, what: str) -> None:
        """A loss function or module reduced the records (its sum or mean, with gradient):
        its detached copy is a statistic, as a ``sum`` op's (``L * (L.detach() < t)``: a
        gate on the batch's loss, record i counted or not by the others' terms)."""
        if self.on and isinstance(out, torch.Tensor) and out.requires_grad:
            self._mark(self.reductions, out, f"the batch's loss {what}")

    def _gate(self, out, what: str) -> None:
        for v in tree_flatten(out if isinstance(out, list) else [out])[0]:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.gates[float(v)] = f"the number {v:g} read from {what}"

    def _number(self, out, what: str) -> None:
        values = out if isinstance(out, list) else [out]
        for v in tree_flatten(values)[0]:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in self.rows:
                self.numbers[float(v)] = f"the number {v:g} read from {what}"

    def inherit(self, other: "BatchStatistics") -> None:
        """Carry ``other``'s statistics and numbers (followed before the forward pass) in."""
        if self.on:
            if other.exported is not None and self.exported is None:
                self.exported = other.exported  # (x.numpy() before the forward pass)
                _follow_host(self, True)
            self.stats.update(other.stats)
            self.numbers.update({v: w for v, w in other.numbers.items() if v not in self.rows})
            self.plain.update(other.plain)
            self.branched = self.branched or other.branched  # (``if x.sum() > 0: x = -x``)

    def statistic(self, loss) -> str | None:
        """What makes ``loss`` a batch statistic, or None."""
        return self._find(self.stats, loss) if isinstance(loss, torch.Tensor) else None

    def branch(self) -> str | None:
        """The statistic the loop branched on in this window (``bool()`` of it: an ``if``, a
        conditional expression, ``and``/``or``), or None. Python's control flow cannot be
        followed: ``(1.0 if x.sum() > 0 else -1.0) * loss`` flips every record's term by the
        others' data (one record's influence 4.9 C, silently, until 2026-12-01)."""
        return self.branched


def statistic_error(what: str | None, branched: str | None,
                    where: str = "before this backward") -> LossCouplingError | None:
    """The error for a loss that is a batch statistic (``BatchStatistics.statistic``: what
    makes it one) or a window that branched on one (``branch``), else None: the optimizer's
    (``loss_watch.LossWatch.statistics``) and the functional API's
    (``per_sample.recording.record``, ``where="in loss_fn"``) alike."""
    if what is None and branched is not None:
        return LossCouplingError(
            f"the loop branched on {branched} (a statistic of the whole batch, read by "
            f"Python's if, a conditional expression, and/or) {where}: Python's "
            f"control flow cannot be followed, and a choice made from the whole batch (a "
            f"sign, a scale, a loss term switched on) makes record i's term depend on the "
            f"other records' data, so the sensitivity is no longer max_grad_norm. Choose per "
            f"record with tensors (torch.where(cond_i, a_i, b_i) on each record's own "
            f"values), and check the data (asserts) in the Dataset or before the loop, not "
            f"on the batch the engine handed out")
    if what is None:
        return None
    if LEFT_TORCH in what:
        return LossCouplingError(left_torch_message(what, "the loss"))
    return LossCouplingError(
        f"the loss depends on {what} (a statistic of the whole batch, computed from its "
        f"targets, inputs or detached outputs, without gradient): e.g. a normalisation "
        f"w[y].sum(), (y != -100).sum() or mask.sum(), or targets scaled by y.max(). "
        f"Record i's gradient then depends on the other records' data through it, so "
        f"removing one record moves every other record's clipped contribution and the "
        f"sensitivity is no longer max_grad_norm; the coupling cannot be seen through "
        f"the model's output. Let the engine own the normalisation: "
        f"F.cross_entropy(out, y, weight=w, ignore_index=-100) or nn.CrossEntropyLoss("
        f"weight=w) with the mean (made exact per record), or a per-record sum divided by "
        f"a constant (the batch size n, or a fixed number of positions per record) with "
        f"loss_reduction='mean'; scale targets by a constant of the data set")


def host_numbers(x: torch.Tensor, left: str) -> list:
    """The whole-batch statistics of an exported tensor that a loop may bring back as a
    number, each with its description (``BatchStatistics._host_number``)."""
    if x.is_complex() or not x.numel():
        return []
    a = x.detach().double().flatten()
    stats = {"max": a.max(), "min": a.min(), "|max|": a.abs().max(), "|min|": a.abs().min(),
             "mean": a.mean(), "sum": a.sum(), "norm": a.norm(), "|x| mean": a.abs().mean(),
             "|x| sum": a.abs().sum()}
    if a.numel() > 1:
        stats.update({"std": a.std(), "std (ddof 0)": a.std(unbiased=False)})
    found = []
    for stat, value in stats.items():
        value = float(value)
        if math.isfinite(value) and value != int(value):  # (a count, a label's max: no match)
            what = f"read back {LEFT_TORCH} by {left} (equal to the batch's {stat}"
            element = stat in ("max", "min", "|max|", "|min|")  # (one record's value too)
            found.append((value, f"{what})", element))
            found.append((1.0 / value, f"{what}, inverted)", element))
    return found


def left_torch_message(what: str, where: str) -> str:
    """The refusal of ``where`` (the model's input, the loss) computed from ``what``, a tensor
    made from host values after the batch left torch (``BatchStatistics.host``)."""
    return (
        f"{where} depends on {what}: the batch left torch there (to NumPy or Python), and what "
        f"came back into the step was computed where the engine cannot follow it. Computed "
        f"over several records (a batch mean or std in NumPy, class counts from np.bincount "
        f"or collections.Counter), it makes every record's gradient depend on the other "
        f"records, so one record's influence on the released sum is no longer bounded by "
        f"max_grad_norm. Do per-record transforms in the Dataset's transform or the "
        f"DataLoader's collate_fn, or with torch ops in the loop (which the check follows: a "
        f"batch statistic there is refused by name); compute class weights from public data "
        f"or once before the loop; read the batch to NumPy or Python only for logging")


_FROM_NUMPY = torch.from_numpy
_HOST: list = []  # weak references to the BatchStatistics of windows the batch left torch in


def _from_numpy(array):
    """``torch.from_numpy`` while a window that saw an export is followed: no
    ``TorchFunctionMode`` sees it, so the windows are told here."""
    out = _FROM_NUMPY(array)
    for ref in list(_HOST):
        stats = ref()
        if stats is not None and stats.on:
            stats.host("torch.from_numpy()", out)
    return out


def _follow_host(stats: "BatchStatistics", on: bool) -> None:
    """Tell ``stats`` of ``torch.from_numpy`` (``on``) or stop; ``torch.from_numpy`` is the
    original whenever no window is told (as ``per_sample.derived.follow_parameters``)."""
    _HOST[:] = [r for r in _HOST if r() is not None and r() is not stats]  # (collected too)
    if on:
        _HOST.append(weakref.ref(stats, _collected))
    torch.from_numpy = _from_numpy if _HOST else _FROM_NUMPY


follow_host = _follow_host  # (loss_watch: a window's mode left or pushed again)


def _collected(ref) -> None:
    """A window collected while it followed (its loop raised, its model was dropped):
    ``torch.from_numpy`` is the original again once no live window is told."""
    _HOST[:] = [r for r in _HOST if r is not ref and r() is not None]
    if not _HOST:
        torch.from_numpy = _FROM_NUMPY


__all__ = ["ARITHMETIC", "DETACH", "DIM_THIRD", "EXPORTS", "FROM_HOST", "LEFT_TORCH", "NORMS",
           "REDUCTIONS", "TO_NUMBER", "BatchStatistics", "left_torch_message",
           "statistic_error"]
