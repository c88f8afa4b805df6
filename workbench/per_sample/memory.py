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
"""

import ctypes
import ctypes.util
import os
import sys
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


def empty_per_sample(shape, like: torch.Tensor) -> torch.Tensor:
    """``torch.empty(shape)`` with ``like``'s dtype and device, huge-page backed when large."""
    t = torch.empty(shape, dtype=like.dtype, device=like.device)
    advise_huge_pages(t)
    return t


def zeros_per_sample(shape, like: torch.Tensor) -> torch.Tensor:
    """``torch.zeros(shape)`` allocated like ``empty_per_sample``."""
    return empty_per_sample(shape, like).zero_()
