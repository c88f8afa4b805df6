"""Distributed DP-SGD helpers: each rank's Poisson loader, and all-reduces that cannot hang.

**Sampling.** Each rank Poisson-samples its own shard (every world-th example) with the same
q = batch_size / N, N the *whole* data set: example j is still in a step's global batch with
probability q, independently of the others, so the union of the ranks' batches is one Poisson
sample of the whole data set (the sampled Gaussian mechanism's assumption; Mironov, Talwar,
Zhang 2019, arXiv 1908.10530). ``batch_size`` is the expected *global* batch.

**Stalled ranks.** The DP step all-reduces the noised sums (``DPOptimizer.privatise``). If one
rank stalls or dies, the others wait in that collective for the process group's timeout:
torch's default is 30 minutes, and in a notebook the kernel just looks busy. ``all_reduce``
here waits at most ``timeout_minutes`` (``DEFAULT_TIMEOUT_MINUTES`` = 10 unless
``make_private(all_reduce_timeout_minutes=...)`` says otherwise) and then raises
``CollectiveTimeoutError`` naming the collective, this rank and the world size. Set it above
the slowest legitimate gap between ranks (a step's forward, backward and clipping, plus any
evaluation one rank runs alone). After the error the process group is unusable: destroy it
and restart the job (from a checkpoint). Every collective the engine itself starts goes
through ``all_reduce`` here (``make_private`` and the checks start none: they probe the
wrapped module, never the DDP wrapper); a step that times out has neither moved the weights
nor been accounted (``DPOptimizer.step`` accounts, then moves). Collectives the *user's* code
starts (DistributedDataParallel's construction broadcast and its gradient all-reduce in
``backward()``, a barrier) wait for the process group's own timeout: bound them with
``dist.init_process_group(..., timeout=datetime.timedelta(minutes=...))``.

Notation: N data set size, q sample rate, world the number of ranks.
"""

import datetime
import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, Subset
from torch.utils.data.distributed import DistributedSampler

from workbench.accounting.calibrate import steps_per_epoch
from workbench.dpsgd.sampling import (
    DPDataLoader,
    check_dataset,
    check_own_sampler,
    loader_options,
    loader_sample_rate,
)
from workbench.errors import WorkbenchError

DEFAULT_TIMEOUT_MINUTES = 10.0
SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler)  # all cover the whole set


class CollectiveTimeoutError(WorkbenchError, RuntimeError):
    """A collective (e.g. the noise all-reduce) did not complete: another rank stalled."""


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def check_timeout_minutes(timeout_minutes) -> float:
    """A finite number of minutes > 0."""
    try:
        minutes = float(timeout_minutes)
    except (TypeError, ValueError):
        minutes = math.nan
    if not (minutes > 0 and math.isfinite(minutes)):
        raise ValueError(f"all_reduce_timeout_minutes must be a finite number of minutes > 0 "
                         f"(how long a rank waits for the others in the noise all-reduce); got "
                         f"{timeout_minutes!r}; the default is {DEFAULT_TIMEOUT_MINUTES:g}")
    return minutes


def all_reduce(tensor: torch.Tensor, *, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
               name: str = "all_reduce") -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place; raise ``CollectiveTimeoutError`` (naming
    ``name``) if that takes longer than ``timeout_minutes``."""
    minutes = check_timeout_minutes(timeout_minutes)
    if not is_distributed():
        raise RuntimeError(f"all_reduce {name!r} needs torch.distributed initialised "
                           f"(dist.init_process_group); it is not")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = dist.all_reduce(tensor, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(minutes=minutes))
    except RuntimeError as e:  # gloo: "Operation timed out!"; NCCL: DistBackendError
        raise CollectiveTimeoutError(
            f"the collective {name!r} (all_reduce of a {tuple(tensor.shape)} "
            f"{tensor.dtype} tensor) did not complete within {minutes:g} minutes on rank "
            f"{rank} of {world}: another rank has stalled or died ({e}). Look for the failed "
            f"rank's own error; if steps are legitimately slower, raise "
            f"make_private(all_reduce_timeout_minutes=...). The process group is now "
            f"unusable: destroy it and restart from a checkpoint") from e
    return tensor


def shard_loader(data_loader: DataLoader, generator=None) -> DPDataLoader:
    """This rank's Poisson loader over its shard, with q = batch_size / N (module doc)."""
    N = check_dataset(data_loader.dataset, "data_loader.dataset")
    check_own_sampler(data_loader, allowed=SAMPLERS)
    rank, world = dist.get_rank(), dist.get_world_size()
    q = loader_sample_rate(data_loader, N)
    shard = Subset(data_loader.dataset, range(rank, N, world))
    check_dataset(shard, f"rank {rank}'s shard of data_loader.dataset (N = {N}, {world} ranks)")
    return DPDataLoader(shard, sample_rate=q, steps=steps_per_epoch(q), generator=generator,
                        **loader_options(data_loader))


__all__ = ["CollectiveTimeoutError", "DEFAULT_TIMEOUT_MINUTES", "all_reduce",
           "check_timeout_minutes", "shard_loader"]
