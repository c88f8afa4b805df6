"""How fine a sampling audit can see: the batch-size extremes, its resolution, "inconclusive".

Batch-size extremes. The S batch sizes of a Poisson loader are independent Binomial(N, q)
draws (F their cdf), so the largest and the smallest have the exact tails              (1)

    P(max_s b_s <= m) = F(m)^S,     P(min_s b_s >= m) = (1 - F(m - 1))^S,

and the row's p-value is twice the smaller of the two (Bonferroni). A loader that caps its
batches at K (a memory limit, a truncated index list) has max_s b_s <= K at every run, so it
is rejected whenever 2 F(K)^S <= a, a the row's level: with certainty, not just with power
0.8. The sum of squares Σ z_s² of ``sampling.py`` barely moves under such a cap (it removes
only the upper tail's excess), which is why a cap at N q + 1 sd passed 4 runs in 5.

Resolution. A run that rejects nothing has shown only that the loader is within the run's
resolution of Poisson (as ``mechanism_power.py`` says for the step). Two deviations the other
tests cannot see and that the run's size decides are named, each with what the run resolves
at power ``POWER`` and its row's level a = significance / (tests):

    cap     the largest cap K = N q + r sd with 2 F(K)^S <= a: r_cap, Eq. (1);
    twins   the smallest fraction of records in always-together pairs: f_twin,
            ``sampling_pairs`` Eq. (2);
    record  one record drawn at r_record q, the others at q, Eq. (3) (stated, not targeted);
    rate    the smallest relative error e_rate of the sample rate (a loader at (1 + e) q
            claiming q: ε understated) that the mean batch size (``sampling.py`` Eq. (2), a
            third of the batch-size row's level) sees:                                    (2)
                e_rate = (z_(a/6) + z_P) sqrt((1 - q) / (S N q)).
            Stated, not targeted: at N = 1000, q = 0.05, 4 epochs, 5.9%, so a loader at 1.05 q
            passed 9 runs in 20 under a summary that named only caps and twins until
            2026-12-01; the summary now says which rates the run cannot tell from q.

Count extremes. The N records' counts c_j are independent Binomial(S, q) draws (F their cdf),
so the most and the least drawn have the exact tails                                      (3)

    P(max_j c_j >= m) = 1 - F(m - 1)^N,     P(min_j c_j <= m) = 1 - (1 - F(m))^N,

twice the smaller of the two the p-value (in the example-count row of ``sampling.py``, itself
twice the smaller of its two parts). One record drawn at r q is seen at power ``POWER`` when
P(Bin(S, r q) >= c*) >= POWER, c* the smallest count rejected: r_record, stated like the rate
(N = 1000, q = 0.05: 4.7 q at 4 epochs, 2.0 q at 40); the claim audit reruns the loader to see
2 q where that fits (``claim_audit.RECORD_RATE``).

The audit passes only when the cap floor(N q + 1 sd) is resolved (a cap that truncates about
one batch in six) and f_twin <= 10% (the probe's twin loader); otherwise, if no test failed,
its verdict is "inconclusive at this size", with the epochs that would resolve both. At the
report's setting (N = 1000, q = 0.05, 4 epochs: 80 steps, six rows at level 0.05/6) it
resolves caps up to N q + 1.45 sd and twins down to 3% of the records.

Notation: N records, q sample rate, S steps, b_s batch size, sd = sqrt(N q (1 - q)).
"""

import math

import numpy as np
from scipy import stats

from workbench.audit.sampling_pairs import POWER, twin_resolution

TARGETS = {"cap": 1.0, "twins": 0.10}  # r_cap at least, f_twin at most
MAX_EPOCHS = 10**4  # the search for the epochs that would resolve both stops here


def extremes_row(b, N, q):
    """(test, statistic z, p-value, meaning) of Eq. (1) for batch sizes ``b`` (S,)."""
    S = len(b)
    top, bottom = int(np.max(b)), int(np.min(b))
    p_cap = float(stats.binom.cdf(top, N, q)) ** S  # P(max <= top)
    p_floor = float(stats.binom.sf(bottom - 1, N, q)) ** S  # P(min >= bottom)
    p = min(1.0, 2 * min(p_cap, p_floor))
    z = float(stats.norm.isf(p / 2)) if p < 1 else 0.0
    return ("batch-size extremes", z if p_cap <= p_floor else -z, p,
            f"the largest ({top}) and smallest ({bottom}) of {S} batches are as extreme as "
            f"{S} Binomial(N, q) draws make them; a cap or a floor on the size is not")


def count_extremes(c, S, q):
    """(z, p) of Eq. (3) for the records' counts ``c`` (N,) over S steps: the most drawn and
    the least drawn of N Binomial(S, q) counts, exact, two-sided (twice the smaller tail)."""
    N = len(c)
    top, bottom = int(np.max(c)), int(np.min(c))
    with np.errstate(divide="ignore"):
        p_top = -math.expm1(N * np.log(float(stats.binom.cdf(top - 1, S, q))))  # P(max >= top)
        p_bottom = -math.expm1(N * np.log1p(-float(stats.binom.cdf(bottom, S, q))))
    p = min(1.0, 2 * min(p_top, p_bottom))
    z = float(stats.norm.isf(p / 2)) if p < 1 else 0.0
    return (z if p_top <= p_bottom else -z), p


def record_resolution(N, q, S, a):
    """r_record of Eq. (3): one record drawn at r q (the others at q) is seen with power
    ``POWER`` by the count extremes at a quarter of the row level ``a``; inf when not even a
    record in every batch is."""
    F = stats.binom.cdf(np.arange(S + 1) - 1, S, q)  # F[c] = P(Bin(S, q) <= c - 1)
    with np.errstate(divide="ignore"):
        p = -np.expm1(N * np.log(F))  # P(max >= c) under Poisson, c = 0..S
    hits = np.nonzero(2 * p <= a / 2)[0]
    if not len(hits):
        return math.inf
    cstar = int(hits[0])  # the smallest count the test rejects at
    def seen(r):
        return float(stats.binom.sf(cstar - 1, S, min(1.0, r * q))) >= POWER
    hi = 1.0 / q
    if not seen(hi):
        return math.inf
    lo = 1.0
    while hi - lo > 0.01 * lo:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if seen(mid) else (mid, hi)
    return hi


def cap_resolution(N, q, S, a):
    """r_cap: caps at N q + r_cap sd or below are rejected at row level ``a`` (-inf: none)."""
    K = int(stats.binom.ppf((a / 2) ** (1 / S), N, q))  # smallest K with F(K) >= bound
    while K >= 0 and 2 * float(stats.binom.cdf(K, N, q)) ** S > a:
        K -= 1
    return (K - N * q) / math.sqrt(N * q * (1 - q)) if K >= 0 else -math.inf


def rate_resolution(N, q, S, a):
    """e_rate of Eq. (2): the relative error of q seen with power ``POWER`` in S steps."""
    z = stats.norm.isf(a / 6) + stats.norm.isf(1 - POWER)  # two-sided at a/3 of the row
    return float(z * math.sqrt((1 - q) / (S * N * q)))


def resolution(N, q, S, a):
    """{"cap": r_cap, "twins": f_twin, "rate": e_rate} of a run of S steps at row level
    ``a`` (the rate is stated, not one of ``TARGETS``)."""
    return {"cap": cap_resolution(N, q, S, a), "twins": twin_resolution(N, q, S, a),
            "rate": rate_resolution(N, q, S, a), "record": record_resolution(N, q, S, a)}


def resolved(res, N, q, record=None):
    """True when both meet ``TARGETS``: the cap floor(N q + 1 sd) (sizes are integers) and
    twins in 10% of the records; with ``record``, one record at ``record`` q too."""
    sd = math.sqrt(N * q * (1 - q))
    cap = math.floor(N * q + TARGETS["cap"] * sd)
    return N * q + res["cap"] * sd >= cap - 1e-9 and res["twins"] <= TARGETS["twins"] and (
        record is None or res["record"] <= record)


def epochs_needed(N, q, steps_per_epoch, a, record=None):
    """The fewest epochs (to ~10%) whose run resolves both targets (and one record at
    ``record`` q, when given); None if beyond ``MAX_EPOCHS``."""
    def ok(e):
        return resolved(resolution(N, q, e * steps_per_epoch, a), N, q, record)
    lo, hi = 1, 2
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_EPOCHS:
            return None
    while hi > lo * 1.1 and hi - lo > 1:
        mid = int(math.sqrt(lo * hi))
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return int(hi)


def describe(res, unit="records"):
    """The resolution in words: "caps at N q + 1.45 sd, twins in 3.00% of the records, a rate
    off by 5.9% (...)"."""
    cap = f"caps at N q + {res['cap']:.2f} sd" if math.isfinite(res["cap"]) else "no cap"
    twins = (f"twins in {res['twins']:.2%} of the {unit}" if math.isfinite(res["twins"])
             else "no twins")
    if "rate" not in res:
        return f"{cap}, {twins}"
    e = res["rate"]
    text = (f"{cap}, {twins}, a rate off by {e:.1%} (a loader at {1 - e:.3g} q to "
            f"{1 + e:.3g} q is not told from q)")
    if "record" in res:
        r = res["record"]
        text += (f", one {unit[:-1]} drawn at {r:.2g} q or more" if math.isfinite(r) else
                 f", no single {unit[:-1]} drawn more often")
    return text


__all__ = ["MAX_EPOCHS", "POWER", "TARGETS", "cap_resolution", "count_extremes", "describe",
           "epochs_needed", "extremes_row", "rate_resolution", "record_resolution",
           "resolution", "resolved"]
