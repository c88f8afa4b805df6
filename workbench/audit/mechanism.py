"""Black-box audit of one DP-SGD step: is it really (Σ_i clip_C(g_i) + N(0, σ²C² I)) / B?

Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1 privatises a batch of per-sample gradients:

    c_i = min(1, C / ||g_i||)                       per-sample clipping
    step(G) = (Σ_i c_i g_i + N(0, σ² C² I)) / B      B: expected (public) batch size

so  E[step(G)] = μ(G) = Σ_i c_i g_i / B  exactly, and  step(G) - μ(G) ~ N(0, (σC/B)² I),
fresh at every call. ``audit_dp_step`` feeds designed batches (a huge sample, a tiny one, a
zero one, a one-coordinate outlier, aligned moderate ones; the same minus the huge sample;
a small batch n = 2; 32 samples on one coordinate with norms from C/2 to 8C, straddling C)
``trials`` times each and tests those two equations with scipy.stats.

Significance: the audit's false-alarm probability is at most ``alpha`` at every allowed
``trials`` (>= 20): Bonferroni, alpha/8 per check and per coordinate inside the mean checks;
each test's null distribution is exact for Gaussian noise (t(T-1) for the mean checks, χ² for
the variance, Kolmogorov-Smirnov on Helmert-decorrelated residuals for the shape), except the
freshness check's normal approximation to a correlation over batches·d·(T-1) pairs. Measured
at T = 20: every check's p-value is below 0.05 in 4.7-5.2% of 3000 seeds. What each check can
and cannot see is in its ``meaning`` column and in ``_CHECKS`` below. Power at the defaults
(trials=400, d=64, σ=1): a mean error of ~7 σC/(B√T) per coordinate (0.044 C for B=8),
clipping to k·C for k >= ~1.03 (the clip-boundary batch sums 24 samples above C on one
coordinate), a relative error in the noise std of ~2%, a lag-1 noise correlation of ~0.03.

Notation: n batch size, d coordinates, g_i row i of G, C max_grad_norm, σ noise multiplier,
B expected batch size, T trials, s = σC/B the claimed noise std of the output.
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy import stats

from workbench.audit.result import AuditResult
from workbench.checks import (
    check_count,
    check_max_grad_norm,
    check_noise_multiplier,
    check_positive,
)
from workbench.viz.audit import plot_noise_histogram

_CHECKS = {
    "mean · designed batch": "E[step(G)] = Σ clip_C(g_i)/B with huge, tiny, zero, outlier and "
    "aligned samples; catches inverted, per-batch and per-coordinate clipping, wrong scale",
    "mean · clip boundary": "same for 32 samples on one coordinate with norms from C/2 to 8C "
    "(straddling C); catches clipping to k·C for k >= ~1.03 (T=400, σ=1) and clipping only "
    "norms above k·C",
    "mean · neighbour (huge removed)": "same for n = B - 1; catches dividing by the realised n",
    "mean · small batch (n=2)": "same for n = 2; catches dividing by n instead of B",
    "sensitivity": "||E[step(A)] - E[step(A')]|| <= C/B for neighbours A, A' (one-sided); "
    "cannot see sensitivity excess below the noise floor s·sqrt(2χ²_d/T)",
    "noise variance": "Σ(r - r̄)²/s² ~ χ²(dims·(T-1)): noise std is σC/B (two-sided)",
    "noise is Gaussian": "Kolmogorov-Smirnov of the Helmert-decorrelated residuals / s against "
    "N(0, 1) (exact null: iid N(0, 1) under the claim); cannot see non-Gaussian noise whose "
    "CDF is within ~2/sqrt(batches·d·T) of the normal's",
    "noise is fresh": "lag-1 correlation of consecutive calls' noise = 0; cannot see reuse "
    "at lags > 1 or noise that is merely predictable",
}


@dataclass
class MechanismAudit(AuditResult):
    """One row per check in ``table``; ``standardised_noise`` is (step - mean) / s, pooled."""

    passed: bool
    table: pd.DataFrame
    standardised_noise: np.ndarray = field(repr=False)
    alpha: float = 1e-3
    trials: int = 400

    @property
    def summary(self) -> str:
        failed = ", ".join(self.table["check"][~self.table["passed"]])
        return (f"DP step audit {'passed' if self.passed else 'FAILED'} (alpha={self.alpha:g}, "
                f"trials={self.trials})" + (f": fails {failed}" if failed else ""))

    def plot(self, ax, bins: int = 60):
        """``workbench.viz.audit.plot_noise_histogram``: noise against N(0, 1); artists."""
        return plot_noise_histogram(ax, self, bins)


_N_BOUNDARY = 32  # rows of the clip-boundary batch


def design_batches(dim: int, batch_size: float, C: float, generator=None) -> dict:
    """{name: G (n, dim) float64}: the designed batch, its neighbour and a small batch."""
    if dim < 2:
        raise ValueError(f"dim must be >= 2 (one outlier coordinate, one aligned); got {dim!r}")
    n = max(6, int(round(batch_size)))
    u = torch.randn(dim, generator=generator, dtype=torch.float64)
    v = torch.randn(dim, generator=generator, dtype=torch.float64)
    e0, e1 = torch.eye(dim, dtype=torch.float64)[:2]
    rows = [100 * C * u / u.norm(),  # huge: clipped to C
            0.01 * C * v / v.norm(),  # tiny: left alone
            torch.zeros(dim, dtype=torch.float64),  # zero: c = 1, no NaN
            30 * C * e0]  # one-coordinate outlier
    rows += [0.8 * C * e1] * (n - 4)  # aligned moderate samples: their sum exceeds C
    G = torch.stack(rows)  # (n, dim)
    norms = C * torch.logspace(-1, 3, _N_BOUNDARY, base=2, dtype=torch.float64)  # C/2 .. 8C
    boundary = norms[:, None] * torch.eye(dim, dtype=torch.float64)[-1]  # (32, dim) on e_{d-1}
    return {"mean · designed batch": G, "mean · neighbour (huge removed)": G[1:],
            "mean · small batch (n=2)": torch.stack([0.9 * C * e1, 0.5 * C * v / v.norm()]),
            "mean · clip boundary": boundary}


def expected_step(G: torch.Tensor, C: float, batch_size: float) -> torch.Tensor:
    """μ(G) = Σ_i min(1, C/||g_i||) g_i / B, the exact mean of a correct step."""
    return (G * (C / G.norm(dim=1, keepdim=True)).clamp(max=1.0)).sum(0) / batch_size


def _run(step_fn, G, trials, dim):
    out = []
    for _ in range(trials):
        y = step_fn(G.clone())
        if tuple(y.shape) != (dim,):
            raise ValueError(f"step_fn must return a Tensor of shape ({dim},) for G of shape "
                             f"{tuple(G.shape)}; got {tuple(y.shape)}")
        out.append(y.detach().to("cpu", torch.float64))
    return torch.stack(out).numpy()  # (T, dim)


def _row(name, statistic, p_value, threshold, passed):
    return {"check": name, "statistic": float(statistic), "p_value": float(p_value),
            "threshold": float(threshold), "passed": bool(passed), "meaning": _CHECKS[name]}


def audit_dp_step(step_fn, dim: int, batch_size: float, max_grad_norm: float,
                  noise_multiplier: float, trials: int = 400, alpha: float = 1e-3,
                  generator: torch.Generator | None = None) -> MechanismAudit:
    """Test ``step_fn(G) == (Σ_i clip_C(g_i) + N(0, σ²C² I)) / batch_size`` in distribution.

    Runs ``step_fn`` 4·trials times on designed batches (``design_batches``; G is float64).
    p-values are compared with alpha/8 (mean checks: alpha/(8·dim) per coordinate);
    'sensitivity' reports a bound instead (p_value NaN). With noise_multiplier = 0 the mean
    checks become exact (tolerance 1e-6·C/B, for float32 steps) and the noise checks require
    zero noise. The step's own randomness is its own; ``generator`` only designs G.
    """
    C, B = check_max_grad_norm(max_grad_norm), check_positive(batch_size, "batch_size")
    sigma = check_noise_multiplier(noise_multiplier)
    T = check_count(trials, "trials", 20, note="for the tests' normal approximations")
    a = alpha / len(_CHECKS)  # one row per check; alpha split evenly (Bonferroni)
    s, tol = sigma * C / B, 1e-6 * C / B
    batches = design_batches(dim, B, C, generator)
    rows, resid, mus, ybars = [], [], {}, {}
    for name, G in batches.items():
        Y = _run(step_fn, G, T, dim)  # (T, dim)
        mu, ybar = expected_step(G, C, B).numpy(), Y.mean(0)
        se = np.sqrt(Y.var(0, ddof=1) / T + tol ** 2)  # (dim,) robust to a wrong s
        z = np.abs(ybar - mu) / se  # (dim,) |t|, t ~ t(T-1) under the claim (tol: conservative)
        p = min(1.0, 2 * stats.t.sf(z.max(), T - 1) * dim)  # Bonferroni over coordinates
        rows.append(_row(name, z.max(), p, a, p >= a))
        resid.append(Y - ybar)
        mus[name], ybars[name] = mu, ybar
    # sensitivity: adding/removing one sample moves the mean by at most C / B
    A, A2 = "mean · designed batch", "mean · neighbour (huge removed)"
    delta = np.linalg.norm(ybars[A] - ybars[A2])
    bound = C / B + s * np.sqrt(2 / T * stats.chi2.ppf(1 - a, dim)) + 2 * tol
    rows.append(_row("sensitivity", delta, np.nan, bound, delta <= bound))
    rows += _noise_rows(np.stack(resid), s, tol, T, a)  # (3, T, dim)
    z = np.stack(resid).ravel() / (s if s > 0 else max(np.stack(resid).std(), tol))
    table = pd.DataFrame(rows)
    return MechanismAudit(bool(table.passed.all()), table, z, alpha, T)


def helmert(R: np.ndarray) -> np.ndarray:
    """(batches, T-1, dim) Helmert contrasts of R (batches, T, dim) along the calls.

    h_k = (Σ_{j<=k} r_j - k·r_{k+1}) / sqrt(k(k+1)), k = 1..T-1: orthonormal and orthogonal to
    the mean, so T iid N(μ, s²) calls give T-1 iid N(0, s²) values exactly (centred residuals
    are correlated, -1/(T-1), which made asymptotic tests too liberal at small T)."""
    k = np.arange(1, R.shape[1])[None, :, None]  # (1, T-1, 1)
    head = np.cumsum(R, axis=1)[:, :-1]  # (batches, T-1, dim) Σ_{j<=k} r_j
    return (head - k * R[:, 1:]) / np.sqrt(k * (k + 1))


def _noise_rows(R: np.ndarray, s: float, tol: float, T: int, a: float) -> list:
    """Variance, shape and freshness of centred residuals R (batches, T, dim)."""
    names = ("noise variance", "noise is Gaussian", "noise is fresh")
    if s == 0:  # the claim is "no noise": every residual must vanish
        ok = np.abs(R).max() <= tol
        return [_row(n, np.abs(R).max(), np.nan, tol, ok) for n in names]
    dof = R.shape[0] * R.shape[2] * (T - 1)
    chi2 = (R ** 2).sum() / s ** 2  # ~ χ²(dof)  two-sided
    p_var = 2 * min(stats.chi2.cdf(chi2, dof), stats.chi2.sf(chi2, dof))
    rows = [_row(names[0], chi2 / dof, min(p_var, 1.0), a, p_var >= a)]
    if R.std() <= tol:  # identical outputs on every call: not noise at all
        return rows + [_row(n, 0.0, 0.0, a, False) for n in names[1:]]
    ks = stats.kstest((helmert(R) / s).ravel(), "norm")  # iid N(0, 1) under the claim
    rows.append(_row(names[1], ks.statistic, ks.pvalue, a, ks.pvalue >= a))
    num = (R[:, 1:] * R[:, :-1]).sum()  # lag-1: call t against call t+1
    r = num / np.sqrt((R[:, 1:] ** 2).sum() * (R[:, :-1] ** 2).sum())
    n_pairs = R.shape[0] * R.shape[2] * (T - 1)
    zr = (r + 1 / T) * np.sqrt(n_pairs)  # centring biases r by -1/T
    p_fresh = 2 * stats.norm.sf(abs(zr))
    rows.append(_row(names[2], r, p_fresh, a, p_fresh >= a))
    return rows


__all__ = ["MechanismAudit", "audit_dp_step", "design_batches", "expected_step", "helmert"]
