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

noise is Gaussian: Kolmogorov-Smirnov of the Helmert contrasts / s against N(0, 1) (``helmert``).

noise is fresh (a/2 lag-1 correlation, a/2 repeats)                                      (2)

    lag 1: r = Σ r_t·r_(t+1) / (norms), z = (r + 1/T) sqrt(pairs) ~ N(0, 1);
    repeats: for every pair of calls, of any batch, the cosine ρ of their noise vectors
    n = y - μ(G) (iid N(0, s² I) under the claim; not the residuals, whose centring would
    hide a component shared by every call). Two independent isotropic Gaussian vectors in d
    dimensions have (1 + ρ)/2 ~ Beta((d-1)/2, (d-1)/2), so max |ρ| over P pairs has p-value
    <= P·2·sf. A noise vector that comes back, at any lag (a seed reset every k steps, one per
    batch, a stale buffer mixed in), has ρ near 1; one that comes back exactly (the same n on
    one batch or on two) fails outright, at any d. A wrong mean shifts every n of its batch
    alike, so it can fail this part too (the mean rows say where).

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

Notation: T calls per batch, d coordinates, s the claimed output noise std, r residuals.
"""

import math

import numpy as np
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


def tails_p(noise: np.ndarray, s: float, z: float = 3.0) -> float:
    """p (two-sided, exact binomial) that the share of |y - μ| / s beyond ``z`` is the
    normal's 2Φ(-z): noise clamped at ±3σC (atoms at the bounds, which give the clipped sum
    away) leaves none beyond, and Kolmogorov-Smirnov on the Helmert mixtures, Gaussian by
    the central limit, missed it at 400 trials until 2026-11-30."""
    x = np.abs(noise) / s
    beyond = int((x > z).sum())
    return float(stats.binomtest(beyond, x.size, 2 * stats.norm.sf(z)).pvalue)


ATOM_WIDTH = 1e-5
"""Width (in units of s) of the window ``atoms_p`` counts values in: wide enough for a step
computing in float32 (its clamped values land within ~1e-7 |μ| / s of the bound)."""


def atoms_p(noise: np.ndarray, s: float, z: float = 3.0) -> float:
    """p (a scan statistic, Bonferroni over the windows) that the most |y - μ| / s values
    beyond ``z`` falling in one window of width ``ATOM_WIDTH`` is what a continuous normal
    gives: noise clamped at ±4σC piles ~8 of 128,000 values at the bound (atoms), which the
    tail count at z = 3 and Kolmogorov-Smirnov both passed until 2026-11-30 (a clamp at
    4-5σ is a δ of ~1e-5 per coordinate and step). A clamp beyond ~4.5σ leaves fewer than
    one value at the bound at this size: not seen (no black-box test at this size can)."""
    x = np.sort(np.abs(noise[np.isfinite(noise)]) / s)
    bulk = np.diff(x[(x > 1.0) & (x < z)])
    if bulk.size and float((bulk <= ATOM_WIDTH * 1e-3).mean()) > 0.05:  # values on a grid
        return 1.0  # (a step rounding to bfloat16): every window is an atom, nothing to test
    width = ATOM_WIDTH
    x = x[x > z]
    if x.size < 2:
        return 1.0
    ends = np.searchsorted(x, x + width, side="right")
    most = int((ends - np.arange(x.size)).max())  # values in [x_i, x_i + width]
    lam = noise.size * 2 * stats.norm.pdf(z) * width  # the densest window's mean
    windows = (float(x[-1]) - z) / width + 1
    return float(min(1.0, windows * stats.poisson.sf(most - 1, lam)))


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


def fresh_p(R: np.ndarray, noise: np.ndarray, T: int) -> tuple:
    """(lag-1 correlation, combined p) of Eq. (2). ``noise``: y - μ(G) of every call (m, d)."""
    num = (R[:, 1:] * R[:, :-1]).sum()  # lag-1: call t against call t+1
    r = num / np.sqrt((R[:, 1:] ** 2).sum() * (R[:, :-1] ** 2).sum())
    n_pairs = R.shape[0] * R.shape[2] * (T - 1)
    p_lag = 2 * stats.norm.sf(abs((r + 1 / T) * np.sqrt(n_pairs)))  # centring biases r by -1/T
    d = R.shape[2]
    rho, same = _cosines_max(noise)  # (batches·T, d): y - μ(G), iid N(0, s² I)
    pairs = noise.shape[0] * (noise.shape[0] - 1) / 2
    p_rep = 0.0 if same else min(
        1.0, pairs * 2 * stats.beta.sf((1 + rho) / 2, (d - 1) / 2, (d - 1) / 2))
    return r, float(min(1.0, 2 * p_lag, 2 * p_rep))


__all__ = ["ATOM_WIDTH", "BLOCK", "EXACT", "atoms_p", "call_p", "direction_p", "fresh_p",
           "helmert", "tails_p",
           "variance_p"]
