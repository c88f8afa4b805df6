"""Timing and environment helpers shared by the benchmarks.

- ``time_interleaved``: runs every candidate once per round, round after round, and keeps the
  median per candidate, so slow drifts of a shared machine hit all candidates alike.
- On CUDA a call is timed with CUDA events (the GPU runs asynchronously to Python); on CPU
  with ``time.perf_counter``.
- ``copy_bandwidth``: bytes per second of copying a large buffer, measured in the same run,
  the memory-bandwidth floor for writing a tensor of known size. With ``fresh=True`` (the
  default) the destination is newly allocated on every copy, as the result of any method
  that materialises per-sample gradients is. On CPU that matters: large blocks come straight
  from the operating system and every 4 KiB page faults on first touch, which makes writing a
  fresh 256 MiB tensor several times slower than writing a reused one. The floor allocates
  the way the workbench allocates per-sample tensors (``per_sample.memory``: 4 KiB pages by
  default, 2 MiB pages when enabled); the warm figure (``fresh=False``) is reported beside it.
"""

import argparse
import platform
import statistics
import time

import torch

from workbench.outputs import output_file_arg
from workbench.per_sample.memory import empty_per_sample


def device_name(device: torch.device) -> str:
    """A human name for the device, recorded next to every absolute time."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def time_call(fn, device: torch.device) -> float:
    """Seconds taken by one call of ``fn()`` on ``device``."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _take_modes() -> list:
    """Every TorchFunctionMode on the stack, popped off it (bottom first)."""
    modes = []
    while torch._C._len_torch_function_stack():
        modes.append(torch._C._pop_torch_function_stack())
    return modes[::-1]


def _put_modes(modes: list) -> None:
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def time_interleaved(candidates: dict, device: torch.device, repeats: int = 5, warmup: int = 1):
    """``{name: median seconds}`` over ``repeats`` rounds, each round calling every candidate.

    Each candidate runs on its own TorchFunctionMode stack: empty at first, then the one it
    left after its last call. A DP optimizer leaves its batch follower on the stack from
    ``step()`` to the next forward pass (``dpsgd/loss_watch.py``); interleaved on one stack,
    the follower would also watch the plain twin's step and charge it part of the DP step's
    cost (DP/plain then understates the DP step, and cheaper following even raises the
    ratio). The stack found on entry is back on exit (a follower left on a candidate's own
    stack is a pass-through once its optimizer moves on: ``loss_watch._leave``).
    """
    outer = _take_modes()
    stacks: dict = {name: [] for name in candidates}

    def call(name, fn):
        _put_modes(stacks[name])
        try:
            return time_call(fn, device)
        finally:
            stacks[name] = _take_modes()

    try:
        for _ in range(warmup):
            for name, fn in candidates.items():
                call(name, fn)
        samples = {name: [] for name in candidates}
        for _ in range(repeats):
            for name, fn in candidates.items():
                samples[name].append(call(name, fn))
    finally:
        _put_modes(outer)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5,
                   fresh: bool = True) -> float:
    """Bytes per second of copying a ``nbytes`` float32 buffer (median of ``repeats``).

    ``fresh=True``: into a destination requested anew each time, the way the workbench
    allocates per-sample tensors (``per_sample.memory.empty_per_sample``: a large one is a
    reused pool buffer unless reuse is off, so the floor is what the workbench pays);
    ``fresh=False``: into one destination reused across copies.
    """
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    if fresh:
        def copy():
            return empty_per_sample(src.shape, like=src).copy_(src)
    else:
        def copy():
            return dst.copy_(src)
    t = time_interleaved({"copy": copy}, device, repeats=repeats)["copy"]
    return nbytes / t


def benchmark_parser(name: str, doc: str, batch_sizes=(16, 64, 256), repeats: int = 5,
                     repeats_help: str = "interleaved rounds (median)"
                     ) -> argparse.ArgumentParser:
    """The options every benchmark shares: --batch-sizes, --repeats, --device, --out.

    ``repeats`` and ``repeats_help``: the default and meaning of --repeats, for a benchmark
    whose repeats are not interleaved timing rounds (``bench memory``).
    """
    parser = argparse.ArgumentParser(prog=f"python -m workbench.bench {name}",
                                     description=doc.split("\n\n")[0])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=list(batch_sizes))
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=output_file_arg("--out"), default=f"bench-results/{name}.csv",
                        help="CSV file for the results (checked for writing before the run)")
    return parser


def parse_benchmark_args(parser: argparse.ArgumentParser, argv):
    """Parse, and refuse non-positive repeats or batch sizes with a clear message."""
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(b < 1 for b in args.batch_sizes):
        parser.error(f"--repeats and every --batch-sizes value must be >= 1; got "
                     f"--repeats {args.repeats} --batch-sizes {args.batch_sizes}")
    return args


__all__ = [
    "benchmark_parser", "copy_bandwidth", "device_name", "parse_benchmark_args", "time_call",
    "time_interleaved",
]
