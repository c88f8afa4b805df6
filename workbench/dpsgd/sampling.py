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
- an "epoch" is ``round(1 / q)`` steps, so each example is used once per epoch on average.

Randomness comes from an explicit ``torch.Generator`` (reproducible runs); ``secure_mode``
(later) swaps in the operating system's cryptographic generator.

Notation: N data set size, q sample rate, B = qN expected batch size.
"""


import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate


def check_sample_rate(sample_rate) -> float:
    q = float(sample_rate)
    if not (0 < q <= 1):
        raise ValueError(f"sample_rate must be in (0, 1] (the probability that an example is in "
                         f"a batch); got {sample_rate!r}")
    return q


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps`` batches of indices; index j is in each with probability q."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None):
        if int(num_samples) != num_samples or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer; got {num_samples!r}")
        self.num_samples = int(num_samples)
        self.sample_rate = check_sample_rate(sample_rate)
        self.steps = max(1, round(1 / self.sample_rate)) if steps is None else int(steps)
        if self.steps < 1:
            raise ValueError(f"steps must be a positive integer; got {steps!r}")
        self.generator = generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            generator = self.generator.next() if hasattr(self.generator, "next") else \
                self.generator  # secure mode: a freshly seeded generator every step
            draws = torch.rand(self.num_samples, generator=generator)  # (N,) ~ U[0, 1)
            yield torch.nonzero(draws < self.sample_rate).flatten().tolist()


def empty_like_batch(example):
    """An empty batch (n = 0) with the structure, shapes and dtypes of one collated example."""
    batch = default_collate([example])
    return _take_none(batch)


def _take_none(batch):
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take_none(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _take_none(v) for k, v in batch.items()}
    raise TypeError(f"cannot make an empty batch of {type(batch).__name__}; the data set's "
                    f"examples must be tensors (or tuples/dicts of them)")


class DPDataLoader(DataLoader):
    """A DataLoader drawing Poisson batches: ``DPDataLoader(dataset, sample_rate=q, ...)``.

    Also ``DPDataLoader.from_data_loader(loader)``: the same data set with q = batch_size / N.
    """

    def __init__(self, dataset: Dataset, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, collate_fn=default_collate,
                 **kwargs):
        if len(dataset) == 0:
            raise ValueError("dataset is empty: Poisson sampling needs at least one example")
        sampler = PoissonBatchSampler(len(dataset), sample_rate, steps, generator)
        empty = empty_like_batch(dataset[0])

        def collate(batch):
            return collate_fn(batch) if batch else empty

        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate, **kwargs)
        self.sample_rate = sampler.sample_rate
        self.expected_batch_size = sampler.sample_rate * len(dataset)

    @classmethod
    def from_data_loader(cls, loader: DataLoader, generator=None, steps=None):
        if loader.batch_size is None:
            raise ValueError("the data loader has no batch_size (it uses a batch_sampler); "
                             "build DPDataLoader(dataset, sample_rate=...) directly")
        q = loader.batch_size / len(loader.dataset)
        return cls(loader.dataset, sample_rate=min(1.0, q), steps=steps, generator=generator,
                   num_workers=loader.num_workers, pin_memory=loader.pin_memory)


