"""Sampling audit: does a data loader really draw Poisson batches, as the accountant assumes?

The accounting of DP-SGD (Abadi et al. 2016, arXiv:1607.00133, §3.1; Mironov, Talwar, Zhang
2019, arXiv:1908.10530) holds for Poisson batches: at every step each of the N examples is in
the batch with probability q, independently of the other examples and of every other step.
Shuffled fixed-size batches are the common substitute, and accounting them as Poisson can
understate ε (Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha, Zhang 2024, "How Private are DP-SGD
Implementations?", ICML, arXiv:2403.17673). The audit feeds the loader a data set whose items
are their own indices, records the membership x_(s,j) ∈ {0, 1} of example j at step s over
S steps (E epochs), and tests four consequences of the Poisson claim, each a sum of
independent terms, so a normal approximation with the exact mean and variance applies:   (1)

    batch sizes     Σ_s z_s²,  z_s = (b_s - Nq) / sqrt(Nq(1-q)),  mean S, var S (2 + κ_N)
    example counts  Σ_j z_j²,  z_j = (c_j - Sq) / sqrt(Sq(1-q)),  mean N, var N (2 + κ_S)
    overlap at lag ℓ  O_ℓ = Σ_s Σ_j x_(s,j) x_(s+ℓ,j),  mean N (S-ℓ) q²,
                      var N [(S-ℓ) q²(1-q²) + 2 (S-2ℓ)_+ (q³ - q⁴)]

with κ_n = (1 - 6q(1-q)) / (n q(1-q)) the binomial's excess kurtosis. Two more facts share
those rows (each row's p-value is twice the smaller of its parts', Bonferroni):           (2)

    mean batch size   Σ_s b_s ~ N(S N q, S N q (1 - q)): a rate other than the claimed q
                      (1.1 q: ε understated) shifts it even when the spread looks binomial;
    no repeats        a Poisson batch holds each example at most once: any repeat is a
                      draw with replacement (which has Binomial sizes too, and passed);
    empty batches     their count is Binomial(S, (1 - q)^N) (exact two-sided test): a loader
                      that skips the empty ones (which tells that a batch was empty) passed
                      at N = 100, q = 0.02 until 2026-11-30 (its sizes look binomial);
    count extremes    the most and the least drawn of N Binomial(S, q) counts, exact
                      (``sampling_power`` Eq. (3)), in the example-count row: one record
                      drawn at 3 q moves Σ z_j² by one term in N, and passed at any size
                      until 2026-12-01.

Two more rows: the batch-size extremes (``sampling_power.py`` Eq. (1): the largest and the
smallest of S Binomial draws, exact; a cap on the batch size) and the co-occurrence of pairs
(``sampling_pairs.py`` Eq. (1): each record's largest pair count, exact given its own count;
twins, groups and blocks drawn together). A run that rejects nothing is "passed" only when
it resolves a cap at N q + 1 sd and twins in 10% of the records (``sampling_power``); else
"inconclusive", with the epochs that would resolve them.

Measured at N = 1000, q = 0.05, E = 4 (80 steps), 50 seeds each: 10% of the records with a
twin rejected 50/50 (0/5 before the pair test), a cap at N q + 1 sd 50/50 (1/5 before the
extremes test), 10% in groups of 3 48/50, contiguous blocks of 10 50/50; 1000 Poisson
memberships rejected 32 times at significance 0.05 (the pair test 0 times: it is conservative).
Not resolved there: caps above N q + 1.45 sd (at N q + 2 sd: 2/50), twins in fewer than 3% of
the records, a rate within 5.9% of q (at 1.05 q: 11/20; every summary states this range,
``sampling_power`` Eq. (2)), a few records drawn at 2 q (their ε understated; 2% of them:
16/50), one record drawn at up to 4.7 q (``sampling_power`` Eq. (3); seen from 2 q at 40
epochs), and a pair that never meets (out of any run's reach, ``sampling_pairs``). More epochs
or a larger q resolve the first five.

Lag 1 catches batches drawn without replacement within an epoch (consecutive batches
disjoint); lag L (the steps of the first epoch) catches a seed reused every epoch (epoch e+1
repeats epoch e). Each test is
two-sided and the audit passes when every p-value is at least significance / 6 (Bonferroni),
so a true Poisson loader fails with probability at most ``significance`` (checked over seeds in
tests/audit/test_sampling.py). Fixed-size batches have Σ z_s² = 0: they fail at any size.

Notation: N data set size, q sample rate, S steps, E epochs, b_s batch size, c_j count of j.
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy import stats
from torch.utils.data import Dataset

from workbench.audit.result import AuditResult
from workbench.audit.sampling_pairs import cooccurrence_row
from workbench.audit.sampling_power import (
    TARGETS,
    count_extremes,
    describe,
    epochs_needed,
    extremes_row,
    resolution,
    resolved,
)
from workbench.checks import check_count, check_probability, check_sample_rate

TARGETS_TEXT = f"caps at N q + {TARGETS['cap']:g} sd, twins in {TARGETS['twins']:.0%} of them"


class IndexDataset(Dataset):
    """N items, item j = tensor(j): batches then say which examples they hold."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        return torch.tensor(j)


def _indices(batch, N):
    """The example indices of one batch (a tensor, or the first element of a tuple/dict),
    checked to lie in the data set of N items."""
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    elif isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"the loader yielded {type(batch).__name__}; audit_sampling needs "
                        f"batches of the dataset's items (tensors of indices)")
    idx = batch.reshape(-1).long().numpy()
    if idx.size and (idx.min() < 0 or idx.max() >= N):
        raise ValueError(f"the loader yielded index {idx.max()} outside the dataset of "
                         f"{N} items; make_loader must use the dataset it is given")
    return idx


def _normal_p(stat, mean, var):
    """Two-sided p-value of a normal statistic."""
    z = (stat - mean) / np.sqrt(var)
    return float(z), float(2 * stats.norm.sf(abs(z)))


def _kurt(n, q):
    return (1 - 6 * q * (1 - q)) / (n * q * (1 - q))


@dataclass
class SamplingAudit(AuditResult):
    """The verdict: ``.passed``, ``.table`` (one row per test), ``.summary``.

    ``verdict``: "failed" (a test rejected Poisson), "inconclusive" (none did, but the run
    cannot resolve the named deviations: ``resolution``, ``sampling_power``) or "passed";
    ``passed`` is ``verdict == "passed"``. ``epochs_needed``: the epochs that would resolve
    them (None when resolved or out of reach).
    """

    passed: bool
    table: pd.DataFrame
    significance: float
    steps: int
    summary: str
    verdict: str = ""
    resolution: dict = field(default_factory=dict)
    epochs_needed: int | None = None

    def __post_init__(self):
        if not self.verdict:  # built by hand: the table decides
            self.verdict = "passed" if self.passed else "failed"


def _tests(x, N, q, L):
    """Rows (test, statistic z, p-value, meaning) of Eq. (1) for membership x (S, N)."""
    S = x.shape[0]
    b, c = x.sum(1), x.sum(0)  # (S,) batch sizes, (N,) example counts
    rows = []
    stat = np.sum((b - N * q) ** 2) / (N * q * (1 - q))
    spread = _normal_p(stat, S, S * (2 + _kurt(N, q)))
    level = _normal_p(b.sum(), S * N * q, S * N * q * (1 - q))  # Eq. (2): the rate itself
    empty = int((b == 0).sum())  # Eq. (2): the empty batches, Binomial(S, (1 - q)^N)
    p_empty = stats.binomtest(empty, S, float(np.exp(N * np.log1p(-q)))).pvalue
    z, p = min(spread, level, (float(empty), p_empty), key=lambda zp: zp[1])
    rows.append(("batch sizes", z, min(1.0, 3 * p), "batch sizes vary as Binomial(N, q) "
                 "around N q, empty ones included; fixed-size batches do not, a wrong rate "
                 "shifts their mean, and a loader that skips empty batches has none"))
    stat = np.sum((c - S * q) ** 2) / (S * q * (1 - q))
    z, p = min(_normal_p(stat, N, N * (2 + _kurt(S, q))), count_extremes(c, S, q),
               key=lambda zp: zp[1])
    p = min(1.0, 2 * p)  # Eq. (2): the spread and the extremes, Bonferroni
    repeated = int((x > 1).sum())  # an example twice in one batch: drawn with replacement
    rows.append(("example counts", z if not repeated else np.inf, p if not repeated else 0.0,
                 "each example is used Binomial(S, q) times, at most once per batch; once per "
                 "epoch is shuffling, twice in a batch is drawing with replacement; the "
                 f"most and least drawn ({int(c.max())}, {int(c.min())} times) are as extreme "
                 f"as {N} Binomial(S, q) counts make them (one record at 3 q is not)"
                 + (f" ({repeated} repeats seen)" if repeated else "")))
    wide = np.promote_types(x.dtype, np.uint16)  # uint8 counts: their products fit
    for name, lag, meaning in [("overlap, lag 1", 1, "consecutive batches share examples "
                                "at rate q²; disjoint ones mean sampling without replacement"),
                               (f"overlap, lag {L} (one epoch)", L, "a batch and the batch one "
                                "epoch later share at rate q²; more means a reused seed")]:
        if S - lag < 1:
            rows.append((name, np.nan, np.nan, "not enough steps for this lag"))
            continue
        overlap = float(np.sum(np.multiply(x[:-lag], x[lag:], dtype=wide)))
        var = N * ((S - lag) * q**2 * (1 - q**2) + 2 * max(S - 2 * lag, 0) * (q**3 - q**4))
        rows.append((name, *_normal_p(overlap, N * (S - lag) * q**2, var), meaning))
    return rows + [extremes_row(b, N, q), cooccurrence_row(x, q)]


def verdict(rows, significance):
    """(table, passed, failed tests): each two-sided test passes at significance / #tests
    (Bonferroni)."""
    table = pd.DataFrame(rows, columns=["test", "statistic (z)", "p-value", "meaning"])
    table["passed"] = ~(table["p-value"] < significance / len(table))
    return table, bool(table["passed"].all()), ", ".join(table.loc[~table["passed"], "test"])


def conclude(table, passed, N, q, steps, steps_per_epoch, significance, unit="records"):
    """(verdict, resolution, epochs needed, words) of a run: "failed" when a test rejected,
    else "passed" if the run resolves ``sampling_power.TARGETS``, else "inconclusive"."""
    a = significance / len(table)
    res = resolution(N, q, steps, a)
    if not passed:
        return "failed", res, None, ""
    if resolved(res, N, q):
        return "passed", res, None, f"; it resolves {describe(res, unit)}"
    need = epochs_needed(N, q, steps_per_epoch, a)
    more = f"rerun with epochs >= {need}" if need else "more epochs or a larger N"
    return "inconclusive", res, need, ("; no test failed, but it resolves only "
                                       f"{describe(res, unit)} (needs {TARGETS_TEXT}): {more}")


def audit_sampling(make_loader, dataset_size, sample_rate, *, epochs=4, significance=0.05):
    """Test the Poisson claim of ``make_loader(dataset)`` over ``epochs`` passes, Eq. (1).

    ``make_loader`` is called once with an :class:`IndexDataset` of ``dataset_size`` items
    and its loader is iterated ``epochs`` times. Power grows with N, q and E; the summary says
    what the run resolves (``sampling_power``), and an underpowered run is "inconclusive"."""
    N = check_count(dataset_size, "dataset_size", 2, 10**7)
    q = check_sample_rate(sample_rate, positive=True, below_one=True,
                          note="at q = 0 or 1 every batch is fixed: there is nothing to test")
    epochs = check_count(epochs, "epochs", 2, 10**4)
    significance = check_probability(significance, "significance", note="e.g. 0.05")
    loader = make_loader(IndexDataset(N))
    rows, first_epoch = [], None
    for _ in range(epochs):
        for batch in loader:
            # (N,) uint8: an index drawn twice counts twice (up to 255)
            rows.append(np.minimum(np.bincount(_indices(batch, N), minlength=N), 255)
                        .astype(np.uint8))
        first_epoch = first_epoch or len(rows)
    if len(rows) < 4:
        raise ValueError(f"the loader gave {len(rows)} batches in {epochs} epochs; need >= 4")
    x = np.stack(rows)  # (S, N)
    table, passed, failed = verdict(_tests(x, N, q, first_epoch), significance)
    word, res, need, tail = conclude(table, passed, N, q, len(rows), first_epoch, significance)
    head = {"passed": "consistent", "failed": "REJECTED", "inconclusive": "inconclusive"}[word]
    summary = (f"Poisson sampling {head}: {len(rows)} steps, N={N}, q={q:g}, significance "
               f"{significance:g}" + (f"; failed: {failed}" if failed else tail))
    return SamplingAudit(word == "passed", table, significance, len(rows), summary, word, res,
                         need)


def repeats_in_a_pass(make_loader, dataset_size, *, epochs=3) -> str | None:
    """What breaks the fixed-size bracket's premise in ``make_loader(dataset)``'s passes (a
    record drawn twice in one pass: a ``WeightedRandomSampler``, ``replacement=True``,
    ``num_samples`` above N), or None. The Poisson test alone says only "not Poisson", which
    a shuffle claim took as support until 2026-11-30 (a weighted loader drawing rare records
    ~33 times a pass "supported" ε 15.8 for ~57-212)."""
    N = check_count(dataset_size, "dataset_size", 2, 10**7)
    loader = make_loader(IndexDataset(N))
    for epoch in range(check_count(epochs, "epochs", 1, 10**4)):
        seen = np.zeros(N, dtype=np.int64)
        for batch in loader:
            np.add.at(seen, _indices(batch, N), 1)
        if seen.max() > 1:
            return (f"pass {epoch + 1} drew {int((seen > 1).sum())} of {N} indices more than "
                    f"once (up to {int(seen.max())} times): a fixed-size bracket assumes each "
                    f"record at most once a pass")
    return None


__all__ = ["IndexDataset", "SamplingAudit", "audit_sampling", "repeats_in_a_pass"]
