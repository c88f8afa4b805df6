"""The dropout-free twin: a coupled step found even when its dropout cannot be replayed.

When removing a record changes the other records' dropout masks (``influence_replay``), an
add/remove change above C may be a redraw, and the audit's row is *inconclusive*. Dropout
itself never couples records: record i's mask is drawn independently of the data, so
clip_C(g_i) depends on record i's data and its own mask only. Coupling is a property of the
data path (the model's batch statistics, the loss's normalisation), which the same step shows
with every dropout probability at 0. The twin runs ``released_sum`` under ``NoDropout`` (a
``TorchFunctionMode`` that makes every dropout call the identity, attention dropout included:
``dropout_p = 0``). When the twin is deterministic (two seeds agree), its change is exact:
above the bound it is a coupling of the step, and the row is BROKEN; within it, the row stays
inconclusive (a coupling that exists only with dropout on is not excluded).

The twin does not switch ``model.eval()``: BatchNorm's batch statistics, a coupling, stay.
"""

import torch
from torch.overrides import TorchFunctionMode

DROPOUT = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
           "feature_alpha_dropout", "native_dropout"}


class NoDropout(TorchFunctionMode):
    """Every dropout call returns its input (``native_dropout``: with an all-ones mask)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in DROPOUT:
            x = args[0] if args else kwargs["input"]
            if name == "native_dropout":
                return x.clone(), torch.ones_like(x, dtype=torch.bool)
            return x
        if name == "scaled_dot_product_attention":
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            kwargs.pop("dropout_p", None)
        return func(*args, **kwargs)


def twin(replayed, released_sum, first: list):
    """The twin's ``call(idx, seed)``, or None when it still draws random numbers on the
    batch ``first`` (randomness other than dropout: its redraws stay unexplained)."""

    def call(idx, seed):
        with NoDropout():
            return replayed(released_sum, idx, seed)

    return call if torch.equal(call(first, 0), call(first, 1)) else None


__all__ = ["DROPOUT", "NoDropout", "twin"]
