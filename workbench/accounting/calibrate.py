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
bracket shrinks to σ_hi (1 ± 1e-10) and σ_hi is returned, still never above the target: the
least σ that meets it. At q T <= δ (nothing spent before) the total variation is below δ and ε
is 0 at every σ: no σ is in the band, and the least σ the accountant computes is returned, with
its ε = 0 (``Calibration.epsilon``).

Every other answer below the band is an error (``CalibrationError``, one check: ``_enforce``).
Until 2026-12-02 a run whose ε stayed below the band down to the least noise the accountant
could compute (PRV and PLD refuse a loss too wide for their grids) returned that σ: PRV gave
σ = 0.148 with ε = 151.5 for a target of 999 (q = 0.01, T = 100), PLD σ = 0.0805 with ε = 556.7;
plausible numbers, far more noise than the target needs. Now the error names the accountant,
the ε it reaches and the fix (another accountant, a coarser grid, or a target it reaches).

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
from workbench.errors import CalibrationError

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
            raise CalibrationError(f"noise calibration for target_epsilon={target_epsilon!r} "
                                   f"with accountant={accountant!r} stopped at "
                                   f"noise_multiplier={sigma:.4g}: {e}") from e

    start = _initial_sigma(target_epsilon, target_delta, q, steps)
    for looser in (n for n in spec.never_above if n in ACCOUNTANTS):
        try:  # ε here <= ε there at every σ: that σ meets the target here too, an upper end
            start = get_noise_multiplier(target_epsilon, target_delta, q, steps=steps,
                                         accountant=looser, epsilon_tolerance=tau, rtol=rtol,
                                         history=spent_before or None)
            break
        except ValueError:
            pass
    # P(a record is ever drawn) <= δ, nothing spent before: ε = 0 at every σ, no σ in the band
    nothing_drawn = spent == 0 and q < 1 and -math.expm1(steps * math.log1p(-q)) <= target_delta
    sigma, e, sigma_lo, refusal = _solve(eps, target_epsilon, tau, rtol, start, nothing_drawn)
    _enforce(sigma, e, sigma_lo, refusal, target_epsilon, tau, rtol, accountant, nothing_drawn)
    return Calibration(sigma, e, target_epsilon, len(calls))


def _enforce(sigma, e, sigma_lo, refusal, target, tau, rtol, accountant, nothing_drawn):
    """The contract, checked once on what the search found: ε(σ) <= target and either
    (1 - τ) target <= ε(σ) (the band, Eq. (1)), or σ within 1 + rtol (1 + 1e-10 where ε jumps
    over the band) of a σ_lo whose ε is above the target (the least σ), or ε = 0 at every σ
    (q T <= δ, nothing spent before). Anything else raises ``CalibrationError``."""
    if not e <= target:  # the search only returns ends at or below the target
        raise CalibrationError(
            f"noise calibration for target_epsilon={target!r} with accountant={accountant!r} "
            f"found noise_multiplier={sigma:.6g} with epsilon={e!r} above the target; please "
            f"report this case")
    if rtol is None and e >= (1 - tau) * target:
        return
    if sigma_lo is not None and sigma <= sigma_lo * (1 + (1e-10 if rtol is None else rtol)) \
            * (1 + 1e-12):
        return
    if e == 0 and nothing_drawn:
        return  # ε = 0 at every σ: no σ spends more
    stop = (f"within {tau:g} of it ([{(1 - tau) * target:.6g}, {target:.6g}])" if rtol is None
            else f"of the least noise_multiplier to rtol={rtol:g}")
    if refusal is None:
        why = "the search met no smaller noise_multiplier whose epsilon exceeds the target"
    else:
        at, err = refusal
        why = (f"at noise_multiplier={at:.4g} the accountant refused: "
               f"{str(err.__cause__ or err).rstrip('.')}")
    other = "" if accountant == "rdp" else "use accountant='rdp' (it computes any noise), "
    raise CalibrationError(
        f"noise calibration for target_epsilon={target!r} with accountant={accountant!r} "
        f"cannot return the noise that spends the target ({stop}): the least noise it "
        f"computed, noise_multiplier={sigma:.6g}, gives epsilon={e:.6g} ({100 * e / target:.3g}% "
        f"of the target: more noise than the target needs), and {why}. To calibrate, {other}"
        f"pass the accountant a coarser grid (a larger eps_error for PRV, discretization for "
        f"PLD), or a target_epsilon no larger than {e:.4g}, which it reaches")


def _bracket(eps, target, sigma, tau, gap):
    """(σ_lo, ε_lo, σ_hi, ε_hi, refusal) with ε_lo > target >= ε_hi, stepping from σ by
    factors 1.25, 1.25², 1.25⁴, ... (small steps first: the starting guess is usually close).
    Returns early, with σ_lo = None, when an ε already lies in the band (1), or when the
    accountant refuses less noise (``refusal``: that σ and its error) with ε below the band
    down to the least σ it computes (``_edge``): ``_enforce`` decides what that means."""
    e, factor = eps(sigma), 1.25
    if e <= target:  # too much noise: shrink σ until ε exceeds the target
        hi, e_hi = sigma, e
        while tau is None or e_hi < (1 - tau) * target:
            lo = hi / factor
            try:
                e_lo, factor = eps(lo), factor**2
            except ValueError as err:  # the accountant cannot compute so little noise (a
                return _edge(eps, target, tau, gap, lo, err, hi, e_hi)  # PLD or PRV grid
                # limit): until 2026-12-02 the σ it last computed was returned, its ε far
                # below the band (PRV: 151.5 for a target of 999)
            if e_lo > target:
                return lo, e_lo, hi, e_hi, None
            hi, e_hi = lo, e_lo
        return None, None, hi, e_hi, None
    lo, e_lo = sigma, e
    while True:  # too little noise: grow σ until ε is within the target
        hi = lo * factor
        if hi > SIGMA_MAX:
            raise CalibrationError(
                f"target_epsilon={target} is unreachable: even noise_multiplier={SIGMA_MAX:g} "
                f"gives epsilon={eps(SIGMA_MAX):.4g}. Every accountant has a floor: with RDP "
                f"set by delta and the largest order (pass orders with larger values), with "
                f"PRV its eps_error (pass a smaller one), with PLD its grid; or raise "
                f"target_epsilon or target_delta."
            )
        e_hi, factor = eps(hi), factor**2
        if e_hi <= target:
            return lo, e_lo, hi, e_hi, None
        lo, e_lo = hi, e_hi


def _edge(eps, target, tau, gap, refused, err, hi, e_hi):
    """``_bracket``'s answer where ε(σ_hi) is below the band and the accountant refused
    σ_r < σ_hi: the gap is bisected in log σ down to σ_hi <= (1 + gap) σ_r, stopping at an ε
    in the band or above the target (a bracket); else ε(σ_hi) is below the band at the least
    σ the accountant computes, to that precision, and the refusal is returned with it."""
    while hi > refused * (1 + gap):
        mid = math.sqrt(refused * hi)
        try:
            e = eps(mid)
        except ValueError as e2:
            refused, err = mid, e2
            continue
        if e > target:
            return mid, e, hi, e_hi, None
        hi, e_hi = mid, e
        if tau is not None and e >= (1 - tau) * target:
            return None, None, hi, e_hi, None
    return None, None, hi, e_hi, (refused, err)


def _solve(eps, target, tau, rtol, sigma0, nothing_drawn=False):
    """(σ_hi, ε(σ_hi), σ_lo, refusal) of a bracket meeting the stop: Eq. (1) in ε (``rtol``
    None), else σ_hi <= (1 + rtol) σ_lo; σ_lo None where no ε above the target was met
    (``_bracket``), and ``_enforce`` checks the answer.

    Illinois regula falsi in x = 1/σ aiming at the middle of the band (at the target minus
    τ/2 of it; with ``rtol``, rtol/3 past the root); every third probe bisects (in log σ),
    which bounds the number of evaluations even where ε(x) is far from linear.
    """
    band = None if rtol is not None else tau
    gap = (tau if rtol is None else rtol) / 4  # ε ~ 1/σ²: a σ gap of τ/4 moves ε by ~τ/2
    if nothing_drawn:
        gap = math.inf  # ε = 0 at every σ: no gap below a refusal to search
    lo, e_lo, hi, e_hi, refusal = _bracket(eps, target, sigma0, band, gap)
    if lo is None:
        return hi, e_hi, None, refusal
    x_lo, x_hi = 1 / lo, 1 / hi  # x_lo > x_hi; ε grows with x
    aim = 0.0 if rtol is not None else -tau * target / 2  # f = ε - target aimed at
    f_lo, f_hi = e_lo - target - aim, e_hi - target - aim
    side = 0
    for it in range(_MAX_EVALS):
        if rtol is not None and x_lo <= x_hi * (1 + rtol):
            return 1 / x_hi, e_hi, 1 / x_lo, None
        if rtol is None and (e_hi >= (1 - tau) * target or x_lo <= x_hi * (1 + 1e-10)):
            return 1 / x_hi, e_hi, 1 / x_lo, None  # in the band, or ε jumps over it (a step)
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
    raise CalibrationError(  # a "please report this case" RuntimeError until 2026-11-29 (PLD at
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
