"""Data loaders for the example claims: ``make_loader(dataset) -> iterable of batches``.

``python -m workbench audit --claim ... --loader examples.claims.loaders:poisson_loader``
audits the loader on an index data set at the claim's sampling rate (here q = 256 / 60000).
"""

import torch
from torch.utils.data import DataLoader

from workbench.dpsgd.sampling import DPDataLoader

Q = 256 / 60000


def poisson_loader(dataset):
    """The workbench's Poisson loader (what PrivacyEngine.make_private builds)."""
    return DPDataLoader(dataset, sample_rate=Q, generator=torch.Generator().manual_seed(0))


def shuffled_loader(dataset):
    """A plain shuffled DataLoader with fixed-size batches (not Poisson)."""
    return DataLoader(dataset, batch_size=max(1, round(Q * len(dataset))), shuffle=True,
                      generator=torch.Generator().manual_seed(0))
