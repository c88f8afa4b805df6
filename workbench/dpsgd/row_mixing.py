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

Notation: n rows, π a permutation (an index tensor over dim 0).
"""

import weakref

import torch
from torch.utils._pytree import tree_flatten

REORDER = {"__getitem__", "index_select", "roll", "flip", "take_along_dim", "randperm"}


def _order(name: str, args, kwargs, key):
    """The new row order ``name(*args)`` gives its first argument's rows, or None. An index
    tensor reorders only when it is one (``key``: drawn by ``randperm``, or itself rolled):
    ``z[torch.arange(n), y]`` picks each record's own entry."""
    if name == "__getitem__" and len(args) > 1:
        index = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        if isinstance(index, torch.Tensor) and key(index) is not None:
            return key(index)
    if name == "index_select" and len(args) > 2 and args[1] == 0:
        return key(args[2])
    if name == "take_along_dim" and kwargs.get("dim", args[2] if len(args) > 2 else None) == 0:
        return key(args[1])
    if name == "roll":
        dims = kwargs.get("dims", args[2] if len(args) > 2 else None)
        if dims in (0, (0,), [0]):
            return ("roll", str(kwargs.get("shifts", args[1] if len(args) > 1 else None)))
    if name == "flip":
        dims = kwargs.get("dims", args[1] if len(args) > 1 else None)
        if dims in (0, (0,), [0]):
            return ("flip",)
    return None


class RowOrder:
    """The row orders of a window's data tensors (module docstring)."""

    def __init__(self):
        self.keys: dict[int, tuple] = {}  # id -> (weakref, key)

    def key(self, t):
        entry = self.keys.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def after(self, name: str, args, kwargs, tensors, out, ours=None) -> str | None:
        """Follow ``out = name(*args, **kwargs)``; ``what`` when it mixes two records.
        ``ours(t)``: t is computed from the model's outputs (in the loss window), a record's
        own values although it carries gradient."""
        if name == "randperm" and isinstance(out, torch.Tensor):
            self.keys[id(out)] = (weakref.ref(out), ("index", id(out)))
            return None
        first = tensors[0] if tensors else None  # torch.cat([a, b], 1): the list's first
        if first is None or not first.dim():
            return None
        data = [t for t in tensors if (not t.requires_grad or (ours and ours(t))) and t.dim()
                and t.shape[0] == first.shape[0] and t.shape[0] >= 2]
        orders = {self.key(t) for t in data}
        if len(data) >= 2 and len(orders) > 1 and name not in REORDER:
            return (f"{name}() of rows of two different records (a batch partner, "
                    f"x[perm] or x.roll(k, 0), as in mixup) of a {tuple(first.shape)} tensor")
        new = _order(name, args, kwargs, self.key)
        key = new if new is not None else self.key(first)
        if key is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == first.shape[0]:
                    self.keys[id(t)] = (weakref.ref(t), key)
        return None


__all__ = ["REORDER", "RowOrder"]
