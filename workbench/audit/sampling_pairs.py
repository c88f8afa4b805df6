"""Co-occurrence: does a record come into batches with one particular other record too often?

Poisson sampling (Abadi et al. 2016, arXiv:1607.00133, §3.1) draws each record independently
of every other, so a record's group of "twins" (an augmented copy, a duplicate, a user's other
rows, a contiguous block read together) is not in the model: a loader that always brings j with
i makes the pair's sensitivity 2C, and group privacy charges it roughly ε twice over (Dwork and
Roth 2014, "The Algorithmic Foundations of Differential Privacy", Thm. 2.2). The sizes, counts
and overlaps of ``sampling.py`` cannot see it: every record is still drawn at rate q.

The exact conditional test. Given record i's row of the membership x (its c_i batches), every
other record j is in each of those batches independently with probability q, so its pair count
C_ij = #{s : x_(s,i) = x_(s,j) = 1} is Binomial(c_i, q), independently over j, and the record's
largest pair count M_i = max_(j != i) C_ij has the exact tail                               (1)

    P(M_i >= m | c_i) = 1 - (1 - P(Bin(c_i, q) >= m))^(N-1)  =: p_i,

a valid (discrete, so conservative) p-value; the test's p-value is min(1, N min_i p_i)
(Bonferroni over records). A group of g >= 2 records always drawn together gives each of them
M_i = c_i, so groups of 3+, pairs and blocks of contiguous indices are all caught the same way.

Resolution (what one run can see at power P = 0.8, level a of the test's row): a twin pair
drawn c times gives p = 1 - (1 - q^c)^(N-1), detected when N p <= a, i.e. when c >= c*; its c
is Binomial(S, q), so k independent pairs are seen with probability 1 - F(c* - 1)^k, F the
Binomial(S, q) cdf, and the smallest fraction of records in twin pairs resolved is         (2)

    f = 2 k / N,  k = ln(1 - P) / ln F(c* - 1)

(a lower bound on the power: any other record's chance excess only adds to it).

Not resolved: a pair that never meets (anti-correlation). Under Poisson P(C_ij = 0 | c_i) =
(1 - q)^(c_i) ~ exp(-S q²), so telling one such pair from the N²/2 others needs
S q² >~ 2 ln N + ln(1/a), about 11,000 steps at N = 1000, q = 0.05: out of any run's reach.

Cost: pair counts are sparse products X_[:,chunk]^T X over chunks of records (X the (S, N)
membership, scipy.sparse), about Σ_s b_s² multiply-adds in all and at most ``CHUNK`` pair
counts held at once; N = 60,000, q = 256/60,000, 4 epochs (936 steps, ~61M pair counts) took
4 s and ~140 MB beyond the (S, N) uint8 membership (56 MB) on a shared 2-core machine.

Notation: N records, q sample rate, S steps, b_s batch size, c_i batches holding i,
C_ij batches holding both i and j, M_i = max_j C_ij.
"""

import math

import numpy as np
from scipy import sparse, stats

POWER = 0.8
CHUNK = 4_000_000  # pair counts held at once (~50 MB)


def pair_maxima(x):
    """(c, M, partner): (N,) batches holding each record, its largest count with any other
    record, and that other record, for membership ``x`` (S, N) (repeats count once)."""
    X = sparse.csc_matrix(np.asarray(x) > 0, dtype=np.int32)  # (S, N)
    Xr = X.tocsr()
    S, N = X.shape
    c = np.asarray(X.sum(0)).ravel()  # (N,)
    work = np.asarray(X.T @ np.asarray(X.sum(1)).ravel()).ravel()  # (N,) Σ_(s∋i) b_s
    M, partner = np.zeros(N, dtype=np.int64), np.full(N, -1, dtype=np.int64)
    done, lo = np.cumsum(work), 0  # (N,) work up to each record: chunks of ~CHUNK counts
    while lo < N:
        hi = max(lo + 1, int(np.searchsorted(done, (done[lo - 1] if lo else 0) + CHUNK,
                                             side="right")))
        G = (X[:, lo:hi].T.tocsr() @ Xr).tocsr()  # (hi - lo, N) pair counts C_ij
        rows = np.repeat(np.arange(hi - lo), np.diff(G.indptr))
        G.data[G.indices == rows + lo] = 0  # C_ii = c_i is no pair
        G.eliminate_zeros()
        if G.nnz:
            best = np.asarray(G.argmax(axis=1)).ravel()
            M[lo:hi] = np.asarray(G.max(axis=1).toarray()).ravel()
            partner[lo:hi] = np.where(M[lo:hi] > 0, best, -1)
        lo = hi
    return c, M, partner


def pair_p_values(c, M, N, q):
    """p_i of Eq. (1): P(M_i >= M | c_i) under Poisson sampling, (N,)."""
    tail = stats.binom.sf(np.asarray(M) - 1, np.asarray(c), q)  # P(Bin(c_i, q) >= M_i)
    with np.errstate(divide="ignore"):
        return np.where(M > 0, -np.expm1((N - 1) * np.log1p(-np.minimum(tail, 1.0))), 1.0)


def cooccurrence_row(x, q):
    """(test, statistic z, p-value, meaning) of the co-occurrence test for membership x."""
    N = x.shape[1]
    c, M, partner = pair_maxima(x)
    p = pair_p_values(c, M, N, q)
    i = int(np.argmin(p))
    p_test = float(min(1.0, N * p[i]))
    z = float(stats.norm.isf(p_test / 2)) if p_test < 1 else 0.0
    seen = (f"; most: record {i} with {int(partner[i])}, together in {int(M[i])} of its "
            f"{int(c[i])} batches" if M[i] > 0 else "")
    return ("co-occurrence", z, p_test, "no record comes with one particular other record more "
            "often than Binomial(c_i, q) allows: twins, groups drawn together and contiguous "
            "blocks do (sensitivity 2C or more); a pair that never meets is out of reach" + seen)


def twin_resolution(N, q, S, a):
    """f of Eq. (2): the smallest fraction of records in always-together pairs that a run of S
    steps at row level ``a`` detects with power ``POWER``; inf when out of reach."""
    for cstar in range(1, S + 1):
        if N * -math.expm1((N - 1) * math.log1p(-q ** cstar)) <= a:
            break
    else:
        return math.inf
    F = float(stats.binom.cdf(cstar - 1, S, q))  # a pair drawn fewer than c* times: unseen
    if F >= 1.0:
        return math.inf
    k = math.log(1 - POWER) / math.log(F) if F > 0 else 1.0
    f = 2 * math.ceil(k) / N
    return f if f <= 1 else math.inf


__all__ = ["CHUNK", "POWER", "cooccurrence_row", "pair_maxima", "pair_p_values",
           "twin_resolution"]
