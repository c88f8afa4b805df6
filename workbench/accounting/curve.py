"""ε of a DP-SGD run: one number, a curve over steps, or a heterogeneous schedule.

A run is a history of groups (σ, q, T): T steps with noise multiplier σ and sample rate q. An
accountant turns it into ε for a target δ, an upper bound on the true ε. The accountants are
looked up by name in ``registry.ACCOUNTANTS``; the built-in ones (``accountants/``) are:

- "rdp": Rényi DP adds up over steps (Mironov 2017, arXiv:1702.07476, Prop. 1),
  ε(α) = Σ_g T_g ε_g(α) (``rdp.py``), then the conversion of Balle et al. 2020 (``convert.py``).
  Fast (about a millisecond), and a curve over steps is almost free since RDP is linear in T.
- "pld": the privacy-loss distribution, composed by FFT (``pld.py``, ``compose.py``). Tighter,
  typically 5-15% smaller ε for DP-SGD settings, because RDP's conversion to (ε, δ) is lossy.
  Slower (tens to hundreds of milliseconds), and its grid step h sets the accuracy: the
  pessimistic discretisation stays an upper bound, and shrinking h tightens it. h is refined
  automatically when one step's loss is narrow (``pld.grid_step``).

This file validates the run and answers what every accountant would (no steps: ε = 0; no
noise: ε = inf); the accountant's own function sees only groups with σ, q, T > 0. Options
(RDP's ``orders``, PLD's ``discretization``, ``max_refine``, ``max_grid_points``) go to the
accountant whose function names them; one that no registered accountant names is an error.

Notation: q sample rate, σ noise multiplier, T steps, δ target delta, h PLD grid step.
"""

import numpy as np

from workbench.accounting import registry
from workbench.accounting.noise_range import accounted_history, accounted_sigma
from workbench.checks import check_delta, check_noise_multiplier, check_sample_rate, check_steps


def check_history(history):
    """[(σ, q, T), ...] validated, as a list of (float, float, int) tuples."""
    shape = ("history must be a list of (noise_multiplier, sample_rate, steps) triples, one per "
             "group of steps (as in an accountant's state_dict()['history'])")
    if isinstance(history, (str, bytes, dict)) or not hasattr(history, "__iter__"):
        raise TypeError(f"{shape}; got {type(history).__name__} {history!r:.80}")
    out = []
    for i, group in enumerate(history):
        if isinstance(group, (str, bytes, dict)) or not hasattr(group, "__len__") \
                or len(group) != 3:
            raise ValueError(f"{shape}; group {i} is {group!r:.80}")
        s, q, t = group
        out.append((check_noise_multiplier(s, f"history[{i}] noise_multiplier"),
                    check_sample_rate(q, f"history[{i}] sample_rate"),
                    check_steps(t, f"history[{i}] steps")))
    return out


def _options(spec, fn, options, caller):
    """The options ``fn`` of ``spec`` names; an option no registered accountant names raises."""
    known = set()
    for other in registry.ACCOUNTANTS.values():
        for f in (other.epsilon, other.curve):
            if f is not None:
                known |= set(other.options_for(f, options))
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{caller}() got option(s) {unknown} that no registered accountant "
                        f"takes (accountants: {sorted(registry.ACCOUNTANTS)})")
    return spec.options_for(fn, options)


def history_epsilon(history, delta, accountant="rdp", **options):
    """ε(δ) after the groups [(σ, q, T), ...] of ``history``, with the chosen accountant.

    ``options`` go to the accountant that takes them: RDP's ``orders``; PLD's
    ``discretization`` (grid step h) and ``max_refine`` (how much finer a step may be used
    when one step's loss is narrow, see ``pld.grid_step``; 1 keeps h).
    """
    history = accounted_history(check_history(history))  # σ in the computable range
    delta = check_delta(delta)
    spec = registry.get_accountant(accountant)
    opts = _options(spec, spec.epsilon, options, "history_epsilon")
    live = [(s, q, t) for s, q, t in history if q > 0 and t > 0]
    if not live:
        return 0.0
    if any(s == 0 for s, _, _ in live):
        return float("inf")
    return float(spec.epsilon(live, delta, **opts))


def epsilon(sample_rate, noise_multiplier, steps, delta, accountant="rdp", **options):
    """ε(δ) after ``steps`` steps of DP-SGD with sample rate q and noise multiplier σ.

    >>> round(epsilon(256 / 60_000, 1.1, 60 * 235, 1e-5), 3)  # MNIST, 60 epochs, batch 256
    2.6
    >>> round(epsilon(256 / 60_000, 1.1, 60 * 235, 1e-5, accountant="pld"), 3)
    2.385
    """
    return history_epsilon([(noise_multiplier, sample_rate, steps)], delta, accountant,
                           **options)


def epsilon_curve(sample_rate, noise_multiplier, steps, delta, accountant="rdp", **options):
    """ε(δ) after each number of steps in ``steps`` (array-like of ints): an array, same length.

    RDP computes ε(α) once and scales it by T; PLD shares one forward FFT between the points
    (its ``max_grid_points`` caps one step's grid when it is refined, ``pld.grid_step``). An
    accountant registered without a curve function is called once per point.

    >>> epsilon_curve(0.01, 1.0, [0, 100, 1000], 1e-5).round(3)
    array([0.   , 1.214, 2.101])
    """
    q = check_sample_rate(sample_rate)
    sigma = accounted_sigma(check_noise_multiplier(noise_multiplier))  # noise_range.py
    counts = [check_steps(t) for t in np.atleast_1d(steps)]
    delta = check_delta(delta)
    spec = registry.get_accountant(accountant)
    out = np.zeros(len(counts))
    live = [i for i, t in enumerate(counts) if t > 0 and q > 0]
    if not live or sigma == 0:
        _options(spec, spec.curve or spec.epsilon, options, "epsilon_curve")
        out[live] = np.inf
        return out
    live_counts = [counts[i] for i in live]
    if spec.curve is not None:
        opts = _options(spec, spec.curve, options, "epsilon_curve")
        out[live] = spec.curve(q, sigma, live_counts, delta, **opts)
    else:
        opts = _options(spec, spec.epsilon, options, "epsilon_curve")
        out[live] = [spec.epsilon([(sigma, q, t)], delta, **opts) for t in live_counts]
    return out


__all__ = ["check_history", "epsilon", "epsilon_curve", "history_epsilon"]
