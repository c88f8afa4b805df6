"""Allocating large per-sample tensors: ask the kernel for 2 MiB pages.

Per-sample gradients are big, (n, *param.shape): 268 MB for Linear(512, 512) at n = 256 in
float32, 1.3 GB for Embedding(20000, 64). On CPU such a block comes straight from the
operating system, and its first write page-faults once per 4 KiB page; on the machines this
workbench is developed on that makes writing a *fresh* 268 MB tensor ~8x slower than writing
a reused one, and the fault cost, not arithmetic, dominates Linear and Embedding samplers.

Linux lets a process mark a range for transparent huge pages with
``madvise(MADV_HUGEPAGE)`` when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` (with ``always`` it happens anyway). Then one fault maps 2 MiB and the write runs
near memory bandwidth. ``empty_per_sample`` does exactly that for large CPU tensors when
enabled, and is a plain ``torch.empty`` everywhere else (CUDA, other systems, small tensors,
THP disabled). The values are never affected, only where the pages come from.

**Opt-in** (``WORKBENCH_HUGE_PAGES=1``, or ``memory.HUGE_PAGES = True``), because the gain is
not predictable. Measured here (Embedding(20000, 64), n = 256, 32 tokens, 1.3 GB of per-sample
gradients): 90-110 ms per call with huge pages against ~470 ms without, but the first call of a
process took 1.3-1.9 s, and alternating with another method's large 4 KiB-page allocations
made every other call take ~1.1 s: with the kernel's ``defrag=madvise`` setting a huge-page
fault may stop to compact memory. A steady loop (the same method every step) gets the gain.

**Reuse (on by default): a small caching allocator.** What makes the fault cost predictable is
paying it once: a large CPU per-sample buffer is kept in a pool after use and handed out again
for the next request of the same shape and dtype, as PyTorch's CUDA caching allocator keeps
freed blocks. It is reused *only when nothing else holds it*: the pool hands out a view, and
reuses a buffer only when the storage's reference count (``torch._C._storage_Use_Count``) says
that no tensor, view or storage object other than the pool's own still points at it. A result
the user keeps (or any view of it, a numpy array over it, an autograd graph that saved it) is
never written again; the next request then gets fresh memory. ``zeros_per_sample`` zeroes a
reused buffer in full (whatever its last holder wrote), a memset of warm memory.
Measured here (``wb.per_sample_gradients`` of Embedding(20000, 64), n = 256, T = 32, 1.3 GB,
2-core CPU): with other jobs loading the machine (load ~9), fresh and reused interleaved in
one process, fresh memory took a median 3.5 s (min 2.6 s) a call, a reused buffer 0.84 s
(min 0.24 s); quiet, fresh ~0.32 s and reused ~0.18 s. Page faults, not arithmetic, are
what a loaded machine slows down most.
The pool holds at most ``POOL_BYTES`` (env ``WORKBENCH_POOL_BYTES``, default 2 GiB; 0 turns
reuse off), least recently used buffers go first, ``release_pool()`` frees it all, and
``pooling(False)`` turns it off for a block (the memory benchmarks measure peaks that way, so
that a buffer cached by an earlier call never hides a step's real peak).
"""

import contextlib
import ctypes
import ctypes.util
import os
import sys
import threading
from pathlib import Path

import torch

HUGE_PAGE = 2 * 2**20
MIN_BYTES = 4 * 2**20  # below this the fault cost is negligible
_MADV_HUGEPAGE = 14


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "unavailable"


def _load_madvise():
    if not sys.platform.startswith("linux") or _thp_mode() != "madvise":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError):
        return None


_madvise = _load_madvise()

HUGE_PAGES = os.environ.get("WORKBENCH_HUGE_PAGES", "").strip().lower() in ("1", "true", "yes")
"""Whether ``empty_per_sample`` asks for huge pages (see the module docstring)."""


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Mark the 2 MiB-aligned inside of ``t``'s (untouched) memory for huge pages."""
    nbytes = t.numel() * t.element_size()
    if not HUGE_PAGES or _madvise is None or t.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE  # round up to a 2 MiB boundary
    hi = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    return hi > lo and _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


POOL_BYTES = int(os.environ.get("WORKBENCH_POOL_BYTES", 2 * 2**30))
"""The most bytes of per-sample buffers kept for reuse (see the module docstring)."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_pool: list[torch.Tensor] = []  # least recently used first; flat buffers
_lock = threading.Lock()
_enabled = [True]


def _refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


# References to a storage held by one live tensor while ``_refs`` asks: that tensor's own and
# the temporary storage object's. Measured once here, so a torch that counts otherwise
# turns reuse off instead of ever reusing a buffer that someone holds.
_ALONE = _refs(torch.empty(1)) if _use_count is not None else None
if _ALONE is not None:
    _probe = torch.empty(1)
    _view = _probe.view(1)
    if _refs(_probe) <= _ALONE:  # a view must count: otherwise the count cannot be trusted
        _ALONE = None
    del _probe, _view


def pool_bytes() -> int:
    """Bytes currently kept by the pool (free or still held by their last user)."""
    with _lock:
        return sum(t.numel() * t.element_size() for t in _pool)


def release_pool() -> None:
    """Forget every pooled buffer; memory nobody else holds goes back to the allocator."""
    with _lock:
        _pool.clear()


@contextlib.contextmanager
def pooling(enabled: bool):
    """Turn buffer reuse on or off inside a ``with`` block."""
    before, _enabled[0] = _enabled[0], bool(enabled)
    try:
        yield
    finally:
        _enabled[0] = before


def _poolable(numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    nbytes = numel * dtype.itemsize
    return (_enabled[0] and _ALONE is not None and device.type == "cpu"
            and MIN_BYTES <= nbytes <= POOL_BYTES)


def _fresh(numel: int, dtype, device) -> torch.Tensor:
    with torch.inference_mode(False):  # reusable inside and outside inference mode
        t = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def _pooled(numel: int, dtype, device) -> torch.Tensor:
    """A flat buffer of ``numel`` elements that no one else holds: reused or new."""
    with _lock:
        for k, t in enumerate(_pool):
            if t.numel() == numel and t.dtype == dtype and _refs(t) <= _ALONE:
                _pool.append(_pool.pop(k))  # most recently used last
                return t
        t = _fresh(numel, dtype, device)
        _pool.append(t)
        total = sum(u.numel() * u.element_size() for u in _pool)
        while total > POOL_BYTES and len(_pool) > 1:  # forget the least recently used
            old = _pool.pop(0)
            total -= old.numel() * old.element_size()
        return t


def empty_per_sample(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s dtype and device: a reused pool
    buffer when large and on CPU, else fresh (huge-page backed when enabled)."""
    shape = tuple(shape)
    numel = 1
    for s in shape:
        numel *= int(s)
    if _poolable(numel, like.dtype, like.device):
        with torch.inference_mode(False):
            return _pooled(numel, like.dtype, like.device).view(shape)  # a new view: counted
    return _fresh(numel, like.dtype, like.device).view(shape)


def zeros_per_sample(shape, like: torch.Tensor) -> torch.Tensor:
    """``torch.zeros(shape)`` allocated like ``empty_per_sample``."""
    return empty_per_sample(shape, like).zero_()


__all__ = [
    "HUGE_PAGE", "HUGE_PAGES", "MIN_BYTES", "POOL_BYTES", "advise_huge_pages", "empty_per_sample",
    "pool_bytes", "pooling", "release_pool", "zeros_per_sample",
]
