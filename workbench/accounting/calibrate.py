"""Noise calibration: the σ that spends a target ε, tight in ε.

ε(σ) of the sampled Gaussian mechanism falls monotonically with σ (for every order α the RDP
of Mironov, Talwar, Zhang 2019, arXiv:1908.10530, decreases in σ; so does the PLD's δ(ε)), so the
noise multiplier for a target (ε*, δ) is found in a bracket σ_lo < σ_hi and returned as the σ
whose ε lies in a thin band just below the target:                                       (1)

    (1 - τ) ε* <= ε(σ) <= ε*,        τ = epsilon_tolerance (default 1e-3),

never above the target, and at most τ ε* below it: the noise added is what the target needs,
and the user can read how much was left unspent (``calibrate``). A relative band keeps the
precision the same at every size of ε* (an absolute one, say 0.01, would cost 18% extra noise
at ε* = 0.05). The older stop, ``rtol`` on σ (σ within 1 + rtol of the least σ), is still
accepted when given; it can leave ε a few percent below the target at large ε*.

The root is bracketed, starting from a Gaussian-like approximation of the RDP curve. For small
q the binomial sum of Mironov, Talwar, Zhang (§3.3) starts A_α ≈ 1 + C(α, 2) q² (e^(1/σ²) - 1),
so T steps have ε(α) ≈ ρα with ρ = T q² (e^(1/σ²) - 1) / 2, and the conversion gives
ε ≈ ρ + 2 sqrt(ρ log(1/δ)); solving for σ,                                            (2)

    σ0 = 1 / sqrt(log(1 + 2ρ / (T q²))),    sqrt(ρ) = sqrt(log(1/δ) + ε*) - sqrt(log(1/δ)),

and solved by the Illinois variant of regula falsi in x = 1/σ, where ε(x) is nearly linear,
aiming at the middle of the band (1); typically 4-8 evaluations of ε. An accountant registered
as never above another (PLD: RDP) starts from that one's answer, which is an upper end (its ε is
never larger). RDP has a floor: as σ grows, ε tends to min_α [log((α-1)/α) - (log δ + log α)/(α
- 1)] > 0, so tiny targets are unreachable with the given orders, and the error says so. An
accountant whose ε is a step function of σ (a coarse grid) may have no σ in the band; then the
bracket shrinks to σ_hi (1 ± 1e-10) and σ_hi is returned, still never above the target. So
does a run whose ε stays below the band down to the least noise the accountant can compute
(PLD refuses a loss too wide for its grid): at q T <= δ the total variation is below δ and ε is
0 at every σ, and that least σ is returned, with its ε (``Calibration.epsilon``) below the band.

Notation: q sample rate, σ noise multiplier, T steps, ε* target epsilon, δ target delta,
τ relative tolerance in ε.
"""

import math
from dataclasses import dataclass

from workbench.accounting.curve import check_history, history_epsilon
from workbench.accounting.registry import ACCOUNTANTS, get_accountant
from workbench.checks import (
    check_delta,
    check_epsilon,
    check_positive,
    check_sample_rate,
    check_steps,
)

SIGMA_MAX = 1e4  # beyond this the target is reported unreachable
#: Largest target ε calibrated. Past a few tens an (ε, δ) guarantee bounds nothing an attacker
#: cares about (e^ε overflows float64 at ε ≈ 709), and the σ that spends it is tiny: PLD and
#: PRV cannot grid such a loss, so the search would stop in their refusal instead.
MAX_TARGET_EPSILON = 1000.0
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


def steps_from_epochs(epochs, sample_rate, per_epoch=None):
    """T = ceil(E round(1/q)): E epochs of ``steps_per_epoch`` steps (or of ``per_epoch``, a
    loader's own len(loader)); a fractional last epoch is rounded up (float noise such as
    0.3 x 10 = 3.0000000000000004 ignored).

    >>> steps_from_epochs(20, 256 / 60_000), steps_from_epochs(0.5, 0.3)
    (4680, 2)
    """
    T = steps_per_epoch(sample_rate) if per_epoch is None else per_epoch
    return math.ceil(round(check_positive(epochs, "epochs") * T, 9))


def _initial_sigma(target_epsilon, target_delta, q, steps):
    """σ0 of Eq. (2)."""
    log_inv_delta = math.log(1 / target_delta)
    sqrt_rho = target_epsilon / (math.sqrt(log_inv_delta + target_epsilon)  # the difference
                                 + math.sqrt(log_inv_delta))  # of the two roots, no cancelling
    log_rho = math.log(2) + 2 * math.log(sqrt_rho) if sqrt_rho > 0 else -math.inf  # (ρ²
    # underflows to 0 for ε below 1e-162: a bare "math domain error" until 2026-12-02)
    ratio = log_rho - math.log(steps) - 2 * math.log(q)  # log(2ρ/(T q²)):
    # T q² underflows to 0 for q ≤ 1e-157 (a bare ZeroDivisionError or OverflowError until
    # 2026-12-01)
    x = ratio if ratio > 700 else math.log1p(math.exp(ratio))
    return min(1 / math.sqrt(x), SIGMA_MAX) if x > 0 else SIGMA_MAX  # (a start above the
    # documented limit let PLD return σ = 3.5e50 for ε = 1e-150: probe AJ) a target too
    # small to start from below:
    # the search reports it unreachable (a bare ZeroDivisionError until 2026-11-29)


def get_noise_multiplier(target_epsilon, target_delta, sample_rate, steps=None, epochs=None,
                         accountant="rdp", epsilon_tolerance=1e-3, rtol=None, history=None,
                         **options):
    """The noise multiplier σ with (1 - τ) target_epsilon <= ε(σ) <= target_epsilon, Eq. (1).

    τ = ``epsilon_tolerance`` in [1e-6, 0.5] (default 1e-3, for every accountant). Given
    ``rtol`` (in [1e-6, 1]) instead, the older stop on σ: ε(σ) <= target_epsilon <
    ε(σ / (1 + rtol)). Give exactly one of ``steps`` and ``epochs`` (``steps_from_epochs``).
    ``options`` go to :func:`workbench.accounting.epsilon` (``orders``, ``discretization``).
    ``history``: groups [(σ, q, T), ...] already spent (a run continued): σ is then the one
    whose steps, after them, bring the whole run's ε into the band; a history that alone
    spends ``target_epsilon`` is an error.

    >>> from workbench.accounting import epsilon
    >>> sigma = get_noise_multiplier(2.0, 1e-5, 0.01, epochs=10)
    >>> eps = epsilon(0.01, sigma, 1000, 1e-5)
    >>> round(sigma, 3), 2.0 * (1 - 1e-3) <= eps <= 2.0
    (1.023, True)
    """
    return calibrate(target_epsilon, target_delta, sample_rate, steps=steps, epochs=epochs,
                     accountant=accountant, epsilon_tolerance=epsilon_tolerance, rtol=rtol,
                     history=history, **options).noise_multiplier


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` found: σ, the ε it spends and how much of the target is unspent."""

    noise_multiplier: float
    epsilon: float
    target_epsilon: float
    evaluations: int

    @property
    def unspent(self) -> float:
        """(ε* - ε(σ)) / ε*: the relative part of the target the noise leaves unspent."""
        if not self.target_epsilon:
            return 0.0
        return (self.target_epsilon - self.epsilon) / self.target_epsilon


def calibrate(target_epsilon, target_delta, sample_rate, steps=None, epochs=None,
              accountant="rdp", epsilon_tolerance=1e-3, rtol=None, history=None,
              **options) -> Calibration:
    """``get_noise_multiplier`` with the evidence: σ, ε(σ), the target and the ε evaluations.

    >>> c = calibrate(3.0, 1e-5, 0.004, steps=2500)
    >>> c.epsilon <= 3.0, c.unspent <= 1e-3
    (True, True)
    """
    target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
    if target_epsilon > MAX_TARGET_EPSILON:
        raise ValueError(f"target_epsilon must be <= {MAX_TARGET_EPSILON:g} (a privacy budget, "
                         f"e.g. 1 to 8; beyond a few tens epsilon promises nothing, and "
                         f"e^epsilon overflows float64 past 709); got {target_epsilon!r}")
    target_delta = check_delta(target_delta, "target_delta")
    q = check_sample_rate(sample_rate)
    tau = check_positive(epsilon_tolerance, "epsilon_tolerance")
    if not 1e-6 <= tau <= 0.5:
        raise ValueError(f"epsilon_tolerance must be in [1e-6, 0.5] (relative band below the "
                         f"target epsilon); got {epsilon_tolerance!r}")
    if rtol is not None:
        rtol = check_positive(rtol, "rtol")
        if not 1e-6 <= rtol <= 1:
            raise ValueError(f"rtol must be in [1e-6, 1] (relative precision of sigma); got "
                             f"{rtol!r}")
    spec = get_accountant(accountant)
    if (steps is None) == (epochs is None):
        raise ValueError(f"give exactly one of steps and epochs; got steps={steps!r}, "
                         f"epochs={epochs!r}")
    steps = check_steps(steps) if epochs is None else steps_from_epochs(epochs, q)
    spent_before = [] if history is None else check_history(history)
    spent = history_epsilon(spent_before, target_delta, accountant, **options)
    if spent >= target_epsilon:  # no σ for the new steps can bring the run under the target
        raise ValueError(f"target_epsilon={target_epsilon!r} is already spent: the history "
                         f"given ({sum(t for *_, t in spent_before)} steps) alone has "
                         f"epsilon={spent:.4g} at delta={target_delta:g} ({accountant}). "
                         f"Raise target_epsilon to the whole run's budget, or start a new run")
    if q == 0 or steps == 0:  # nothing is released about anyone: no noise needed
        return Calibration(0.0, spent, target_epsilon, 0)
    calls = []

    def eps(sigma):
        calls.append(sigma)
        try:
            return history_epsilon(spent_before + [(sigma, q, steps)], target_delta,
                                   accountant, **options)
        except ValueError as e:  # the accountant refused a σ on the way: say which search
            raise ValueError(f"noise calibration for target_epsilon={target_epsilon!r} with "
                             f"accountant={accountant!r} stopped at noise_multiplier="
                             f"{sigma:.4g}: {e}") from e

    start = _initial_sigma(target_epsilon, target_delta, q, steps)
    for looser in (n for n in spec.never_above if n in ACCOUNTANTS):
        try:  # ε here <= ε there at every σ: that σ meets the target here too, an upper end
            start = get_noise_multiplier(target_epsilon, target_delta, q, steps=steps,
                                         accountant=looser, epsilon_tolerance=tau, rtol=rtol,
                                         history=spent_before or None)
            break
        except ValueError:
            pass
    sigma, e = _solve(eps, target_epsilon, tau, rtol, start)
    return Calibration(sigma, e, target_epsilon, len(calls))


def _bracket(eps, target, sigma, tau):
    """(σ_lo, ε_lo, σ_hi, ε_hi) with ε_lo > target >= ε_hi, stepping from σ by factors
    1.25, 1.25², 1.25⁴, ... (small steps first: the starting guess is usually close). Returns
    early, with σ_lo = None, when an ε already lies in the band (1)."""
    e, factor = eps(sigma), 1.25
    if e <= target:  # too much noise: shrink σ until ε exceeds the target
        hi, e_hi = sigma, e
        while tau is None or e_hi < (1 - tau) * target:
            lo = hi / factor
            try:
                e_lo, factor = eps(lo), factor**2
            except ValueError:  # the accountant cannot compute so little noise (a PLD grid
                return None, None, hi, e_hi  # limit) while ε is still below the target: the
                # least noise it certifies (ε = 0 for q T <= δ, at any σ)
            if e_lo > target:
                return lo, e_lo, hi, e_hi
            hi, e_hi = lo, e_lo
        return None, None, hi, e_hi
    lo, e_lo = sigma, e
    while True:  # too little noise: grow σ until ε is within the target
        hi = lo * factor
        if hi > SIGMA_MAX:
            raise ValueError(
                f"target_epsilon={target} is unreachable: even noise_multiplier={SIGMA_MAX:g} "
                f"gives epsilon={eps(SIGMA_MAX):.4g}. Every accountant has a floor: with RDP "
                f"set by delta and the largest order (pass orders with larger values), with "
                f"PRV its eps_error (pass a smaller one), with PLD its grid; or raise "
                f"target_epsilon or target_delta."
            )
        e_hi, factor = eps(hi), factor**2
        if e_hi <= target:
            return lo, e_lo, hi, e_hi
        lo, e_lo = hi, e_hi


def _solve(eps, target, tau, rtol, sigma0):
    """(σ_hi, ε(σ_hi)) of a bracket meeting the stop: Eq. (1) in ε (``rtol`` None), else
    σ_hi <= (1 + rtol) σ_lo.

    Illinois regula falsi in x = 1/σ aiming at the middle of the band (at the target minus
    τ/2 of it; with ``rtol``, rtol/3 past the root); every third probe bisects (in log σ),
    which bounds the number of evaluations even where ε(x) is far from linear.
    """
    band = None if rtol is not None else tau
    lo, e_lo, hi, e_hi = _bracket(eps, target, sigma0, band)
    if lo is None:
        return hi, e_hi
    x_lo, x_hi = 1 / lo, 1 / hi  # x_lo > x_hi; ε grows with x
    aim = 0.0 if rtol is not None else -tau * target / 2  # f = ε - target aimed at
    f_lo, f_hi = e_lo - target - aim, e_hi - target - aim
    side = 0
    for it in range(_MAX_EVALS):
        if rtol is not None and x_lo <= x_hi * (1 + rtol):
            return 1 / x_hi, e_hi
        if rtol is None and (e_hi >= (1 - tau) * target or x_lo <= x_hi * (1 + 1e-10)):
            return 1 / x_hi, e_hi  # in the band, or ε jumps over it (a step in σ)
        if it % 3 == 2 or math.isinf(f_lo):
            x = math.sqrt(x_lo * x_hi)  # bisect (log scale)
        else:
            x = x_hi - f_hi * (x_lo - x_hi) / (f_lo - f_hi)  # the secant's root
            if rtol is not None:
                x *= (1 + rtol / 3) if side >= 0 else 1 / (1 + rtol / 3)  # aim past the root
            x = min(max(x, x_hi * (1 + 1e-12)), x_lo / (1 + 1e-12))  # stay inside
        e = eps(1 / x)
        f = e - target - aim
        if e > target:
            x_lo, f_lo, e_lo = x, f, e
            if side == -1:
                f_hi /= 2  # Illinois: halve the stale end's weight
            side = -1
        else:
            x_hi, f_hi, e_hi = x, f, e
            if side == 1:
                f_lo /= 2
            side = 1
    raise ValueError(  # a "please report this case" RuntimeError until 2026-11-29 (PLD at
        # target_epsilon = 1e-12: ε(σ) falls from above the target to 0 inside the bracket)
        f"noise calibration found no noise_multiplier with epsilon in [{1 - (tau or 0):g} x "
        f"target, target] = [{(1 - (tau or 0)) * target:.4g}, {target:.4g}] in "
        f"{_MAX_EVALS} evaluations: epsilon falls from {e_lo:.4g} at noise_multiplier="
        f"{1 / x_lo:.6g} to {e_hi:.4g} at {1 / x_hi:.6g} (the accountant's resolution at so "
        f"small a target). noise_multiplier={1 / x_hi:.6g} meets the target with room to "
        f"spare; pass a larger epsilon_tolerance, rtol=..., or accountant='rdp'")


__all__ = [
    "MAX_TARGET_EPSILON", "SIGMA_MAX", "Calibration", "calibrate", "get_noise_multiplier",
    "steps_from_epochs", "steps_per_epoch",
]
