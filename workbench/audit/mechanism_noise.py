"""The noise checks of ``audit_dp_step``: variance, shape and freshness of the residuals.

A correct step's noise is N(0, s² I), s = σC/B, drawn afresh at every call (Abadi et al. 2016,
arXiv 1607.00133, Algorithm 1). The residuals r_t = y_t - ȳ of T calls on one batch are then
iid across coordinates and calls (up to the centring), so each statistic below has an exact
null law. Each row splits its level a between its parts (Bonferroni):

noise variance (two-sided χ² each, Bonferroni inside the row)                            (1)

    Σ r²/s² ~ χ²(k (T-1)) over all k = batches·d cells, over each batch's d, over each
    coordinate's batches. The pooled test is the most powerful against one wrong scale (1.1σ);
    the per-coordinate and per-batch ones see noise that is right on average but not in each
    part: one parameter group noised twice and another not at all, a frozen-then-unfrozen
    parameter without noise, a noise scale that follows the realised batch size. Weights:
    a/2 pooled, a/4 per batch, a/8 per coordinate, a/8 every direction (3).

noise is fresh (a/3 lag-1 correlation, a/3 repeats, a/3 sums)                             (2)

    lag 1: r = Σ r_t·r_(t+1) / (norms), z = (r + 1/T) sqrt(pairs) ~ N(0, 1);
    repeats: for every pair of calls, of any batch, the cosine ρ of their noise vectors
    n = y - μ(G) (iid N(0, s² I) under the claim; not the residuals, whose centring would
    hide a component shared by every call). Two independent isotropic Gaussian vectors in d
    dimensions have (1 + ρ)/2 ~ Beta((d-1)/2, (d-1)/2), so max |ρ| over P pairs has p-value
    <= P·2·sf. A noise vector that comes back, at any lag (a seed reset every k steps, one per
    batch, a stale buffer mixed in), has ρ near 1; one that comes back exactly (the same n on
    one batch or on two) fails outright, at any d. A wrong mean shifts every n of its batch
    alike, so it can fail this part too (the mean rows say where).
    sums: fresh noise makes the noise of L consecutive calls sum to std sqrt(L)·s. The
    designed batches' calls n_1..n_m, in the order the step was called, cut into windows of L
    calls (L = 2, 4, 8, ... <= m, and m, ``window_lengths``): each window's sum and its
    within-window spread are independent under the claim, so
        F_L = (Σ_w ||Σ_(t∈w) n_t||² / (L·W·d)) / (Σ_w Σ_(t∈w) ||n_t - n̄_w||² / (W·d·(L-1)))
    ~ F(W·d, W·d·(L-1)) exactly, whatever s (W windows). Noise that cancels over an epoch
    (k draws centred to sum to zero, antithetic pairs) has F near 0 at L <= k, noise that
    accumulates (an earlier call's noise mixed in) F above 1; both passed every check until
    2026-12-01 (lag 1 and pairwise cosines see neither). Two-sided, Bonferroni over the L;
    ``mechanism_power.sums_resolution`` states the variance ratio each L resolves.

noise variance in every direction (a/8 of the row, inside (1))                          (3)

    the per-coordinate rows cannot see noise that is right on every coordinate but missing
    in a direction across them (the noise of two coordinates equal, z_1 = z_0, so y_0 - y_1
    has none; noise projected off one direction and rescaled). Under the claim the Helmert
    contrasts H / s (m = batches·(T-1) rows of d) are iid N(0, 1), and the extreme singular
    values of such a Gaussian matrix obey (Davidson and Szarek 2001, Thm. II.13; Vershynin
    2012, arXiv 1011.3027, Cor. 5.35), for every t >= 0,

        P(s_min <= sqrt(m) - sqrt(d) - t) <= exp(-t²/2),   P(s_max >= sqrt(m) + sqrt(d) + t)
        <= exp(-t²/2),

    so each tail's t gives a p-value bound, exact in the sense of never liberal. A direction
    without noise has s_min near 0: at the defaults (m ~ 2,800, d = 64) it fails with
    p ~ e^-1000; a direction with half the variance has s_min ~ 0.71 sqrt(m), also far out.

noise is Gaussian (a/4 each: the bulk, the tails, the support, atoms)                    (4)

    at the measured scale ŝ = s·sqrt(Σr²/(s² k)) (a scale error is the variance row's: a step
    with 1.1x the claimed σ failed "Gaussian" too until 2026-12-01, its tails counted against
    s). The bulk: Kolmogorov-Smirnov of the Helmert contrasts / ŝ against N(0, 1) (``helmert``).
    The tails: the share of x = |y - μ| / ŝ beyond each z of ``TAIL_Z``, exact binomial,
    Bonferroni over the z (only z = 3 until 2026-12-01: a Gaussian truncated at 3.5σ passed 9
    runs in 10). The support: N iid |N(0, 1)| values have P(max x <= t) = (1 - 2Φ(-t))^N, so a
    noise cut at c (clamped or truncated: δ > 0 at every step) is rejected whenever
    (1 - 2Φ(-c))^N <= a/4, with certainty, not just with power (``support_p``; t is the largest
    x plus its rounding cell, so a float grid never makes it liberal). Atoms: a clamp piles
    its mass N·2Φ(-c) exactly at x = c; the values beyond z = 3 are scanned for too many in one
    rounding cell of the step's output dtype (``atoms_p``; a bfloat16 step's grid was skipped,
    p = 1, until 2026-12-01). ``mechanism_power.shape_resolution`` states the cut each run
    resolves: at the command line's --quick size (T = 200, d = 32) ~3.7σC for any cut, ~4σC
    for a float64 clamp; a cut beyond is not seen (no black-box test of that size can).

Notation: T calls per batch, d coordinates, s the claimed output noise std, ŝ the measured one,
r residuals, n = y - μ(G) a call's noise, N the values the shape tests see.
"""

import math

import numpy as np
import torch
from scipy import stats

BLOCK = 1024  # calls per side of a tile of the pairwise (Gram) computation
EXACT = 1e-12  # |n_t - n_u|² <= EXACT (|n_t|² + |n_u|²): the same noise vector


def helmert(R: np.ndarray) -> np.ndarray:
    """(batches, T-1, dim) Helmert contrasts of R (batches, T, dim) along the calls.

    h_k = (Σ_{j<=k} r_j - k·r_{k+1}) / sqrt(k(k+1)), k = 1..T-1: orthonormal and orthogonal to
    the mean, so T iid N(μ, s²) calls give T-1 iid N(0, s²) values exactly (centred residuals
    are correlated, -1/(T-1), which made asymptotic tests too liberal at small T)."""
    k = np.arange(1, R.shape[1])[None, :, None]  # (1, T-1, 1)
    head = np.cumsum(R, axis=1)[:, :-1]  # (batches, T-1, dim) Σ_{j<=k} r_j
    return (head - k * R[:, 1:]) / np.sqrt(k * (k + 1))


def _chi2_p(x, dof):
    """Two-sided p-value of a χ²(dof) statistic (array-valued)."""
    return np.minimum(1.0, 2 * np.minimum(stats.chi2.cdf(x, dof), stats.chi2.sf(x, dof)))


def variance_p(R: np.ndarray, s: float, T: int, noise: np.ndarray | None = None) -> tuple:
    """(pooled ratio Σr²/(s² dof), combined p) of Eq. (1) for residuals R (batches, T, d),
    with the every-direction part of Eq. (3) (``direction_p``) and, given ``noise`` (y - μ(G)
    of every call, (m, d)), every call's own noise (``call_p``). The pooled part keeps half
    the level (``mechanism_power`` sizes the noise-std resolution from it)."""
    sq = R ** 2 / s ** 2  # (batches, T, d)
    nb, _, d = R.shape
    dof = nb * d * (T - 1)
    pooled = sq.sum()
    p_pool = _chi2_p(pooled, dof)
    p_batch = _chi2_p(sq.sum(axis=(1, 2)), d * (T - 1)).min() * nb  # (batches,) -> min
    p_coord = _chi2_p(sq.sum(axis=(0, 1)), nb * (T - 1)).min() * d  # (d,) -> min
    p_dir = direction_p(helmert(R).reshape(-1, d) / s)
    p_call = 1.0 if noise is None else call_p(noise, s)
    return pooled / dof, float(min(1.0, 2 * p_pool, 8 * p_batch, 8 * p_coord, 8 * p_dir,
                                   8 * p_call))


def call_p(noise: np.ndarray, s: float) -> float:
    """p that no call's noise is too small: ||y_t - μ||²/s² ~ χ²(d) for each call t under
    the claim; the smallest, lower tail, Bonferroni over the calls. A step that skips the
    noise once (its first call, every hundredth) releases that call's clipped sum exactly
    (ε = ∞): the pooled variance barely moves (passed at 2000 trials until 2026-11-30)."""
    x = (noise ** 2).sum(1) / s ** 2  # (m,)
    return float(min(1.0, stats.chi2.cdf(x.min(), noise.shape[1]) * noise.shape[0]))


TAIL_Z = (3.0, 3.5, 4.0)  # the tail test's cut points (units of ŝ)
ATOM_Z = 3.0  # atoms are looked for beyond this (units of ŝ)
ATOM_WIDTH = 1e-5
"""Narrowest window (units of s) ``atoms_p`` counts values in: wide enough for a step computing
in float32 and returning float64 (its clamped values land within ~1e-7 |μ| / s of the bound).
A step whose outputs hold fewer bits is counted in two of its grid's cells (``coarsest``)."""


def cells(Y: np.ndarray, dtype, s: float) -> np.ndarray:
    """The spacing of ``dtype``'s grid at each output |y| (``Y`` any shape), in units of ``s``:
    a bfloat16 output near 1 is known to 2^-8, i.e. to ±2^-9 / s in the noise's units."""
    _, e = np.frexp(np.abs(Y))  # |y| = m 2^e, m in [0.5, 1): spacing eps 2^(e-1)
    return np.ldexp(float(torch.finfo(dtype).eps) / 2, e) / s


def tails_p(noise: np.ndarray, s: float, zs=TAIL_Z) -> float:
    """p (two-sided, exact binomial at each z of ``zs``, Bonferroni) that the share of
    |y - μ| / s beyond z is the normal's 2Φ(-z), Eq. (4). Noise clamped at ±3σC leaves none
    beyond 3, truncated at 3.5σ too few beyond 3.5 (a z = 3 test alone missed it)."""
    x = np.abs(noise[np.isfinite(noise)]) / s
    ps = [stats.binomtest(int((x > z).sum()), x.size, 2 * stats.norm.sf(z)).pvalue for z in zs]
    return float(min(1.0, len(zs) * min(ps)))


def support_p(noise: np.ndarray, s: float, half=0.0) -> float:
    """p that N iid |N(0, 1)| values reach no further than the observed ones, Eq. (4):
    P(max x <= t) = (1 - 2Φ(-t))^N with t = max(|y - μ| / s + half); ``half`` (units of s,
    broadcast to ``noise``) bounds how far rounding moved each value, so t is at least the
    unrounded noise's max and the p-value is never liberal. Noise of bounded support (clamped
    or truncated at c) gives p <= (1 - 2Φ(-c - 2 half))^N: rejected with certainty once N is
    large enough (``mechanism_power.shape_resolution``)."""
    ok = np.isfinite(noise)
    x = (np.abs(noise) / s + half)[ok]
    if x.size == 0:
        return 1.0
    return float(np.exp(x.size * np.log1p(-2 * stats.norm.sf(x.max()))))


def coarsest(dtype, s: float, mu_max: float):
    """x -> the coarsest grid cell (units of s) an output holding ``dtype`` has at
    |y - μ| = x·s for any |μ| <= ``mu_max`` (``cells`` at |y| = mu_max + x s: a grid's cells
    grow with |y|). ``atoms_p``'s windows take it, so a value on a fine part of the grid never
    counts the pile of a coarser part as its own atom."""
    return lambda x: cells(mu_max + np.asarray(x) * s, dtype, s)


def atoms_p(noise: np.ndarray, s: float, cell=None, z: float = ATOM_Z) -> float:
    """p (a scan statistic) that no window [x_i, x_i + w) of a value x_i = |y - μ| / s beyond
    ``z`` holds more values than a normal puts there, rounded as the step rounds: noise clamped
    at ±4σC piles ~8 of 128,000 values at the bound (atoms), which the tail counts and
    Kolmogorov-Smirnov pass. ``cell``: x -> the coarsest rounding cell of the step's output at
    x (units of s, ``coarsest``), None for float64; the window is w = max(``ATOM_WIDTH``, two
    such cells) and the values it can hold came from [x_i - h, x_i + w + h), h half a cell (a
    bfloat16 step's values were all "atoms", the test returning 1 untested, until 2026-12-01).
    Given x_i, the others in its window are Binomial(N - 1, π_i) with π_i at most that
    interval's normal mass, below Poisson(N π_i) in its tail; a union over the values beyond
    z (N·2Φ(-z) of them on average) makes the p-value N·2Φ(-z)·min_i P(Poisson(N π_i) >=
    count_i - 1). A clamp beyond the cut ``mechanism_power.shape_resolution`` states leaves
    too few values at its bound to be seen at this size; on a coarse grid (bfloat16) the
    support test (``support_p``) is the one that sees a cut."""
    ok = np.isfinite(noise)
    x = np.abs(noise[ok]) / s
    n = x.size
    x = np.sort(x[x > z])
    if x.size < 2:
        return 1.0
    c = np.zeros_like(x) if cell is None else np.broadcast_to(cell(x), x.shape)  # (k,)
    w = np.maximum(ATOM_WIDTH, 2 * c)
    count = np.searchsorted(x, x + w, side="left") - np.arange(x.size)  # in [x_i, x_i + w)
    lam = n * 2 * (stats.norm.sf(x - c / 2) - stats.norm.sf(x + w + c / 2))  # (k,) null mean
    p = stats.poisson.sf(count - 2, lam)  # P(others >= count - 1)
    return float(min(1.0, n * 2 * stats.norm.sf(z) * p.min()))


def direction_p(H: np.ndarray) -> float:
    """p of Eq. (3) for H (m, d), iid N(0, 1) rows under the claim: the Davidson-Szarek
    bounds on its extreme singular values (m >= d)."""
    m, d = H.shape
    if m < d:
        return 1.0
    sv = np.linalg.svd(H, compute_uv=False)
    lo = math.sqrt(m) - math.sqrt(d) - float(sv.min())  # the t of each tail, if positive
    hi = float(sv.max()) - math.sqrt(m) - math.sqrt(d)
    return min(1.0, 2 * min(math.exp(-t * t / 2) if t > 0 else 1.0 for t in (lo, hi)))


def _cosines_max(X: np.ndarray) -> tuple:
    """(max |cosine| over pairs of rows of X (m, d), whether two rows are equal), in
    BLOCK x BLOCK tiles of the Gram matrix (memory O(BLOCK²) at any m)."""
    norms = np.sqrt((X ** 2).sum(1))  # (m,)
    Xn = X / np.maximum(norms, 1e-300)[:, None]  # unit rows (a zero row stays zero)
    best, same = 0.0, bool((norms == 0).sum() > 1)
    for i in range(0, X.shape[0], BLOCK):
        for j in range(i, X.shape[0], BLOCK):
            cos = Xn[i:i + BLOCK] @ Xn[j:j + BLOCK].T  # (b, b'): rows t = i.. against u = j..
            if i == j:
                cos = np.triu(cos, k=1)  # pairs t < u only
            best = max(best, float(np.abs(cos).max(initial=0.0)))
            if not same:  # near-parallel pairs are rare under the claim: check those exactly
                t, u = np.nonzero(cos > 1 - 1e-6)
                x, y = X[i + t[:4096]], X[j + u[:4096]]  # (pairs, d); a few suffice
                same = bool((((x - y) ** 2).sum(1)
                             <= EXACT * ((x ** 2).sum(1) + (y ** 2).sum(1))).any())
    return best, same


def window_lengths(m: int) -> list:
    """The sums' window lengths of Eq. (2) for m consecutive calls: 2, 4, 8, ... up to m, and m
    (all of them). An epoch of k calls whose noise sums to zero lies whole in the first window
    of the least power of two >= k (k <= m): that window's sum is the few calls past it."""
    Ls = [2 ** j for j in range(1, m.bit_length()) if 2 ** j <= m]
    return Ls + ([m] if m >= 2 and m not in Ls else [])


def sums_p(calls: np.ndarray) -> tuple:
    """(F_L farthest from 1, p) of Eq. (2)'s sums for the noise of consecutive calls
    ``calls`` (m, d): two-sided F test at each of ``window_lengths(m)``, Bonferroni."""
    m, d = calls.shape
    worst, ps = 1.0, []
    for L in window_lengths(m):
        W = m // L
        X = calls[:W * L].reshape(W, L, d)  # (windows, L, d)
        sums = X.sum(1)  # (W, d)
        between = float((sums ** 2).sum()) / L  # s² χ²(W d) under the claim
        within = float((X ** 2).sum()) - between  # s² χ²(W d (L - 1)), independent
        df1, df2 = W * d, W * d * (L - 1)
        f = (between / df1) / max(within / df2, 1e-300)
        ps.append(min(1.0, 2 * min(stats.f.cdf(f, df1, df2), stats.f.sf(f, df1, df2))))
        worst = f if abs(math.log(max(f, 1e-300))) > abs(math.log(max(worst, 1e-300))) \
            else worst
    return worst, float(min(1.0, len(ps) * min(ps))) if ps else 1.0


def fresh_p(R: np.ndarray, noise: np.ndarray, T: int, calls: np.ndarray | None = None) -> tuple:
    """(lag-1 correlation, combined p) of Eq. (2). ``noise``: y - μ(G) of every call (m, d);
    ``calls``: the noise of consecutive calls of one step (``sums_p``), or None."""
    num = (R[:, 1:] * R[:, :-1]).sum()  # lag-1: call t against call t+1
    r = num / np.sqrt((R[:, 1:] ** 2).sum() * (R[:, :-1] ** 2).sum())
    n_pairs = R.shape[0] * R.shape[2] * (T - 1)
    p_lag = 2 * stats.norm.sf(abs((r + 1 / T) * np.sqrt(n_pairs)))  # centring biases r by -1/T
    d = R.shape[2]
    rho, same = _cosines_max(noise)  # (batches·T, d): y - μ(G), iid N(0, s² I)
    pairs = noise.shape[0] * (noise.shape[0] - 1) / 2
    p_rep = 0.0 if same else min(
        1.0, pairs * 2 * stats.beta.sf((1 + rho) / 2, (d - 1) / 2, (d - 1) / 2))
    p_sums = 1.0 if calls is None else sums_p(calls)[1]
    return r, float(min(1.0, 3 * p_lag, 3 * p_rep, 3 * p_sums))


__all__ = ["ATOM_WIDTH", "ATOM_Z", "BLOCK", "EXACT", "TAIL_Z", "atoms_p", "call_p", "cells",
           "coarsest",
           "direction_p", "fresh_p", "helmert", "sums_p", "support_p", "tails_p", "variance_p",
           "window_lengths"]
