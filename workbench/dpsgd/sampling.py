"""Poisson sampling: every example joins each batch independently with probability q.

The privacy analysis of DP-SGD (Abadi et al. 2016, arXiv 1607.00133, §3.1; Mironov, Talwar,
Zhang 2019, arXiv 1908.10530, the sampled Gaussian mechanism) assumes each step's batch is a
*Poisson* sample of the data set: example j is included with probability q, independently of
every other example and step. Batch sizes then vary (Binomial(N, q), mean qN), and a batch can
be empty. Shuffling into fixed-size batches is a different mechanism whose amplification the
RDP bound does not cover.

Two consequences built in here:
- an empty batch comes out as correctly shaped empty tensors (n = 0), so the step still runs
  and still adds noise: skipping it would reveal that the batch was empty;
- an "epoch" is ``round(1 / q)`` steps (``accounting.steps_per_epoch``, the accountants' epoch
  too), so each example is used about once per epoch on average.

Randomness comes from an explicit ``torch.Generator`` (reproducible runs); ``secure_mode``
swaps in the operating system's cryptographic generator (``secure.py``).

``DPDataLoader.from_data_loader`` keeps everything of the original loader that does not choose
*which* examples form a batch (``collate_fn``, workers, pinning, prefetching, ...). It refuses a
loader that chooses them itself (a ``sampler`` or ``batch_sampler`` of its own): replacing it by
Poisson over the whole data set would train on examples the sampler left out.

Notation: N data set size, q sample rate, B = qN expected batch size.
"""

import collections

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler

from workbench.accounting.calibrate import steps_per_epoch
from workbench.checks import check_count, check_sample_rate
from workbench.dpsgd.batches import take
from workbench.dpsgd.collate_check import CollateCheck, unfollowed
from workbench.dpsgd.loss_watch import watched

# What from_data_loader copies from the original loader: everything but the choice of batches.
KEPT_OPTIONS = ("collate_fn", "worker_init_fn", "num_workers", "pin_memory", "persistent_workers",
                "prefetch_factor", "multiprocessing_context", "timeout", "pin_memory_device",
                "in_order")


def check_dataset(dataset, name: str = "dataset") -> int:
    """N = len(dataset), or an error saying why Poisson sampling cannot draw from it."""
    if isinstance(dataset, IterableDataset):
        raise TypeError(f"{name} is an IterableDataset ({type(dataset).__name__}): a stream has "
                        f"no indices to draw, and Poisson sampling includes each example j with "
                        f"probability q, so it needs a map-style data set with len() and "
                        f"dataset[j]; load the stream into one (e.g. a TensorDataset or a list)")
    try:
        N = len(dataset)
    except TypeError:
        raise TypeError(f"{name} ({type(dataset).__name__}) has no len(): Poisson sampling "
                        f"needs N, the data set size, for q = batch_size / N; give it __len__ "
                        f"and __getitem__") from None
    if N == 0:
        raise ValueError(f"{name} is empty (len 0): Poisson sampling needs at least one example")
    return N


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps`` batches of indices; index j is in each with probability q.

    Invariant: each batch is accounted with the q that drew it. ``sample_rate`` may change
    between batches (a batch-size curriculum: q varying over a run is composed step by step
    by every accountant), checked on assignment; each batch drawn records its q
    (``drawn``), and the loader hands it on with the batch (``take_drawn`` ->
    ``batch_rate``), which the engine's accountant charges. The engine charged the q of
    ``make_private`` whatever the sampler drew (q = 0.9 charged as 0.2: ε 5.75 reported for
    12.29, silently) until 2026-11-30. ``num_samples`` is checked too (records beyond it are
    never drawn: their q is 0, below what is charged)."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None):
        self.drawn = collections.deque()  # q of each batch drawn and not yet handed out
        self.indices = collections.deque()  # and its indices, where ``keep_indices``
        # (the engine's loader takes them at each hand-out: collate_check.py)
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps = steps_per_epoch(self.sample_rate) if steps is None else \
            check_count(steps, "steps")
        self.generator = generator

    @property
    def sample_rate(self) -> float:
        """q, the probability that a record is in the next batch drawn (checked when set)."""
        return self._sample_rate

    @sample_rate.setter
    def sample_rate(self, value) -> None:
        self._sample_rate = check_sample_rate(value, "sample_rate", positive=True)

    @property
    def num_samples(self) -> int:
        """N, the records drawn from (indices 0..N-1; checked when set)."""
        return self._num_samples

    @num_samples.setter
    def num_samples(self, value) -> None:
        self._num_samples = check_count(value, "num_samples")

    def take_drawn(self) -> float:
        """The q of the oldest batch drawn that was not handed out yet: the loader calls it
        once per batch it hands out, in order (workers draw ahead)."""
        return self.drawn.popleft() if self.drawn else self.sample_rate

    keep_indices = False  # whether each batch's indices wait for ``take_indices``

    def take_indices(self) -> list[int] | None:
        """The indices of the oldest batch drawn whose indices were not taken yet (in the
        order drawn: the loader keeps it, ``in_order``), None if none is waiting."""
        queue = self.__dict__.get("indices")  # (a sampler pickled before it had one)
        return queue.popleft() if queue else None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        self.drawn.clear()  # a new pass: an abandoned one's draws are no batch of this one
        queue = self.__dict__.setdefault("indices", collections.deque())
        queue.clear()
        for _ in range(self.steps):
            q = self.sample_rate  # this batch's, whatever is assigned while it is out
            generator = self.generator.next() if hasattr(self.generator, "next") else \
                self.generator  # secure mode: a freshly seeded generator every step
            draws = torch.rand(self.num_samples, generator=generator,  # (N,) ~ U[0, 1),
                               dtype=torch.float64)  # in float64: P(u < q) = ⌈q 2^53⌉ / 2^53,
            # q to 1e-16 relative for q >= 2^-30. float32's u are multiples of 2^-24: a
            # record was drawn with probability ⌈q 2^24⌉ / 2^24 > q, the accountant charged q
            # (6x at q = 1e-8, +19% at 1e-7, +1.3% at 1e-6), until 2026-11-30
            self.drawn.append(q)
            drawn = torch.nonzero(draws < q).flatten().tolist()
            if self.keep_indices:
                queue.append(drawn)
            yield drawn


def empty_like_batch(example, collate_fn=default_collate):
    """An empty batch (n = 0) with the structure, shapes and dtypes of one collated example
    (tuples, namedtuples, dicts and mappings of tensors: ``batches.take``)."""
    try:
        return take(collate_fn([example]), slice(0, 0), "the collated batch")
    except TypeError as e:
        raise TypeError(f"{e}; collate_fn={getattr(collate_fn, '__name__', collate_fn)!r} must "
                        f"return tensors (or tuples/lists/dicts of them) so that an empty "
                        f"Poisson batch can be shaped like a full one") from None


class PoissonCollate:
    """``collate_fn`` on a non-empty batch, the pre-shaped empty batch on an empty one.
    A class, not a closure, so that worker processes can unpickle it (spawn contexts)."""

    def __init__(self, collate_fn, empty):
        self.collate_fn, self.empty = collate_fn, empty

    def __call__(self, batch):
        return self.collate_fn(batch) if batch else self.empty


def check_own_sampler(loader: DataLoader, allowed=(SequentialSampler, RandomSampler)) -> None:
    """Refuse a loader whose batches come from a sampler of its own (see the module doc)."""
    fix = ("wrap the examples you mean to train on in the data set itself, e.g. "
           "DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=...), and pass "
           "that loader")
    if loader.batch_sampler is None:
        raise ValueError("data_loader has batch_size=None (automatic batching off), so it has "
                         "no batch size to set q = batch_size / N from; give it batch_size=B, "
                         "the expected batch size")
    if loader.batch_size is None or type(loader.batch_sampler) not in (BatchSampler,
                                                                         CountedBatchSampler):
        raise ValueError(f"data_loader has its own batch_sampler "
                         f"({type(loader.batch_sampler).__name__}): the private loader draws "
                         f"Poisson batches itself and would silently drop it; {fix} (its "
                         f"batch_size is the expected batch size)")
    if type(loader.sampler) not in allowed:  # exact types: a subclass may draw anything
        raise ValueError(f"data_loader has its own sampler ({type(loader.sampler).__name__}): "
                         f"Poisson sampling over the whole data set would replace it and train "
                         f"on examples it leaves out (e.g. a held-out split); {fix}")


class DPDataLoader(DataLoader):
    """A DataLoader drawing Poisson batches: ``DPDataLoader(dataset, sample_rate=q, ...)``.

    Also ``DPDataLoader.from_data_loader(loader)``: the same data set with q = batch_size / N,
    and the original loader's ``KEPT_OPTIONS`` (collate_fn, workers, pinning, ...).
    ``collate_fn`` is also called once on ``[dataset[0]]`` here, to shape empty batches.
    """

    def __init__(self, dataset: Dataset, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, collate_fn=None, **kwargs):
        N = check_dataset(dataset)
        sampler = PoissonBatchSampler(N, sample_rate, steps, generator)
        collate_fn = default_collate if collate_fn is None else collate_fn
        collate = PoissonCollate(collate_fn, empty_like_batch(dataset[0], collate_fn))
        if kwargs.get("generator") is None:  # the workers' base seed, drawn per pass: from
            # a generator of its own, not the global RNG, so that a pass begun after a resume
            # leaves the global stream (dropout) where the uninterrupted run has it
            seed = int(torch.randint(0, 2**62, (1,)))
            kwargs["generator"] = torch.Generator().manual_seed(seed)
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate, **kwargs)
        self.collate_check = None if collate_fn is default_collate else \
            CollateCheck(dataset, collate_fn)  # at each hand-out (stacking combines nothing)
        sampler.keep_indices = self.collate_check is not None
        self.batch_rate = None  # q of the batch last handed out (the accountant's, per step)
        self.watch = None  # the optimizer's LossWatch, set by make_private (loss_watch.watched)

    @property
    def sample_rate(self) -> float:
        """The sampler's q: setting it changes the q of the batches drawn from then on, and
        each is accounted with its own (``PoissonBatchSampler``)."""
        return self.batch_sampler.sample_rate

    @sample_rate.setter
    def sample_rate(self, value) -> None:
        self.batch_sampler.sample_rate = value

    @property
    def expected_batch_size(self) -> float:
        """q N of the sampler's q (the optimizer's B is its own setting: see README)."""
        return self.batch_sampler.sample_rate * self.batch_sampler.num_samples

    def __iter__(self):
        if self.watch is not None:  # workers prefetch: the sampler runs ahead of the steps
            self.watch.prefetch = self.num_workers if self.num_workers > 0 else 0
        return watched(self._checked(super().__iter__()), self.watch, handed=self._handed,
                       dataset=self.dataset)

    def _checked(self, batches):
        """The batches, each checked at its hand-out against its records collated alone
        (``collate_check.py``), before the watch follows it: the indices of each batch come
        from the sampler's queue, in the order drawn; a loader that does not keep that order
        (``in_order=False``) is not checked (its indices cannot be matched)."""
        check = self.__dict__.get("collate_check")
        ordered = getattr(self, "in_order", True)
        take = getattr(self.batch_sampler, "take_indices", None)
        for batch in batches:
            indices = take() if take is not None else None
            if check is not None and ordered and self.__dict__.get("check_collate", True):
                with unfollowed(self.watch):
                    check.handed(batch, indices)
                if self.watch is not None:
                    self.watch.padded = check.plans
            yield batch

    def _handed(self) -> None:
        """A batch is handed out (after the watch charged any batch skipped before it)."""
        self.batch_rate = self.batch_sampler.take_drawn()

    @classmethod
    def from_data_loader(cls, loader: DataLoader, generator=None, steps=None):
        N = check_dataset(loader.dataset, "data_loader.dataset")
        check_own_sampler(loader)
        return cls(loader.dataset, sample_rate=loader_sample_rate(loader, N), steps=steps,
                   generator=generator, **loader_options(loader))


def check_once_per_pass(loader: DataLoader, N: int) -> None:
    """A shuffled loader's pass must hold each record once (the fixed-size bracket's premise,
    ``accounting.epsilon_bounds``): a ``RandomSampler`` drawing with replacement, or more or
    fewer than the N records, is refused (a pass of ``num_samples=3 * N`` was counted as one
    epoch: ε 8.84 claimed for 17.3, until 2026-11-30)."""
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) and (sampler.replacement
                                               or sampler.num_samples != N):
        raise ValueError(
            f"data_loader's RandomSampler draws "
            f"{'with replacement' if sampler.replacement else ''}"
            f"{' and ' if sampler.replacement and sampler.num_samples != N else ''}"
            f"{f'{sampler.num_samples} samples of {N}' if sampler.num_samples != N else ''}: "
            f"poisson_sampling=False accounts shuffled passes that hold each record once "
            f"(a record in several batches of a pass is charged as in one). Use "
            f"RandomSampler(dataset) (shuffle=True) or poisson_sampling=True")
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last \
            and N % sampler.num_replicas:
        raise ValueError(
            f"data_loader's DistributedSampler pads its {N} records to "
            f"{sampler.total_size} (drop_last=False, {N} not divisible by "
            f"{sampler.num_replicas} ranks), so each pass repeats "
            f"{sampler.total_size - N} record(s): poisson_sampling=False accounts shuffled "
            f"passes that hold each record once, and a record in two batches of a pass moves "
            f"the run by twice as much (probe of 2026-12-01: 4.37 reported where 5.23 is "
            f"proved). Build it with DistributedSampler(dataset, shuffle=True, "
            f"drop_last=True), or use poisson_sampling=True")


class PassCounter:
    """Passes begun and completed over a shuffled loader the engine returns as it is
    (``count_passes``): the bracket counts epochs by them, not by steps / len(loader)."""

    def __init__(self, workers: int = 0):
        self.begun = 0
        self.completed = 0
        self.workers = workers  # the loader's: its sampler runs ahead of the loop


class CountedBatchSampler(BatchSampler):
    """A ``BatchSampler`` that counts its passes into ``_wb_passes`` (``count_passes``
    gives the user's own batch sampler this class: the loader is returned as it is)."""

    def __iter__(self):
        counters = self.__dict__.get("_wb_passes", ())  # one per engine over this loader
        for counter in counters:
            counter.begun += 1
        yield from super().__iter__()
        for counter in counters:
            counter.completed += 1


def count_passes(loader: DataLoader) -> PassCounter:
    """Count the passes over ``loader`` (its own object, returned to the user by
    ``make_private(poisson_sampling=False)`` and perhaps kept under its own name): the
    engine charged ceil(steps / len(loader)) epochs, so a loop taking one batch per fresh
    pass (``next(iter(loader))``), or two batches per step, was charged fewer epochs than it
    ran (ε 11.0 claimed for 14.5, until 2026-11-30). A pass begun counts from its first
    batch (an iterator never advanced draws nothing)."""
    batch_sampler = loader.batch_sampler
    if type(batch_sampler) is BatchSampler:
        batch_sampler.__class__ = CountedBatchSampler
    counter = PassCounter(loader.num_workers)  # one per engine: a second make_private on
    # the same loader replaced the first's, which fell back to steps / len(loader) (until
    # 2026-11-30)
    batch_sampler.__dict__.setdefault("_wb_passes", []).append(counter)
    return counter


def loader_sample_rate(loader: DataLoader, N: int, world: int = 1) -> float:
    """q = world x batch_size / N, checked to be in (0, 1] before anything uses it.

    ``world``: ranks that each draw ``batch_size`` per step (shuffled DDP loaders)."""
    B = loader.batch_size
    q = world * B / N
    if not 0 < q <= 1:
        per = f"{world} ranks x " if world > 1 else ""
        raise ValueError(f"data_loader.batch_size={B} gives the sample rate q = {per}{B} / N = "
                         f"{q:.4g} for a data set of N = {N}: q must be in (0, 1] (the "
                         f"probability that a record is in a step's batch; the accountant "
                         f"cannot analyse q > 1). Use batch_size <= {N // world} "
                         f"(the expected batch size)")
    return q


def loader_options(loader: DataLoader) -> dict:
    """The original loader's ``KEPT_OPTIONS`` that this torch version has."""
    return {k: getattr(loader, k) for k in KEPT_OPTIONS if hasattr(loader, k)}


__all__ = [
    "KEPT_OPTIONS", "CountedBatchSampler", "DPDataLoader", "PassCounter", "PoissonBatchSampler",
    "PoissonCollate", "check_dataset", "check_once_per_pass", "check_own_sampler",
    "count_passes", "empty_like_batch", "loader_options", "loader_sample_rate",
]
