"""Noise calibration: the σ that spends a target ε.

ε(σ) of the sampled Gaussian mechanism falls monotonically with σ (for every order α the RDP
of Mironov, Talwar, Zhang 2019, arXiv:1908.10530, decreases in σ; so does the PLD's δ(ε)), so the
noise multiplier for a target (ε*, δ) is the smallest σ* with ε(σ*) <= ε*, found as a bracket (1)

    ε(σ_lo) > ε* >= ε(σ_hi),        σ_hi <= (1 + rtol) σ_lo,        returned: σ_hi,

so σ* <= σ_hi <= (1 + rtol) σ*: the noise is never more than rtol (default 1%) above the least
that meets the target, whatever the size of ε* (a tolerance on ε instead, say 0.01, would
cost 18% extra noise at ε* = 0.05 and 40% at ε* = 1e-3).

The root is bracketed, starting from a Gaussian-like approximation of the RDP curve. For small
q the binomial sum of Mironov, Talwar, Zhang (§3.3) starts A_α ≈ 1 + C(α, 2) q² (e^(1/σ²) - 1),
so T steps have ε(α) ≈ ρα with ρ = T q² (e^(1/σ²) - 1) / 2, and the conversion gives
ε ≈ ρ + 2 sqrt(ρ log(1/δ)); solving for σ,                                            (2)

    σ0 = 1 / sqrt(log(1 + 2ρ / (T q²))),    sqrt(ρ) = sqrt(log(1/δ) + ε*) - sqrt(log(1/δ)),

and solved by the Illinois variant of regula falsi in x = 1/σ, where ε(x) is nearly linear;
typically 4-8 evaluations of ε. An accountant registered as never above another (PLD: RDP)
starts from that one's answer, which is an upper end (its ε is never larger). RDP has a floor:
as σ grows, ε tends to min_α [log((α-1)/α) - (log δ + log α)/(α - 1)] > 0, so tiny targets are
unreachable with the given orders, and the error says so.

Notation: q sample rate, σ noise multiplier, T steps, ε* target epsilon, δ target delta.
"""

import math

from workbench.accounting.curve import epsilon
from workbench.accounting.registry import ACCOUNTANTS, get_accountant
from workbench.checks import (
    check_delta,
    check_epsilon,
    check_positive,
    check_sample_rate,
    check_steps,
)

SIGMA_MAX = 1e4  # beyond this the target is reported unreachable
_MAX_EVALS = 60


def steps_per_epoch(sample_rate):
    """One epoch is T = round(1/q) steps: the whole number of batches nearest to one pass over
    the data (q N T ≈ N examples drawn in expectation); at least 1.

    The one definition the workbench uses: the Poisson loader's default length
    (``DPDataLoader``), ``steps_from_epochs`` (accountants, calibration, widgets),
    ``make_private_with_epsilon`` and the fixed-size-batch bounds, so the steps a loader runs
    over E epochs are the steps the accountant counts. Python's ``round``: a half goes to the
    even number (q = 0.4: 1/q = 2.5 -> 2); float noise such as 1 / (2/7) = 3.4999999999999996
    is rounded away first.

    >>> steps_per_epoch(256 / 60_000), steps_per_epoch(0.01), steps_per_epoch(1.0)
    (234, 100, 1)
    """
    q = check_sample_rate(sample_rate, positive=True,
                          note="steps per epoch are 1 / sample_rate, so q = 0 has none")
    return max(1, round(round(1 / q, 9)))


def steps_from_epochs(epochs, sample_rate):
    """T = ceil(E round(1/q)): E epochs of ``steps_per_epoch`` steps; a fractional last epoch
    is rounded up (float noise such as 0.3 x 10 = 3.0000000000000004 ignored).

    >>> steps_from_epochs(20, 256 / 60_000), steps_from_epochs(0.5, 0.3)
    (4680, 2)
    """
    T = steps_per_epoch(sample_rate)
    return math.ceil(round(check_positive(epochs, "epochs") * T, 9))


def _initial_sigma(target_epsilon, target_delta, q, steps):
    """σ0 of Eq. (2)."""
    log_inv_delta = math.log(1 / target_delta)
    sqrt_rho = math.sqrt(log_inv_delta + target_epsilon) - math.sqrt(log_inv_delta)
    return 1 / math.sqrt(math.log1p(2 * sqrt_rho**2 / (steps * q**2)))


def get_noise_multiplier(target_epsilon, target_delta, sample_rate, steps=None, epochs=None,
                         accountant="rdp", rtol=0.01, **options):
    """The noise multiplier σ with ε(σ) <= target_epsilon, at most ``rtol`` above the least such σ.

    Precisely: ε(σ) <= target_epsilon < ε(σ / (1 + rtol)), Eq. (1); rtol in [1e-6, 1].
    Give exactly one of ``steps`` and ``epochs`` (``steps_from_epochs``).
    ``options`` go to :func:`workbench.accounting.epsilon` (``orders``, ``discretization``).

    >>> sigma = get_noise_multiplier(2.0, 1e-5, 0.01, epochs=10)
    >>> round(sigma, 2), epsilon(0.01, sigma, 1000, 1e-5) <= 2.0
    (1.02, True)
    """
    target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
    target_delta = check_delta(target_delta, "target_delta")
    q = check_sample_rate(sample_rate)
    rtol = check_positive(rtol, "rtol")
    if not 1e-6 <= rtol <= 1:
        raise ValueError(f"rtol must be in [1e-6, 1] (relative precision of sigma); got {rtol!r}")
    spec = get_accountant(accountant)
    if (steps is None) == (epochs is None):
        raise ValueError(f"give exactly one of steps and epochs; got steps={steps!r}, "
                         f"epochs={epochs!r}")
    steps = check_steps(steps) if epochs is None else steps_from_epochs(epochs, q)
    if q == 0 or steps == 0:
        return 0.0  # nothing is released about anyone: no noise needed

    def eps(sigma):
        return epsilon(q, sigma, steps, target_delta, accountant, **options)

    start = _initial_sigma(target_epsilon, target_delta, q, steps)
    for looser in (n for n in spec.never_above if n in ACCOUNTANTS):
        try:  # ε here <= ε there at every σ: that σ meets the target here too, an upper end
            start = get_noise_multiplier(target_epsilon, target_delta, q, steps=steps,
                                         accountant=looser, rtol=rtol)
            break
        except ValueError:
            pass
    return _solve(eps, target_epsilon, rtol, start)


def _bracket(eps, target, sigma):
    """(σ_lo, ε_lo, σ_hi, ε_hi) with ε_lo > target >= ε_hi, stepping from σ by factors
    1.25, 1.25², 1.25⁴, ... (small steps first: the starting guess is usually close)."""
    e, factor = eps(sigma), 1.25
    if e <= target:  # too much noise: shrink σ until ε exceeds the target
        hi, e_hi = sigma, e
        while True:
            lo = hi / factor
            e_lo, factor = eps(lo), factor**2
            if e_lo > target:
                return lo, e_lo, hi, e_hi
            hi, e_hi = lo, e_lo
    lo, e_lo = sigma, e
    while True:  # too little noise: grow σ until ε is within the target
        hi = lo * factor
        if hi > SIGMA_MAX:
            raise ValueError(
                f"target_epsilon={target} is unreachable: even noise_multiplier={SIGMA_MAX:g} "
                f"gives epsilon={eps(SIGMA_MAX):.4g}. With RDP, epsilon has a floor set by "
                f"delta and the largest order; raise target_epsilon or target_delta, or pass "
                f"orders with larger values."
            )
        e_hi, factor = eps(hi), factor**2
        if e_hi <= target:
            return lo, e_lo, hi, e_hi
        lo, e_lo = hi, e_hi


def _solve(eps, target, rtol, sigma0):
    """σ_hi of a bracket with ε(σ_hi) <= target < ε(σ_lo) and σ_hi <= (1 + rtol) σ_lo, Eq. (1).

    Illinois regula falsi in x = 1/σ, each probe nudged by rtol/3 past the estimated root
    towards the end that moved least recently, so both ends close in; every third probe bisects
    (in log σ), which bounds the number of evaluations even where ε(x) is far from linear.
    """
    lo, e_lo, hi, e_hi = _bracket(eps, target, sigma0)
    x_lo, x_hi = 1 / lo, 1 / hi  # x_lo > x_hi; ε grows with x
    f_lo, f_hi = e_lo - target, e_hi - target  # f_lo > 0 >= f_hi
    side = 0
    for it in range(_MAX_EVALS):
        if x_lo <= x_hi * (1 + rtol):
            return 1 / x_hi
        if it % 3 == 2 or math.isinf(f_lo):
            x = math.sqrt(x_lo * x_hi)  # bisect (log scale)
        else:
            x = x_hi - f_hi * (x_lo - x_hi) / (f_lo - f_hi)  # the secant's root
            x *= (1 + rtol / 3) if side >= 0 else 1 / (1 + rtol / 3)  # aim past the root
            x = min(max(x, x_hi * (1 + rtol / 10)), x_lo / (1 + rtol / 10))  # stay inside
        f = eps(1 / x) - target
        if f > 0:
            x_lo, f_lo = x, f
            if side == -1:
                f_hi /= 2  # Illinois: halve the stale end's weight
            side = -1
        else:
            x_hi, f_hi = x, f
            if side == 1:
                f_lo /= 2
            side = 1
    raise RuntimeError("noise calibration did not converge; please report this case")
