"""Rows of two records combined: a batch partner (mixup, CutMix, x + x.roll(1, 0)).

Mixup (Zhang et al. 2018, arXiv 1710.09412) trains on x̃_i = λ x_i + (1 - λ) x_π(i) and
ỹ_i = λ y_i + (1 - λ) y_π(i), π a permutation of the batch. Record i's input then holds
record π(i)'s data: removing record j moves the gradient of the record paired with it, so
one record reaches two clipped contributions and the sensitivity is 2C, not C (the DP unit
would have to be the pair). No reduction over the records is involved, so
``loss_terms.BatchStatistics`` does not see it by itself; ``RowOrder`` follows the *order
of the rows* instead:

- a tensor whose rows are the records' in another order, ``x[π]``, ``x.index_select(0, π)``,
  ``x.roll(k, 0)``, ``x.flip(0)``, carries that order (a key: the index tensor, the shift);
- an operation keeps its first argument's order;
- an operation combining two data tensors (no gradient; in the loss window also the model's
  outputs) with the same number of rows in *different* orders mixes records: its result is
  a batch statistic (``what``). A loss pairing records (``F.margin_ranking_loss(o, o.flip(0),
  ·)``, a hinge between neighbours) is piecewise linear: the window's second-derivative test
  sees nothing, the row order does.

Reordering a batch consistently (``x[π]``, ``y[π]``, π from ``randperm``) keeps every record
whole and is not one. (An order computed from the data, ``argsort``, is a statistic of the
batch already: ``loss_terms.REDUCTIONS``.)

An order is the tuple of source rows, read from the index's values, so every spelling of
a partner index gives one: ``randperm``, ``torch.roll(torch.arange(n), 1)``, a NumPy
permutation (``torch.from_numpy``, ``torch.tensor``), a Python list (``perm.tolist()``),
orders composed (``x.roll(1, 0).roll(-1, 0)`` is the batch's own order again). Only the
first spelling was followed until 2026-11-30: the others passed mixup silently (0.27-0.58 of
the step). An index is an order only where it is a whole permutation of the rows it picks
(``w[y]``, a class weight per label, picks a table's rows: no order); a tensor index only
where the window made it (``FRESH``, or an op on such an index), or, before the forward
pass, any (``torch.from_numpy`` makes its tensor without a torch function the window sees;
so there a label tensor that happens to be a permutation of 0..n-1 picking the n rows of a
table, n = K classes, is taken for a partner index: refused, never silent). Not in the loss
window: the model's output carries no order, so ``y[perm]`` beside ``model(x[perm])`` (perm
made before the window) would be taken for a partner of the output's rows.

Notation: n rows, π a permutation (an index tensor over dim 0).
"""

import operator
import weakref

import torch
from torch.utils._pytree import tree_flatten

REORDER = {"__getitem__", "index_select", "roll", "flip", "take_along_dim", "randperm"}
FRESH = {"randperm", "arange", "tensor", "as_tensor", "from_numpy", "asarray"}
"""Ops whose 1-d integer output the window follows as a possible index (the loop made it)."""
FREE = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
        "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
        "normal", "eye"}
"""Ops whose output holds no record's data (noise, a mask, a zero buffer): no row order, so
a per-record mask drawn for a shuffled batch (``x[perm] * (torch.rand(n, 1) > 0.1)``) or a
one-hot written into zeros is no partner (both refused until 2026-11-30)."""


def _whole(name: str, args) -> bool:
    """``x[:] = v``, ``x[...] = v``, ``x.copy_(v)`` on a tensor that is no view: the write
    replaces every value of x, so nothing of x's own rows stays beside v's."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0]._base is not None:
        return False
    if name == "copy_":
        return True
    if name != "__setitem__" or len(args) < 2:
        return False
    key = args[1] if isinstance(args[1], tuple) else (args[1],)
    return all(k is Ellipsis or k == slice(None) for k in key)


def _values(index, fresh, m: int, whole: bool = False) -> list | None:
    """An index's values as Python ints where it is a whole permutation of the m rows, else
    None: a 1-d integer tensor the window saw made (``fresh``), or (``whole``: before the
    forward pass) any such tensor (``torch.from_numpy`` makes one unseen: no torch function),
    or a list or NumPy array of ints. Only a permutation: a lookup by labels (``w[y]``, the
    labels made by ``torch.tensor`` in the loader's collate) picks a table's rows, not the
    batch's, and a subset of the rows changes the row count (no partner row by row)."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.shape[0] != m or index.dtype == torch.bool \
                or index.is_floating_point() or index.is_complex() \
                or not (whole or fresh(index)):
            return None
        values = index.tolist()
    elif isinstance(index, list) or (type(index).__module__ == "numpy"
                                     and getattr(index, "ndim", None) == 1):
        if len(index) != m:
            return None
        values = index.tolist() if not isinstance(index, list) else index
        try:
            values = [operator.index(v) for v in values if not isinstance(v, bool)]
        except TypeError:
            return None
    else:
        return None
    return values if sorted(v % m if m else v for v in values) == list(range(m)) else None


def _picked(rows: tuple | None, values: list, m: int):
    """The source rows of ``t[values]`` for t of m rows in order ``rows`` (None: the batch's
    own; ``values`` a permutation of them), None where that is the batch's own order again."""
    base = rows if rows is not None else range(m)
    out = tuple(base[v % m] for v in values)
    return None if out == tuple(range(m)) else ("rows", out)


def _order(name: str, args, kwargs, rows, m: int, fresh, whole: bool = False):
    """The new row order ``name(*args)`` gives its first argument's m rows (in order
    ``rows``): ("rows", source rows), None for the batch's own order, ``False`` for no
    reordering (the first argument's order is kept). ``z[torch.arange(n), y]`` picks each
    record's own entry: the batch's own order."""
    index = None
    if name == "__getitem__" and len(args) > 1:
        index = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
    elif name == "index_select" and len(args) > 2 and args[1] == 0:
        index = args[2]
    elif name == "take_along_dim" and kwargs.get("dim", args[2] if len(args) > 2 else None) == 0:
        index = args[1]
    if index is not None:
        values = _values(index, fresh, m, whole)
        return False if values is None else _picked(rows, values, m)
    if name == "roll":
        dims = kwargs.get("dims", args[2] if len(args) > 2 else None)
        shifts = kwargs.get("shifts", args[1] if len(args) > 1 else None)
        if dims in (0, (0,), [0]) and m:
            k = shifts[0] if isinstance(shifts, (tuple, list)) else shifts
            if isinstance(k, int):
                return _picked(rows, [(i - k) % m for i in range(m)], m)
    if name == "flip":
        dims = kwargs.get("dims", args[1] if len(args) > 1 else None)
        if dims in (0, (0,), [0]):
            return _picked(rows, list(range(m - 1, -1, -1)), m)
    return False


class RowOrder:
    """The row orders of a window's data tensors (module docstring)."""

    def __init__(self, whole: bool = False):
        self.whole = whole  # before the forward pass: a whole permutation is an index too
        self.keys: dict[int, tuple] = {}  # id -> (weakref, ("rows", source rows))
        self.indices: dict[int, weakref.ref] = {}  # id -> weakref: indices the window made
        self.free: dict[int, weakref.ref] = {}  # id -> weakref: tensors of no record (FREE)

    def key(self, t):
        entry = self.keys.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _free(self, t) -> bool:
        ref = self.free.get(id(t))
        return ref is not None and ref() is t

    def made(self, t) -> bool:
        """t is an index the loop made (``FRESH``, or computed from such): no data, so its
        ``argsort`` (a permutation inverted) is no statistic of the batch."""
        ref = self.indices.get(id(t))
        return ref is not None and ref() is t

    def after(self, name: str, args, kwargs, tensors, out, ours=None) -> str | None:
        """Follow ``out = name(*args, **kwargs)``; ``what`` when it mixes two records.
        ``ours(t)``: t is computed from the model's outputs (in the loss window), a record's
        own values although it carries gradient."""
        if isinstance(out, torch.Tensor) and out.dim() == 1 and not out.is_floating_point() \
                and out.dtype != torch.bool and not out.is_complex() and (
                    name in FRESH or (tensors and all(self.made(t) for t in tensors))):
            self.indices[id(out)] = weakref.ref(out)  # an index the loop made, or one
            return None  # computed from such (rolled, sliced, cast): not data
        into = (name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))) \
            and bool(tensors) and self._free(tensors[0]) \
            and not all(self._free(t) for t in tensors[1:])  # records' data written into a
        if into:  # tensor of none (a one-hot by scatter_ into zeros): data now, in the
            self.free.pop(id(tensors[0]), None)  # order of what was written
        if name in FREE or (tensors and all(self._free(t) for t in tensors)):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.free[id(t)] = weakref.ref(t)
            return None
        if _whole(name, args):  # x takes v's order, nothing of x's own is left
            src = args[2] if name == "__setitem__" and len(args) > 2 else \
                args[1] if len(args) > 1 else None
            key = self.key(src) if isinstance(src, torch.Tensor) else None
            if key is None:
                self.keys.pop(id(args[0]), None)
            else:
                self.keys[id(args[0])] = (weakref.ref(args[0]), key)
            return None
        first = tensors[0] if tensors else None  # torch.cat([a, b], 1): the list's first
        if first is None:
            return None
        if name not in REORDER:  # the data tensors of one row count in two orders: mixed
            data = [t for t in tensors if (not t.requires_grad or (ours and ours(t)))
                    and t.dim() and t.shape[0] >= 2 and not self._free(t)
                    and not (into and t is tensors[0])]
            # (``where(mask, x[perm], x)``: the mask comes first, one row, so its rows were
            # the only ones compared)
            for rows in {t.shape[0] for t in data}:
                same = [t for t in data if t.shape[0] == rows]
                if len(same) >= 2 and len({self.key(t) for t in same}) > 1:
                    shape = next(tuple(t.shape) for t in same if self.key(t) is not None)
                    return (f"{name}() of rows of two different records (a batch partner, "
                            f"x[perm] or x.roll(k, 0), as in mixup or CutMix) of a {shape} "
                            f"tensor")
            if into:
                keys = {self.key(t) for t in data if t.shape[0] == tensors[0].shape[0]}
                if len(keys) == 1 and None not in keys:
                    self.keys[id(tensors[0])] = (weakref.ref(tensors[0]), keys.pop())
                return None
        if not first.dim():
            return None
        m = int(first.shape[0])
        new = _order(name, args, kwargs, (self.key(first) or (None, None))[1], m, self.made,
                     self.whole)
        key = self.key(first) if new is False else new
        if key is not None or new is None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dim() and (
                        t.shape[0] == m or new not in (False, None)):
                    if key is None:
                        self.keys.pop(id(t), None)
                    else:
                        self.keys[id(t)] = (weakref.ref(t), key)
        return None


__all__ = ["REORDER", "RowOrder"]
