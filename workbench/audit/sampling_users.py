"""Sampling audit at the user level: are *users* Poisson-sampled, with all their records?

User-level DP-SGD (``dpsgd/user_level.py``; McMahan et al. 2018, arXiv 1710.06963, §2) is
accounted as the sampled Gaussian mechanism over U users: at every step each user is in the
batch with probability q, independently of the other users and of every other step, and a
sampled user brings all of their records. The audit feeds ``make_loader(dataset, user_ids)``
an ``IndexDataset`` (item j = j) and a known assignment of records to users, and tests:

1. **together**: in every batch, each user's records are all in or all out (deterministic:
   one split user fails the audit; a record sampled on its own would be accounted as a user
   while its user's other records stay private only by group privacy);
2. **Poisson over users**: the user membership y_(s,u) = 1[u in batch s] passes the six
   tests of ``sampling.py`` with N := U (batch sizes in users and their extremes, per-user
   counts ≈ Sq, overlaps at lag 1 and one epoch, two users drawn together), Bonferroni over
   all seven tests; a run that rejects nothing is "inconclusive" unless it resolves the
   deviations of ``sampling_power`` (caps, twin users) at N := U.

Notation: N records, U users, u(j) user of record j, q user sample rate, S steps.
"""

import numpy as np
import torch

from workbench.audit.sampling import (
    IndexDataset,
    SamplingAudit,
    _indices,
    _tests,
    conclude,
    verdict,
)
from workbench.checks import check_count, check_probability, check_sample_rate

__all__ = ["audit_user_sampling", "example_user_ids"]


def example_user_ids(num_users: int, seed: int = 0) -> torch.Tensor:
    """A test assignment: users holding 1 to 3 records each, records in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 4, (num_users,), generator=g)
    ids = torch.repeat_interleave(torch.arange(num_users), sizes)
    return ids[torch.randperm(len(ids), generator=g)]


def audit_user_sampling(make_loader, user_ids, sample_rate, *, epochs=4, significance=0.05):
    """Test the user-level Poisson claim of ``make_loader(dataset, user_ids)`` (module doc).

    ``user_ids``: (N,) integers, the user of each record (``example_user_ids(U)`` makes one).
    """
    ids = torch.as_tensor(user_ids).long()
    _, user_of = torch.unique(ids, return_inverse=True)
    user_of = user_of.numpy()
    N, U = len(user_of), int(user_of.max()) + 1
    check_count(U, "the number of users", 2, 10**7)
    q = check_sample_rate(sample_rate, positive=True, below_one=True,
                          note="at q = 0 or 1 every batch is fixed: there is nothing to test")
    epochs = check_count(epochs, "epochs", 2, 10**4)
    significance = check_probability(significance, "significance", note="e.g. 0.05")
    loader = make_loader(IndexDataset(N), ids)
    rows, split, first_epoch = [], 0, None
    sizes = np.bincount(user_of, minlength=U)  # (U,) records per user
    for _ in range(epochs):
        for batch in loader:
            idx = _indices(batch, N)
            held = np.bincount(user_of[idx], minlength=U)  # (U,) records of u in the batch
            split += int(np.sum((held > 0) & (held != sizes)))
            rows.append((held > 0).astype(np.uint8))
        first_epoch = first_epoch or len(rows)
    if len(rows) < 4:
        raise ValueError(f"the loader gave {len(rows)} batches in {epochs} epochs; need >= 4")
    y = np.stack(rows)  # (S, U) user membership
    together = ("users' records together", np.nan, 0.0 if split else 1.0,
                f"{split} (step, user) pairs held only part of a user's records"
                if split else "every sampled user brought all of their records")
    table, passed, failed = verdict([together, *_tests(y, U, q, first_epoch)], significance)
    word, res, need, tail = conclude(table, passed, U, q, len(rows), first_epoch, significance,
                                  "users")
    head = {"passed": "consistent", "failed": "REJECTED", "inconclusive": "inconclusive"}[word]
    summary = (f"user-level Poisson sampling {head}: {len(rows)} steps, U={U} users, N={N} "
               f"records, q={q:g}, significance {significance:g}"
               + (f"; failed: {failed}" if failed else tail))
    return SamplingAudit(word == "passed", table, significance, len(rows), summary, word, res,
                         need)
