"""How fine an ``audit_dp_step`` run can see: its resolution, and when "passed" means nothing.

A statistical audit that finds nothing has only shown that the step is within its resolution
of the claim. Two errors matter most for privacy and shrink slowest with more calls (their
effects are a small shift in a variance or in one mean among the noise), so each run computes
the smallest of them it detects with power ``POWER`` (0.8, the usual design target) at its own
level and sample size, from the design alone:

noise std (the pooled χ² test of ``mechanism_noise``, level a/2, dof k = batches·d·(T-1)):  (1)

    a step whose noise std is (1 + e)·s has E[Σr²/(s² k)] = (1 + e)², detected with power P
    when |(1 + e)² - 1| >= (z_(a/4) + z_(1-P)) sqrt(2/k);  e_noise = the larger |e| of the two
    signs (a std 10% low, 0.9x, is the harder and the one that breaks ε).

clip norm (the clip-boundary batch, rows of norm r_k C on one coordinate, max-|t| over d):  (2)

    clipping to κC instead of C moves that coordinate's mean by f(κ) C/B with
    f(κ) = Σ_k (min(r_k, κ) - 1)_+, against a standard error σC/(B sqrt(T)); detected with
    power P when f(κ) sqrt(T)/σ >= t_(a/(4d), T-1) + z_(1-P);  e_clip = κ - 1.

Two more limits are stated, not targeted (no run size makes them vanish), so that "passed"
never claims more than was measured (``MechanismAudit.limits``):

noise cut (the support and atom tests of ``mechanism_noise`` Eq. (4), level a/4 each):    (3)

    any noise of bounded support at c (clamped or truncated) is rejected whenever
    (1 - 2Φ(-c - 2h))^N <= a/4 (h: the output grid's half cell beyond the noise, N values):
    c_cut = Φ^-1(1 - (1 - (a/4)^(1/N))/2) - 2h, shrunk by the scale's estimation error
    (3 sds of ŝ). A clamp also piles N·2Φ(-c) values at c; seen with power P when that
    Poisson count reaches the atom test's threshold at c: c_clamp (>= c_cut). At T = 200,
    d = 32 (the command line's --quick) c_cut ~ 3.7σC, c_clamp ~ 4.0σC (float64); at the
    defaults (T = 400, d = 64) ~ 4.0σC and ~ 4.3σC.

sums of calls (the sums part of ``mechanism_noise`` Eq. (2), level a/3 over its lengths):  (4)

    the variance of the sum of L consecutive calls' noise, as a ratio to L s², is seen with
    power P outside [ρ_lo, ρ_hi], ρ_lo = F_(a'/2)(W d, W d (L - 1)) / F_P, ρ_hi = F_(1-a'/2) /
    F_(1-P) (W windows); the narrowest band at L = 2, the widest at L = m (all calls).

The audit passes only when both are at most ``TARGETS`` (10%: a step whose noise is 0.9x or
whose clip norm is 1.1 C, an ε off by ~10%, must not pass unseen); otherwise, if no check failed,
its verdict is "inconclusive at this sample size", with the trials that would resolve both.
With σ = 0 every check is exact and the resolution is 0.

Notation: T trials (calls per batch), d coordinates, σ noise multiplier, C clip norm,
B expected batch size, s = σC/B, a the level of one row of the audit's table.
"""

import functools
import math

import numpy as np
from scipy import stats

from workbench.audit.mechanism_noise import window_lengths

POWER = 0.8
TARGETS = {"noise std": 0.10, "clip norm": 0.10}
MAX_TRIALS = 10**7  # the search for the trials that would resolve both stops here


def noise_std_resolution(trials, dim, batches, a):
    """e_noise of Eq. (1): the relative error in the noise std seen with power ``POWER``."""
    k = batches * dim * (trials - 1)
    dv = (stats.norm.isf(a / 4) + stats.norm.isf(1 - POWER)) * math.sqrt(2 / k)
    low = 1 - math.sqrt(max(1 - dv, 0.0))  # (1 + e)² = 1 - dv, e < 0
    return max(low, math.sqrt(1 + dv) - 1)


def clip_resolution(trials, dim, sigma, norms, a):
    """e_clip of Eq. (2) for boundary rows of norms ``norms`` (units of C); inf if out of reach."""
    if sigma == 0:
        return 0.0
    need = (stats.t.isf(a / (4 * dim), trials - 1) + stats.norm.isf(1 - POWER)) \
        * sigma / math.sqrt(trials)
    r = np.sort(np.asarray(norms, dtype=np.float64)[np.asarray(norms) > 1])  # rows above C
    if r.size == 0 or need > np.sum(r - 1):
        return math.inf
    for j, kappa in enumerate(r):  # f is piecewise linear: slope = rows with r_k > κ
        f = np.sum(r[:j] - 1) + (r.size - j) * (kappa - 1)  # f(κ = r_j)
        if f >= need:
            lo = r[j - 1] if j else 1.0
            f_lo = np.sum(r[:j] - 1) + (r.size - j) * (lo - 1) if j else 0.0
            return float(lo + (need - f_lo) / (r.size - j) - 1)
    return float(r[-1] - 1)


def resolution(trials, dim, sigma, batches, norms, a):
    """{"noise std": e_noise, "clip norm": e_clip} of one run (0 for a noise-free claim)."""
    if sigma == 0:
        return {"noise std": 0.0, "clip norm": 0.0}
    return {"noise std": noise_std_resolution(trials, dim, batches, a),
            "clip norm": clip_resolution(trials, dim, sigma, norms, a)}


def resolved(res):
    """True when every resolution is within its target."""
    return all(res[k] <= TARGETS[k] for k in TARGETS)


def support_cut(n, a, dof, half=0.0):
    """c_cut of Eq. (3): the largest cut (units of σC/B) of the noise's support rejected with
    certainty by ``support_p`` at level ``a`` among ``n`` values, its grid's half cell
    ``half`` and the scale's ``dof``."""
    c = float(stats.norm.isf(-math.expm1(math.log(a) / n) / 2))
    return c * (1 - 3 / math.sqrt(2 * dof)) - 2 * half


@functools.lru_cache(maxsize=256)  # the command line audits many steps of one design
def clamp_cut(n, a, cell=0.0, z=3.0):
    """c_clamp of Eq. (3): the largest clamp seen by its atoms with power ``POWER`` (``atoms_p``
    at level ``a`` among ``n`` values, the output's grid cell ``cell`` at the bound, units of
    s); ``z`` if none beyond it."""
    w = max(1e-5, 2 * cell)  # mechanism_noise.ATOM_WIDTH at least

    def seen(c):
        lam = n * 2 * (stats.norm.sf(c - cell / 2) - stats.norm.sf(c + w + cell / 2))  # null
        bonferroni = n * 2 * stats.norm.sf(z)  # values in its window, and windows (atoms_p)
        k = 2  # the least count (atoms included) the scan rejects at c
        while bonferroni * stats.poisson.sf(k - 2, lam) > a and k < 10**4:
            k += 1
        return stats.poisson.sf(k - 1, n * 2 * stats.norm.sf(c)) >= POWER  # P(atoms >= k)
    lo, hi = z, 10.0
    if not seen(lo):
        return z
    for _ in range(16):  # to ~1e-4 σ
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if seen(mid) else (lo, mid)
    return lo


def shape_resolution(n, a, dof, half=0.0, cell=0.0):
    """{"noise cut": c_cut, "clamp": c_clamp} of Eq. (3), units of the measured ŝ: ``half``
    the largest rounding cell of a tail value (``support_p``), ``cell`` the grid's coarsest
    cell near the cut (``atoms_p``)."""
    cut = support_cut(n, a, dof, half)
    return {"noise cut": cut, "clamp": max(cut, clamp_cut(n, a, cell))}


def sums_resolution(m, dim, a):
    """{L: (ρ_lo, ρ_hi)} of Eq. (4) for ``m`` consecutive calls of ``dim`` coordinates, each L
    of ``mechanism_noise.window_lengths`` at its Bonferroni share of ``a``."""
    return dict(_sums_bands(m, dim, a))


@functools.lru_cache(maxsize=256)  # the command line audits many steps of one design
def _sums_bands(m, dim, a):
    """``sums_resolution`` as ((L, (ρ_lo, ρ_hi)), ...), cached."""
    Ls = window_lengths(m)
    out = {}
    for L in Ls:
        W = m // L
        df1, df2 = W * dim, W * dim * (L - 1)
        share = a / len(Ls)
        out[L] = (float(stats.f.ppf(share / 2, df1, df2) / stats.f.ppf(POWER, df1, df2)),
                  float(stats.f.isf(share / 2, df1, df2) / stats.f.ppf(1 - POWER, df1, df2)))
    return tuple(out.items())


def trials_needed(dim, sigma, batches, norms, a):
    """The least trials (to ~10%) at which both resolutions meet ``TARGETS``; None if never."""
    lo, hi = 20, 20
    while not resolved(resolution(hi, dim, sigma, batches, norms, a)):
        lo, hi = hi, hi * 2
        if hi > MAX_TRIALS:
            return None
    while hi > lo * 1.1:
        mid = int(math.sqrt(lo * hi))
        lo, hi = (lo, mid) if resolved(resolution(mid, dim, sigma, batches, norms, a)) \
            else (mid, hi)
    return int(hi)


__all__ = ["MAX_TRIALS", "POWER", "TARGETS", "clamp_cut", "clip_resolution",
           "noise_std_resolution", "resolution", "resolved", "shape_resolution",
           "sums_resolution", "support_cut", "trials_needed"]
