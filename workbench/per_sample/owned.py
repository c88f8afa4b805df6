"""Writing into a recorded backprop in place: only where nothing else can read the write.

The optimizer rescales every recorded backprop b (n, ...) by the loss's per-record factors,
b_i <- f_i b_i (``dpsgd/recorded._rescaled``; f_i = n for a mean loss). Out of place that is
one more tensor the size of b at the step's peak: the embedding model's (n, T, d) backprop
was held twice (``bench training --memory``, b = 256: 1.70x a plain step). In place the
products are the same, bit for bit, but the write is safe only when no one else can read b
afterwards: not another call (the memo of ``_rescaled`` gives every call that shares b the
same result), not a view, not autograd, not a user's hook.

``sole_holders(holders)`` proves that from reference counts, and any doubt keeps the copy:

- C++: the tensor's own count ``Tensor._use_count()`` is 1 (only its Python object: no
  autograd node saved it, no ``.grad`` stole it) and its storage's count
  (``torch._C._storage_Use_Count``) is a fresh tensor's (no view, ``detach()`` or numpy
  array shares the memory), and so are the references to its storage's Python object (no
  one keeps ``t.untyped_storage()``), and no weak reference to it (one raises no count but
  can still read the write); no ``_base``, no ``requires_grad``, dense and
  contiguous, not an inference tensor, exactly ``torch.Tensor``;
- Python: ``sys.getrefcount`` of the tensor equals the references the given holders'
  ``backprops`` attributes make, calibrated once on a fresh tensor held by one attribute
  (so an interpreter that counts differently is measured, not assumed).

``only_reference(t)``: the same proof for a tensor that only the caller's local variable holds
(``requires_grad`` allowed): the DP recurrent layers' U port (``layers/bptt.run_bptt``) frees
its hooked call's (n, T, G H) output, which the BPTT node takes for its gradient edge and never
reads (``bench training --memory``, imdb_lstm, b = 256: 1.21x -> 1.14x a plain step).

Notation: n batch, b backprops, f_i the loss's per-record factors.
"""

import sys
import weakref
from collections import Counter

import torch

from workbench.per_sample.flat_rows import IdentityRef


class _Holder:
    __slots__ = ("backprops",)


def _attribute_refs(holder) -> int:
    return sys.getrefcount(holder.backprops)


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _storage_objects(t: torch.Tensor) -> int:
    return sys.getrefcount(t.untyped_storage())  # its Python object is kept while one holds it


def _calibrate() -> tuple[int, int, int]:
    """(Python references seen when one attribute holds a tensor, its storage's count, the
    references to its storage's Python object)."""
    h = _Holder()
    h.backprops = torch.empty(2)
    return _attribute_refs(h), _storage_refs(h.backprops), _storage_objects(h.backprops)


_ONE_ATTRIBUTE, _FRESH_STORAGE, _FRESH_STORAGE_OBJECT = _calibrate()


def _count(t) -> int:
    return sys.getrefcount(t)


def _via(t) -> int:
    return _count(t)


def _one_local() -> int:
    t = torch.empty(2)
    return _via(t)


_ONE_LOCAL = _one_local()


def _alone(t) -> bool:
    return (type(t) is torch.Tensor and t.layout == torch.strided and t._base is None
            and not t.is_inference() and t.is_contiguous() and t._use_count() == 1
            and _storage_refs(t) == _FRESH_STORAGE
            and _storage_objects(t) == _FRESH_STORAGE_OBJECT
            and not _weak_readers(t))  # a weak reader counts nowhere else


def _weak_readers(t) -> bool:
    """A weak reference to t that may read it later; the taint's and the row tags'
    (``flat_rows.IdentityRef``) only compare identities, never values."""
    return weakref.getweakrefcount(t) > 0 and any(
        not isinstance(r, IdentityRef) for r in weakref.getweakrefs(t))


def _plain(t) -> bool:
    return _alone(t) and not t.requires_grad


def only_reference(t) -> bool:
    """Whether the caller's one local variable is all that references ``t`` (C++ and Python
    counts as above; autograd may have made t, but saved it nowhere): then freeing its memory
    (``untyped_storage().resize_(0)``) changes nothing anyone can read."""
    return _alone(t) and _count(t) == _ONE_LOCAL


def sole_holders(holders) -> set[int]:
    """ids of the tensors that the ``backprops`` attributes of ``holders`` (objects, each
    once) hold directly and that nothing else references (module docstring): writing into
    one in place changes what those holders, and only they, read. A tuple of backprops is
    never included (its tuple may be held elsewhere)."""
    holders = list(holders)
    count = Counter(id(h.backprops) for h in holders if type(h.backprops) is torch.Tensor)
    owned = set()
    for h in holders:
        key = id(h.backprops)
        if key in count and key not in owned and _plain(h.backprops) and \
                _attribute_refs(h) == _ONE_ATTRIBUTE + count[key] - 1:
            owned.add(key)
    return owned


__all__ = ["only_reference", "sole_holders"]
