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

The audit passes only when both are at most ``TARGETS`` (10%: a step whose noise is 0.9x or
whose clip norm is 1.1 C, an ε off by ~10%, must not pass unseen); otherwise, if no check failed,
its verdict is "inconclusive at this sample size", with the trials that would resolve both.
With σ = 0 every check is exact and the resolution is 0.

Notation: T trials (calls per batch), d coordinates, σ noise multiplier, C clip norm,
B expected batch size, s = σC/B, a the level of one row of the audit's table.
"""

import math

import numpy as np
from scipy import stats

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


__all__ = ["MAX_TRIALS", "POWER", "TARGETS", "clip_resolution", "noise_std_resolution",
           "resolution", "resolved", "trials_needed"]
