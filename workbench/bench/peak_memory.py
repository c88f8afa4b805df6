"""Peak allocated memory of one call: on CUDA from the allocator, on CPU from the profiler.

``peak_bytes(fn, device, resident)`` is the bytes the step needs live before it starts
(``resident``, e.g. ``tensor_bytes(layer, x, t)``: parameters, buffers, inputs, labels) plus
the peak of what ``fn()`` allocates while it runs:

- on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what
  was allocated before (so other tensors on the device do not count), as in the Opacus
  paper's Table 3 (Yousefpour et al. 2021, arXiv 2109.12298);
- on CPU the peak of the running sum of the allocations and frees the torch profiler records
  during the call (``profile_memory=True``), in the order they happened.

Both are *allocated* bytes, not the allocator's reserve or the process' RSS.

**Why a private profiler API on CPU.** The running sum needs every allocation and free with
its time. torch 2.13's public ``prof.events()`` folds the records into the op that was running
(``FunctionEvent.cpu_memory_usage``: the op's *net* bytes), so an op that allocates a
workspace and frees it before returning shows no peak at all: on ``Linear(512, 512)``'s
forward + backward at b = 256 the public events give a peak of 2.5 MiB where 3.5 MiB were
live. ``prof.export_memory_timeline`` keeps the timeline but is deprecated (a FutureWarning
in 2.13) and needs ``with_stack=True``. So ``_cpu_extra_peak`` reads the raw records,
``prof.profiler.kineto_results.experimental_event_tree()``: each allocation event's time,
address (``ptr``) and ``alloc_size`` (negative for a free). If a torch release renames or
drops any of these, or stops recording the allocations, ``_cpu_extra_peak`` raises
``RuntimeError`` naming the torch version instead of returning a wrong number: every
measurement first allocates and frees a canary tensor of known size inside the profiled region
and checks that the records show exactly that allocation and that free.

**Only what the call allocated counts, and only its frees.** The CPU allocator remembers the
size of every block allocated while *any* profiler ran, so whether a free of an older block
(last step's ``.grad``, say) is recorded depended on the process' history: on whether that
block, or an earlier block at the same address, was allocated under an earlier profiled call.
The same step then read 0.86 or 1.36 MiB, and MobileNetV3's ratio 6.4-17.5x, from run to run.
So the running sum keeps an address's free only when this call's records hold its allocation:
it is the peak of the bytes allocated during the call and still live. Blocks from before the
call count through ``resident`` (parameters, buffers, inputs), or not at all (what a step frees
before it allocates, like the ``.grad`` that ``zero_grad`` drops), the same for every step
measured.
"""

import contextlib
import itertools
import os
import sys

import torch
from torch import nn

from workbench.per_sample.memory import pooling

CANARY_BYTES = 3 * 2**20 + 4096  # an allocation size no step here happens to make first


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C-level writes to stderr (the profiler prints start/stop lines there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _memory_records(prof) -> list[tuple[int, int]]:
    """(start_ns, nbytes) of every allocation (+) in the profiled region, and of the frees (-)
    of those blocks only (the module docstring says why), in the order they happened."""
    try:
        events = [(e.start_time_ns, i, e.extra_fields.ptr, e.extra_fields.alloc_size)
                  for i, e in enumerate(_walk(prof.profiler.kineto_results
                                              .experimental_event_tree()))
                  if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"]
    except AttributeError as err:
        raise RuntimeError(
            f"the CPU memory measurement reads the profiler's private records "
            f"(prof.profiler.kineto_results.experimental_event_tree(): start_time_ns, "
            f"extra_fields.ptr, alloc_size), which torch {torch.__version__} does not provide "
            f"({err}); it was written for torch 2.13. Measure on CUDA, or adapt "
            f"bench/peak_memory.py") from err
    live, records = {}, []  # ptr -> bytes of a block allocated in this region
    for start, _, ptr, nbytes in sorted(events):
        if nbytes > 0:
            live[ptr] = nbytes
            records.append((start, nbytes))
        elif live.get(ptr) == -nbytes:  # a free of a block this region allocated
            del live[ptr]
            records.append((start, nbytes))
    return records


def _walk(events):
    """Every event of the profiler's tree, parents before children."""
    for e in events:
        yield e
        yield from _walk(e.children)


def _cpu_extra_peak(fn) -> int:
    """Peak of the running sum of CPU allocations minus frees during ``fn()``, in bytes."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        canary = torch.empty(CANARY_BYTES, dtype=torch.uint8)
        del canary
        fn()
    records = _memory_records(prof)
    sizes = [nbytes for _, nbytes in records]
    start = sizes.index(CANARY_BYTES) if CANARY_BYTES in sizes else -1
    if start < 0 or sizes[start + 1:start + 2] != [-CANARY_BYTES]:
        raise RuntimeError(
            f"the torch profiler of torch {torch.__version__} did not record a known "
            f"allocation of {CANARY_BYTES} bytes and its free (first records: {sizes[:4]}); "
            f"its memory records cannot be trusted for a peak. Measure on CUDA, or adapt "
            f"bench/peak_memory.py")
    return max(itertools.accumulate(sizes[start + 2:], initial=0))  # fn()'s records


def tensor_bytes(*objects) -> int:
    """Bytes of the tensors (or modules' parameters and buffers) given, each counted once."""
    seen, total = set(), 0
    for obj in objects:
        tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, nn.Module) else [obj]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def peak_bytes(fn, device: torch.device, resident: int) -> int:
    """Peak allocated bytes while ``fn()`` runs: ``resident`` plus the peak of what it adds.

    ``resident`` is what the step needs live before it starts (e.g.
    ``tensor_bytes(layer, x, t)``). What the call adds: on CUDA ``max_memory_allocated`` after
    ``reset_peak_memory_stats``, minus what was allocated before; on CPU the profiler's peak
    of allocations minus frees during the call (the module docstring says how, and why). CPU
    buffer reuse is off while ``fn`` runs (``per_sample.memory.pooling``): a buffer cached by an
    earlier call would otherwise not count as allocated, and the peak would hide it.
    """
    with pooling(False):
        return _peak_bytes(fn, device, resident)


def _peak_bytes(fn, device, resident):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return resident + torch.cuda.max_memory_allocated(device) - before
    return resident + _cpu_extra_peak(fn)


__all__ = ["CANARY_BYTES", "peak_bytes", "tensor_bytes"]
