"""Black-box audit of one DP-SGD step: is it really (Σ_i clip_C(g_i) + N(0, σ²C² I)) / B?

Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1 privatises a batch of per-sample gradients:

    c_i = min(1, C / ||g_i||)                       per-sample clipping
    step(G) = (Σ_i c_i g_i + N(0, σ² C² I)) / B      B: expected (public) batch size

so  E[step(G)] = μ(G) = Σ_i c_i g_i / B  exactly, and  step(G) - μ(G) ~ N(0, (σC/B)² I),
fresh at every call. ``audit_dp_step`` feeds designed batches (a huge sample, a tiny one, a
zero one, a one-coordinate outlier, aligned moderate ones; the same minus the huge sample;
a small batch n = 2; samples on one coordinate with norms from C/2 to 8C, straddling C; an
outlier of norm 30C on every coordinate in turn; copies of one dense record of norm 100C; the
designed batch plus a record holding a NaN; an empty batch, n = 0, which Poisson sampling
draws and whose step must still be noise) ``trials`` times each, and batches of every size
from 1 to 9 and each side of the powers of two to 1024 with records of norms 10^-8 C to 10^8 C
(``sweep_batches``) a few times each, and tests those two equations with scipy.stats.

The mean checks combine two tests (Bonferroni, each at half the row's level): the largest |t|
over coordinates (a sparse error: one coordinate, one outlier) and the F test of all of them,
T Σ_j (ȳ_j - μ_j)² / (d ŝ²) ~ F(d, d(T-1)) with ŝ² the pooled per-coordinate variance (a dense
error spread thinly over every coordinate: clipping each layer separately). The noise checks
(variance overall, per batch and per coordinate; Gaussian shape; fresh at any lag) are in
``mechanism_noise``. A record with a NaN may make the step raise or return NaN (loud); a finite
output must not move by more than C/B (the "sensitivity" row), as a record given full weight
because its norm is NaN would.

Significance: the audit's false-alarm probability is at most ``alpha`` at every allowed
``trials`` (>= 20): Bonferroni, alpha/10 per row and split inside each row; each test's null
distribution is exact for Gaussian noise (t(T-1), F and χ² for means and variances, Beta for
the cosine of two noise vectors, Kolmogorov-Smirnov on Helmert-decorrelated residuals for the
shape, F for the sums of consecutive calls), except the lag-1 check's normal approximation
to a correlation over batches·d·(T-1) pairs, and the shape tests' use of the measured scale
(its relative error ~1/sqrt(2·batches·d·T), which the stated cut absorbs). Power at the
defaults (trials=400, d=64, σ=1): a mean error of ~7 σC/(B√T) per coordinate (0.044 C for
B=8), clipping to k·C for k >= ~1.03, a relative error in the noise std of ~2%, a lag-1 noise
correlation of ~0.03, a noise vector repeated at any lag, noise cut (clamped or truncated) at
~4.0σC with certainty, noise centred over epochs of up to the 7·trials designed calls.

Resolution (``mechanism_power``): a run that finds nothing says "passed" only if it would
have seen a 10% error in the noise std and a clip norm of 1.1 C (power 0.8); otherwise its
verdict is "inconclusive" and its summary says how many trials would resolve them. Either way
the summary states what the run cannot see (``MechanismAudit.limits``): the noise cut beyond
which a clamp or truncation goes unseen, and the variance band of sums of calls. The
clip-boundary and dense rows come in ceil(σ) copies, which keeps the clip resolution at any σ
up to ``MAX_REPEATS``; beyond it only more trials resolve 1.1 C.

Notation: n batch size, d coordinates, g_i row i of G, C max_grad_norm, σ noise multiplier,
B expected batch size, T trials, s = σC/B the claimed noise std of the output.
"""

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy import stats

from workbench.audit.mechanism_design import (
    ALONE,
    DENSE,
    OUTLIERS,
    boundary_norms,
    design_batches,
    expected_step,
    nan_record_batch,
    sweep_batches,
)
from workbench.audit.mechanism_noise import (
    ATOM_Z,
    _chi2_p,
    atoms_p,
    cells,
    coarsest,
    fresh_p,
    helmert,
    support_p,
    tails_p,
    variance_p,
)
from workbench.audit.mechanism_power import (
    TARGETS,
    resolution,
    resolved,
    shape_resolution,
    sums_resolution,
    support_cut,
    trials_needed,
)
from workbench.audit.result import AuditResult
from workbench.checks import (
    check_count,
    check_max_grad_norm,
    check_noise_multiplier,
    check_positive,
    check_probability,
)
from workbench.errors import NonFiniteStepError
from workbench.per_sample.precision import unit_roundoff, value_dtype, widest
from workbench.viz.audit import plot_noise_histogram

EMPTY = "empty batch (n=0)"
SWEEP = "sizes and scales"
SWEEP_TRIALS = 8
"""Calls per batch of ``sweep_batches``: its errors are gross (an unclipped 10^8 C record), and
its 33 batches of up to 1025 rows would cost the run more than all the others at ``trials``."""
_CHECKS = {
    "mean · designed batch": "E[step(G)] = Σ clip_C(g_i)/B with huge, tiny, zero, outlier and "
    "aligned samples, a 30C outlier on every coordinate and copies of a dense 100C record; "
    "catches inverted, per-batch, per-coordinate and per-layer clipping (any split), a norm "
    "that leaves out a parameter, wrong scale",
    "mean · clip boundary": "same for samples on one coordinate with norms from C/2 to 8C "
    "(straddling C); catches clipping to k·C for k >= ~1.03 (T=400, σ=1) and clipping only "
    "norms above k·C",
    "mean · neighbour (huge removed)": "same for n = B - 1; catches dividing by the realised n",
    "mean · small batch (n=2)": "same for n = 2, and for one record of norm 5C alone (n = 1); "
    "catches dividing by n instead of B, and a fast path that leaves a lone record unclipped",
    SWEEP: "the mean as above and the noise variance (χ² of the residuals, two-sided), in "
    "SWEEP_TRIALS calls each, for every n from 1 to 9 and each side of the powers of two to "
    "1024, records of norms 1e-8 C to 1e8 C at every position: catches a clip that runs on "
    "a first physical batch only, skips some batch sizes or floors the clip factor (a floor "
    "of 1e-4 shows at 1e8 C), and noise that shrinks with the batch (σC/k on each of k "
    "accumulated chunks)",
    "sensitivity": "||E[step(A)] - E[step(A')]|| <= C/B for neighbours A, A' (one-sided): the "
    "huge sample removed, and a record holding a NaN added (raising or returning NaN is "
    "accepted as loud); cannot see sensitivity excess below the noise floor s·sqrt(2χ²_d/T)",
    "noise variance": "Σ(r - r̄)²/s² ~ χ² overall, per batch and per coordinate, the "
    "extreme singular values of the decorrelated residuals (every direction), and each "
    "call's ||y - μ||²/s² ~ χ²(d) (lower tail): noise std is σC/B everywhere (two-sided); "
    "catches noise missing from or doubled on some parameters, or missing in a direction "
    "across them (two coordinates given the same noise), or skipped on some calls",
    "noise is Gaussian": "at the measured noise scale (a scale error is the variance row's): "
    "Kolmogorov-Smirnov of the Helmert-decorrelated residuals against N(0, 1) (exact null), "
    "the share of |y - μ| beyond 3, 3.5 and 4 scales (exact binomial each), the largest "
    "|y - μ| (a support cut: P(max <= t) = (1 - 2Φ(-t))^N, exact) and values piled in one "
    "rounding cell of the output's grid (a clamp's atom at its bound): catches noise clamped "
    "or truncated at or below the cut this run states, heavy or light tails; cannot see a "
    "cut beyond it, nor non-Gaussian noise whose CDF is within ~2/sqrt(batches·d·T) of the "
    "normal's",
    EMPTY: "an empty Poisson batch (n = 0) still steps: E[step] = 0 and Σ y²/s² ~ χ²(T·d), "
    "noise alone of the claimed std; catches a step that returns exact zeros or skips the "
    "noise when no record was drawn, or raises there (a loop would skip the step: whether "
    "a batch is empty depends on the records, so either tells)",
    "noise is fresh": "lag-1 correlation of consecutive calls' noise = 0, no two calls' "
    "noise vectors alike (cosine, exact Beta null) or equal, and the noise of L consecutive "
    "calls summing to variance L s² (F test of windows of L = 2, 4, ... and all calls): "
    "catches reuse at any lag, noise that cancels over an epoch (centred per epoch, "
    "antithetic) or accumulates (an earlier call's noise mixed in); cannot see noise that is "
    "merely predictable, nor sums whose variance is within the band this run states",
}


@dataclass
class MechanismAudit(AuditResult):
    """One row per check in ``table``; ``standardised_noise`` is (step - mean) / s, pooled.

    ``verdict``: "failed" (a check failed), "inconclusive" (none failed, but the run cannot
    resolve a 10% error in the noise std or the clip norm: ``resolution``, ``mechanism_power``)
    or "passed"; ``passed`` is ``verdict == "passed"``. ``trials_needed``: the trials that
    would resolve both (None when resolved or out of reach). ``limits``: what the run cannot
    see however it ends (``mechanism_power`` Eqs. (3)-(4): the noise cut, in units of σC, below
    which a clamped or truncated noise is caught, and the variance band of sums of calls it
    cannot tell from the claim); the summary states them, so "passed" never claims more.
    ``noise_scale``: the measured noise std over the claimed one when the pooled variance
    rejects the claim's (a scale mismatch), else None. ``dtype``: the precision the step's
    outputs hold (``per_sample/precision.value_dtype``).
    """

    passed: bool
    table: pd.DataFrame
    standardised_noise: np.ndarray = field(repr=False)
    alpha: float = 1e-3
    trials: int = 400
    verdict: str = ""
    resolution: dict = field(default_factory=dict)
    trials_needed: int | None = None
    limits: dict = field(default_factory=dict)
    noise_scale: float | None = None
    dtype: str = "float64"

    def __post_init__(self):
        if not self.verdict:  # built by hand: the table decides
            self.verdict = "passed" if self.passed else "failed"

    @property
    def summary(self) -> str:
        head = f"(alpha={self.alpha:g}, trials={self.trials})"
        if self.verdict == "inconclusive":
            res = ", ".join(f"{k} to {v:.1%}" for k, v in self.resolution.items())
            more = (f"rerun with trials >= {self.trials_needed}" if self.trials_needed
                    else "raise trials")
            return (f"DP step audit inconclusive at this sample size {head}: no check failed, "
                    f"but it resolves only the {res} (needs {TARGETS_TEXT}); {more}"
                    + (f"; {self.limits_text}" if self.limits else ""))
        failed = ", ".join(self.table["check"][~self.table["passed"]])
        text = (f"DP step audit {'passed' if self.passed else 'FAILED'} {head}"
                + (f": fails {failed}" if failed else ""))
        if self.noise_scale is not None:
            text += f"; {self.scale_text}"
        return text + (f"; {self.limits_text}" if self.passed and self.limits else "")

    @property
    def scale_text(self) -> str:
        """The scale mismatch in words ("" when none): a larger noise is safer, not the claim."""
        if self.noise_scale is None:
            return ""
        k = self.noise_scale
        return (f"noise std {k:.3g}x the claimed σC/B (a scale mismatch; its shape is tested at "
                f"the measured scale): " + (
                    "more noise than claimed, safer (its ε is below the claimed one) but not "
                    "the claimed step" if k > 1 else
                    "less noise than claimed: the claimed ε understates the real one"))

    @property
    def limits_text(self) -> str:
        """What the run cannot see, in words (``limits``)."""
        lim, parts = self.limits, []
        if not lim:  # σ = 0: every check exact
            return ""
        if self.resolution:
            parts.append("noise std or clip norm off by less than "
                         + " / ".join(f"{v:.1%}" for v in self.resolution.values()))
        if "noise cut" in lim:
            parts.append(f"noise cut (clamped or truncated) beyond {lim['noise cut']:.2f}σC "
                         f"(a clamp: beyond {lim['clamp']:.2f}σC, power 0.8)")
        if "sums" in lim:
            L, lo, hi = lim["sums"]
            parts.append(f"noise of sums of {L} consecutive calls with a variance within "
                         f"{lo:.2g}-{hi:.2g}x the claim's ({lim['sums band']})")
        return "it cannot see " + ", ".join(parts)

    def plot(self, ax, bins: int = 60):
        """``workbench.viz.audit.plot_noise_histogram``: noise against N(0, 1); artists."""
        return plot_noise_histogram(ax, self, bins)


TARGETS_TEXT = ", ".join(f"{k} within {v:.0%}" for k, v in TARGETS.items())
_ROW_OF = {OUTLIERS: "mean · designed batch", DENSE: "mean · designed batch",  # reported there
           ALONE: "mean · small batch (n=2)"}
MAX_REPEATS = 64  # copies of the clip-boundary and dense rows at most (2048 rows each)
MAX_DIM = 2048  # the outlier-per-coordinate batch is (dim, dim): 32 MiB at this size


def _run(step_fn, G, trials, dim):
    out = []
    for _ in range(trials):
        y = step_fn(G.clone())
        if not isinstance(y, torch.Tensor):  # a NumPy array or a list: a bare AttributeError
            raise TypeError(f"step_fn must return a torch.Tensor of shape ({dim},) for G of "
                            f"shape {tuple(G.shape)}; got {type(y).__name__} (wrap it: "
                            f"torch.as_tensor(...))")
        if tuple(y.shape) != (dim,):
            raise ValueError(f"step_fn must return a Tensor of shape ({dim},) for G of shape "
                             f"{tuple(G.shape)}; got {tuple(y.shape)}")
        if not bool(torch.isfinite(y).all()):  # a raw LinAlgError from a statistic until
            # 2026-11-30 (the empty batch's row reports it: its step raised)
            raise NonFiniteStepError(
                f"step_fn returned {int((~torch.isfinite(y)).sum())} non-finite value(s) "
                f"(NaN or inf) of {dim} for G of shape {tuple(G.shape)} with finite entries; "
                f"a DP step must return a finite update (check a division by the batch's "
                f"size on an empty batch, by a zero row's norm, and its optimizer's state)")
        out.append(y.detach().to("cpu", torch.float64))
    return torch.stack(out).numpy()  # (T, dim)


def _row(name, statistic, p_value, threshold, passed):
    return {"check": name, "statistic": float(statistic), "p_value": float(p_value),
            "threshold": float(threshold), "passed": bool(passed), "meaning": _CHECKS[name]}


def _mean_p(Y, mu, s, tol):
    """(max |t|, p) for E[Y] = mu: max-|t| over coordinates and the F test, Bonferroni."""
    T, dim = Y.shape
    diff = Y.mean(0) - mu  # (dim,)
    var = Y.var(0, ddof=1)  # (dim,)
    z = np.abs(diff) / np.sqrt(var / T + tol ** 2)  # |t|, t ~ t(T-1) under the claim
    p = min(1.0, 2 * stats.t.sf(z.max(), T - 1) * dim)  # Bonferroni over coordinates
    if s > 0 and var.mean() > 0:  # F(d, d(T-1)): every coordinate at once
        f = T * (diff ** 2).sum() / (dim * var.mean())
        p = min(1.0, 2 * min(p, stats.f.sf(f, dim, dim * (T - 1))))
    return float(z.max()), p


def _sweep_p(Y, mu, s, tol):
    """(statistic, p) for one batch of ``sweep_batches``: its mean (``_mean_p``) and, around
    its own mean, its noise variance Σ(y - ȳ)²/s² ~ χ²((T-1) d) (two-sided; exact zero at
    s = 0); Bonferroni over the two."""
    z, p = _mean_p(Y, mu, s, tol)
    T, dim = Y.shape
    R = Y - Y.mean(0)
    if s > 0:
        x, dof = float((R ** 2).sum()) / s ** 2, (T - 1) * dim
        p_var = min(1.0, 2 * min(stats.chi2.cdf(x, dof), stats.chi2.sf(x, dof)))
    else:
        p_var = 1.0 if np.abs(R).max() <= tol else 0.0
    return z, min(1.0, 2 * min(p, p_var))


def audit_dp_step(step_fn, dim: int, batch_size: float, max_grad_norm: float,
                  noise_multiplier: float, trials: int = 400, alpha: float = 1e-3,
                  generator: torch.Generator | None = None, twin=None) -> MechanismAudit:
    """Test ``step_fn(G) == (Σ_i clip_C(g_i) + N(0, σ²C² I)) / batch_size`` in distribution.

    Runs ``step_fn`` 8·trials times on designed batches (``design_batches``,
    ``nan_record_batch`` and an empty one; G is float64) and ``SWEEP_TRIALS`` times on each
    of ``sweep_batches``. p-values are compared with alpha/10 (one share per row of the
    table), each row's parts
    sharing it; 'sensitivity' reports a bound instead (p_value NaN). With noise_multiplier = 0
    the mean checks become exact (tolerance 1e-6·C/B per row summed, for float32 steps) and
    the noise checks require zero noise. The step's own randomness is its own; ``generator``
    only designs G.

    ``twin``: the same step built apart with another generator (``factory(C, σ, B, g2)``), or
    None. Its first calls' noise joins the repeat check ("noise is fresh"): a step that seeds
    its own generator when it is built (ignoring the one it is given) releases the same noise
    in every run, known to anyone who has the code, and passes every test of one run alone.
    The verdict is "inconclusive" when no check fails but the run is too small to resolve a
    10% error in the noise std or the clip norm (``mechanism_power``).
    """
    C, B = check_max_grad_norm(max_grad_norm), check_positive(batch_size, "batch_size")
    sigma = check_noise_multiplier(noise_multiplier)
    T = check_count(trials, "trials", 20, note="for the tests' normal approximations")
    alpha = check_probability(alpha, "alpha", note="the audit's false-alarm probability")
    dim = check_count(dim, "dim", 2, MAX_DIM, note="one outlier coordinate, one aligned; "
                      "the coordinates stand for parameters: 32 to 64 catch every zoo's bug")
    a = alpha / len(_CHECKS)  # one row per check; alpha split evenly (Bonferroni)
    s, tol = sigma * C / B, 1e-6 * C / B
    # σ copies keep the clip resolution (2) of mechanism_power; beyond MAX_REPEATS it is the
    # trials' job (the verdict then says how many)
    repeats = min(MAX_REPEATS, max(1, math.ceil(sigma)))
    batches = design_batches(dim, B, C, generator, repeats)
    T_sweep = min(T, SWEEP_TRIALS)
    runs = {name: (G, _run(step_fn, G, T, dim)) for name, G in batches.items()}  # call order
    sweeps = {name: (G, _run(step_fn, G, T_sweep, dim))
              for name, G in sweep_batches(dim, C, generator).items()}
    dtype = widest(value_dtype(torch.from_numpy(Y)) for _, Y in [*runs.values(),
                                                                   *sweeps.values()])
    rel = 2 * unit_roundoff(dtype) if s == 0 else 0.0  # σ = 0: exact up to the output's
    # rounding and one operation's (a bfloat16 step failed every mean row until 2026-12-01)
    parts, resid, noise, ybars, shape = {}, [], [], {}, []
    for name, (G, Y) in runs.items():
        mu = expected_step(G, C, B).numpy()
        parts.setdefault(_ROW_OF.get(name, name), []).append(  # the tolerance per row summed:
            _mean_p(Y, mu, s, tol * max(1, G.shape[0]) + rel * np.abs(mu).max(initial=0.0)))
        # Opacus' C / (norm + 1e-6) over ~20 rows at the clip boundary was a failure at σ = 0
        # until 2026-11-30
        resid.append(Y - Y.mean(0))
        noise.append(Y - mu)
        shape.append((Y - mu, Y))
        ybars[name] = Y.mean(0)
    calls = np.concatenate(noise)  # (batches·T, dim): consecutive calls, in the step's order
    for name, (G, Y) in sweeps.items():
        mu = expected_step(G, C, B).numpy()
        parts.setdefault(SWEEP, []).append(_sweep_p(  # its noise is not pooled: the noise
            Y, mu, s, tol * G.shape[0] + rel * np.abs(mu).max(initial=0.0)))  # rows keep the
        shape.append((Y - mu, Y))  # designed batches' sizes; the shape tests see every value
    if twin is not None:  # built apart: its noise must not be step_fn's again
        G = batches["mean · designed batch"]
        Y = _run(twin, G, T_sweep, dim)
        noise.append(Y - expected_step(G, C, B).numpy())
        shape.append((noise[-1], Y))
    rows = []
    for name, ps in parts.items():  # a row over several batches: Bonferroni over them
        p = min(1.0, len(ps) * min(p for _, p in ps))
        rows.append(_row(name, max(z for z, _ in ps), p, a, p >= a))
    top = rel * max(np.abs(ybars[k]).max() for k in ybars)  # σ = 0: the rounding of a mean
    rows.append(_sensitivity_row(step_fn, batches, ybars, C, B, s, tol + top, T, a, resid))
    rows.append(_empty_row(step_fn, dim, s, tol, T, a, resid, shape))
    R = np.stack(resid)  # (batches, T, dim)
    values = [np.concatenate(v) for v in zip(*shape)]  # (y - μ, y) of every known μ
    noise_rows, info = _noise_rows(R, np.concatenate(noise), s, tol, T, a, calls, values,
                                   dtype)
    rows += noise_rows
    z = R.ravel() / (s if s > 0 else max(R.std(), tol))
    table = pd.DataFrame(rows)
    result = _verdict(table, z, alpha, T, dim, sigma, R.shape[0], repeats, a)
    result.limits, result.noise_scale = info.get("limits", {}), info.get("noise_scale")
    result.dtype = str(dtype).removeprefix("torch.")
    return result


def _sensitivity_row(step_fn, batches, ybars, C, B, s, tol, T, a, resid):
    """Neighbours move the mean by at most C/B: the huge sample removed; a NaN record added
    (raising, or a non-finite output, is accepted as loud). Finite outputs join the residual
    checks, not the repeat check (``noise``): a step may give the NaN record any weight up to
    C, so μ(G) of that batch is not known."""
    A, A2 = "mean · designed batch", "mean · neighbour (huge removed)"
    dim = ybars[A].size
    bound = C / B + s * np.sqrt(2 / T * stats.chi2.ppf(1 - a / 2, dim)) + 2 * tol
    moved = np.linalg.norm(ybars[A] - ybars[A2])
    G = nan_record_batch(batches[A], C)
    try:
        with warnings.catch_warnings():  # the step's warnings about the NaN we planted
            warnings.simplefilter("ignore")
            Y = _run(step_fn, G, T, dim)
    except Exception:  # noqa: BLE001  (the step refused the NaN record: loud, not a leak)
        Y = None
    if Y is not None and np.isfinite(Y).all():
        moved = max(moved, np.linalg.norm(Y.mean(0) - ybars[A]))
        resid.append(Y - Y.mean(0))
    return _row("sensitivity", moved, np.nan, bound, moved <= bound)


def _empty_row(step_fn, dim, s, tol, T, a, resid, shape):
    """The empty batch: mean 0 (``_mean_p``) and, the mean known, Σ y²/s² ~ χ²(T·d) over its
    calls (two-sided; Bonferroni with the mean). A step that raises fails the row, named.
    Its residuals join the noise checks, its noise (y - 0) the shape tests."""
    G = torch.zeros(0, dim, dtype=torch.float64)
    try:
        Y = _run(step_fn, G, T, dim)
    except Exception as err:  # noqa: BLE001  (reported in the row, not raised)
        row = _row(EMPTY, float("nan"), 0.0, a, False)
        row["meaning"] = f"the step raised {type(err).__name__} on G of shape (0, {dim}): " \
                         f"{str(err)[:200]}. " + row["meaning"]
        return row
    z, p = _mean_p(Y, np.zeros(dim), s, tol)
    if s > 0:
        x = float((Y ** 2).sum()) / s ** 2
        dof = T * dim
        p_var = min(1.0, 2 * min(stats.chi2.cdf(x, dof), stats.chi2.sf(x, dof)))
        p = min(1.0, 2 * min(p, p_var))
    resid.append(Y - Y.mean(0))
    shape.append((Y, Y))
    return _row(EMPTY, z, p, a, p >= a)


def _noise_rows(R: np.ndarray, noise: np.ndarray, s: float, tol: float, T: int, a: float,
                calls: np.ndarray, values: list, dtype) -> tuple:
    """(rows, limits): variance, shape and freshness of centred residuals R (batches, T, dim);
    ``noise``: y - μ of the designed batches' calls and the twin's, ``calls`` those of the
    step alone in call order (the sums), ``values``: [y - μ, y] of every call of known μ (the
    shape tests); ``dtype``: the precision the outputs hold (their grid: the rounding cells of
    the support and atom tests, ``cells`` of y, which y - μ keeps: μ is float64).
    ``limits``: what the run cannot see (``mechanism_power`` Eqs. (3)-(4))."""
    names = ("noise variance", "noise is Gaussian", "noise is fresh")
    if s == 0:  # the claim is "no noise": every residual must vanish
        ok = np.abs(R).max() <= tol
        return [_row(n, np.abs(R).max(), np.nan, tol, ok) for n in names], {}
    ratio, p_var = variance_p(R, s, T, noise)
    rows = [_row(names[0], ratio, p_var, a, p_var >= a)]
    if R.std() <= tol:  # identical outputs on every call: not noise at all
        return rows + [_row(n, 0.0, 0.0, a, False) for n in names[1:]], {}
    dof = R.shape[0] * R.shape[2] * (T - 1)
    s_hat = s * math.sqrt(ratio)  # the shape at the measured scale: a scale error is row 1's
    ks = stats.kstest((helmert(R) / s_hat).ravel(), "norm")  # iid N(0, 1) under the claim
    more, outputs = values
    grid = cells(outputs, dtype, s_hat)  # (values, dim) each output's grid cell / ŝ
    cell = None if dtype == torch.float64 else coarsest(  # the grid's cells at x, any μ
        dtype, s_hat, float(np.abs(outputs - more)[np.isfinite(more)].max(initial=0.0)))
    p_shape = min(1.0, 4 * ks.pvalue, 4 * tails_p(more, s_hat),  # the bulk, the tails,
                  4 * support_p(more, s_hat, grid),  # the reach (a cut support) and
                  4 * atoms_p(more, s_hat, cell))  # a pile at one point (a clamp's bound)
    rows.append(_row(names[1], ks.statistic, p_shape, a, p_shape >= a))
    r, p_fresh = fresh_p(R, noise, T, calls)
    rows.append(_row(names[2], r, p_fresh, a, p_fresh >= a))
    scale = math.sqrt(ratio) if 2 * _chi2_p(ratio * dof, dof) < a else None  # pooled, a/2
    return rows, {"limits": _limits(more / s_hat, grid, cell, calls, a, dof, s_hat / s, rows),
                  "noise_scale": scale}


def _limits(x, grid, cell, calls, a, dof, scale, rows):
    """``MechanismAudit.limits`` (``mechanism_power`` Eqs. (3)-(4)), each stated in the
    meaning of its row: the noise cut (units of the claimed σC; the tests measure in ŝ) and
    the sums' variance band at the longest sum. ``x``: the shape tests' values / ŝ."""
    ok = np.isfinite(x)
    tail = np.broadcast_to(grid, x.shape)[ok & (np.abs(x) > ATOM_Z)]
    half = float(tail.max(initial=0.0))  # the coarsest cell a tail value has (support_p)
    n = int(ok.sum())
    c = support_cut(n, a / 4, dof, half)
    res = shape_resolution(n, a / 4, dof, half, 0.0 if cell is None else float(cell(c)))
    lim = {"noise cut": res["noise cut"] * scale, "clamp": res["clamp"] * scale}
    bands = sums_resolution(calls.shape[0], calls.shape[1], a / 3)
    L = max(bands)
    lim["sums"] = (L, *bands[L])
    lim["sums band"] = f"{min(bands)} calls: {bands[min(bands)][0]:.2f}-" \
                       f"{bands[min(bands)][1]:.2f}x"
    rows[1]["meaning"] += (f". This run ({n} values): a cut at <= {lim['noise cut']:.2f}σC is "
                           f"caught whenever it occurs, a clamp at <= {lim['clamp']:.2f}σC with "
                           f"power 0.8; a cut beyond is not seen")
    (lo, hi), (lo2, hi2) = bands[L], bands[min(bands)]
    rows[2]["meaning"] += (f". This run: the sum of L calls with a variance off by x{lo:.2f} or "
                           f"x{hi:.2f} is caught at L = {L} (all), by x{lo2:.2f} or x{hi2:.2f} "
                           f"at L = {min(bands)}, power 0.8")
    return lim


def _verdict(table, z, alpha, T, dim, sigma, batches, repeats, a):
    """The MechanismAudit: failed, or passed only when the run resolves ``TARGETS``."""
    failed = not table.passed.all()
    res = resolution(T, dim, sigma, batches, boundary_norms(repeats).numpy(), a)
    verdict = "failed" if failed else "passed" if resolved(res) else "inconclusive"
    need = None if verdict != "inconclusive" else trials_needed(
        dim, sigma, batches, boundary_norms(repeats).numpy(), a)
    return MechanismAudit(verdict == "passed", table, z, alpha, T, verdict, res, need)


__all__ = ["DENSE", "EMPTY", "MAX_DIM", "MAX_REPEATS", "OUTLIERS", "MechanismAudit",
           "audit_dp_step", "boundary_norms", "design_batches", "expected_step", "helmert",
           "nan_record_batch"]
