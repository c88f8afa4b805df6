"""A batch's structure: every tensor leaf carries the batch on dim 0, whatever holds it.

Loaders yield a tensor, a tuple or list ``(x, y)``, a namedtuple, a dict (Hugging Face's
``{"input_ids": ..., "attention_mask": ..., "labels": ...}``, or a ``Mapping`` such as
``BatchEncoding``), or these nested. Two things need to cut such a batch along dim 0 without
knowing its structure:

- the virtual-step loader (``max_physical_batch_size``) cuts a logical batch of n records into
  chunks ``batch[start:start + size]``;
- the Poisson loader shapes an empty batch (n = 0, ``batch[:0]``) like a full one.

``take(batch, index, where)`` applies one dim-0 slice to every tensor leaf and rebuilds the
same containers. A leaf that is not a tensor (a list of strings, a number) cannot be cut per
record: it raises, naming the leaf's path and the fix. ``batch_size`` checks that every tensor
leaf has the same n on dim 0 (else some leaf is not per-record, and a cut would pair the wrong
records).

Notation: n records in a batch.
"""

from collections.abc import Mapping

import torch


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def leaves(batch, where="batch"):
    """[(path, tensor)] of every tensor leaf; TypeError naming a leaf that is not one."""
    if isinstance(batch, torch.Tensor):
        return [(where, batch)]
    if isinstance(batch, Mapping):
        return [leaf for k, v in batch.items() for leaf in leaves(v, f"{where}[{k!r}]")]
    if _is_namedtuple(batch):
        return [leaf for k in batch._fields for leaf in leaves(getattr(batch, k),
                                                               f"{where}.{k}")]
    if isinstance(batch, (tuple, list)):
        return [leaf for i, v in enumerate(batch) for leaf in leaves(v, f"{where}[{i}]")]
    raise TypeError(f"{where} is a {type(batch).__name__}, not a tensor: a batch is cut per "
                    f"record along dim 0 of every tensor it holds (tuples, lists, namedtuples "
                    f"and dicts of tensors); make the collate_fn return a tensor for it (or "
                    f"drop it from the batch)")


def batch_size(batch, where="batch") -> int:
    """n: the common dim-0 size of every tensor leaf (an error names the leaves that differ)."""
    found = leaves(batch, where)
    if not found:
        raise TypeError(f"{where} holds no tensor: nothing to cut into records")
    sizes = {path: (t.shape[0] if t.dim() else None) for path, t in found}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        shown = ", ".join(f"{p}: {'0-d' if n is None else n}" for p, n in sizes.items())
        raise ValueError(f"{where}'s tensors do not share one batch size on dim 0 ({shown}): "
                         f"every tensor of a batch must hold one row per record to be cut "
                         f"into physical batches or Poisson-sampled; move per-batch constants "
                         f"out of the batch")
    return next(iter(sizes.values()))


def take(batch, index: slice, where="batch"):
    """``batch`` with ``t[index]`` for every tensor leaf t, the same containers around them."""
    if isinstance(batch, torch.Tensor):
        return batch[index]
    if isinstance(batch, Mapping):
        items = {k: take(v, index, f"{where}[{k!r}]") for k, v in batch.items()}
        return items if type(batch) is dict else _rebuild(batch, items, where)
    if _is_namedtuple(batch):
        return type(batch)(*(take(v, index, f"{where}.{k}")
                             for k, v in zip(batch._fields, batch)))
    if isinstance(batch, (tuple, list)):
        return type(batch)(take(v, index, f"{where}[{i}]") for i, v in enumerate(batch))
    leaves(batch, where)  # raises the TypeError that names the leaf
    raise AssertionError("unreachable")


def _rebuild(mapping, items: dict, where: str):
    try:
        return type(mapping)(items)
    except Exception as e:  # noqa: BLE001  (any constructor: we only report it)
        raise TypeError(f"{where} is a {type(mapping).__name__}, which cannot be rebuilt from "
                        f"a dict of its cut tensors ({type(e).__name__}: {e}); convert it "
                        f"with dict(batch) in the collate_fn") from None


__all__ = ["batch_size", "leaves", "take"]
