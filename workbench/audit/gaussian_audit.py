"""Tight white-box audit of the Gaussian step: a 95% lower bound on its μ (and ε) from many calls.

Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski, Carlini, Terzis 2023, "Tight Auditing of
Differentially Private Machine Learning" (arXiv 2302.07956), Sec. 4: audit in the space of
Gaussian DP (Dong, Roth, Su 2019, arXiv 1905.02383). A mechanism is μ-GDP when every test of
"canary in" against "canary out" has, at false-positive rate FPR, a false-negative rate

    FNR >= Φ(Φ⁻¹(1 - FPR) - μ),   i.e.   μ >= Φ⁻¹(1 - FPR) - Φ⁻¹(FNR).            (GDP)

So Clopper-Pearson upper limits on FPR and FNR of one fixed test (as in Jagielski, Ullman,
Oprea 2020, arXiv 2006.07709) give a lower bound μ_lower that no μ-GDP claim below it
survives. One DP-SGD step with noise multiplier σ is the Gaussian mechanism with μ = 1/σ per
sample; the claim's ε at δ is ε(μ, δ) of Balle & Wang 2018 (``accounting.gaussian_epsilon``),
and ε_lower = ε(μ_lower, δ) is the ε of the least private Gaussian step the data allow.

The experiment (white box, Dirac gradient canaries as in Nasr et al.): each call feeds G whose
rows are C·e_j for the canaries j with secret bit b_j = 1 (each bit ½, fresh per call); the
score of canary j is x_j = step(G)_j·B/C, which is b_j + N(0, σ²) for a correct step. The
test says "in" when x_j > ½ (the midpoint; for a Gaussian shift every threshold gives the same
μ, the midpoint the narrowest interval). The d·calls scores are independent for a correct step
(fresh noise on every coordinate and call), which is what the binomial counts assume; a step
whose noise is shared across coordinates or calls is caught by ``audit_dp_step``.

Notation: d coordinates (canaries per call), C max_grad_norm, σ noise multiplier, B batch size,
μ = 1/σ, β = 1 - confidence, split β/2 to each of FPR and FNR (Bonferroni).
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy import stats

from workbench import accounting
from workbench.audit.result import AuditResult
from workbench.checks import (
    check_count,
    check_delta,
    check_max_grad_norm,
    check_noise_multiplier,
    check_positive,
    check_probability,
)
from workbench.viz.audit_privacy import plot_gaussian_scores


@dataclass
class GaussianAudit(AuditResult):
    """μ_lower / ε_lower from the canaries against the claim; ``table`` has the numbers."""

    passed: bool
    table: pd.DataFrame
    scores: np.ndarray = field(repr=False)  # (calls, d) x_j = step_j·B/C
    bits: np.ndarray = field(repr=False)  # (calls, d) bool, the secret bits

    @property
    def summary(self) -> str:
        r = self.table.iloc[0]
        return (f"Gaussian step audit {'passed' if self.passed else 'FAILED'}: ε_lower "
                f"{r.epsilon_lower:.3f} vs ε_upper {r.epsilon_upper:.3f} (μ_lower "
                f"{r.mu_lower:.3f} vs claimed {r.mu_claim:.3f}, {r.observations} scores)")

    def plot(self, ax, bins: int = 60):
        """``workbench.viz.audit_privacy.plot_gaussian_scores``: in/out scores; artists."""
        return plot_gaussian_scores(ax, self, bins)


def mu_lower_bound(false_pos: int, negatives: int, false_neg: int, positives: int,
                   confidence: float = 0.95) -> float:
    """μ_lower = Φ⁻¹(1 - FPR_hi) - Φ⁻¹(FNR_hi), Clopper-Pearson limits at β/2 each (GDP)."""
    b = (1.0 - confidence) / 2
    fpr_hi = stats.beta.ppf(1 - b, false_pos + 1, negatives - false_pos) if false_pos < \
        negatives else 1.0  # one-sided upper limit
    fnr_hi = stats.beta.ppf(1 - b, false_neg + 1, positives - false_neg) if false_neg < \
        positives else 1.0
    return float(max(0.0, stats.norm.isf(fpr_hi) - stats.norm.ppf(fnr_hi)))


def _epsilon(mu: float, delta: float) -> float:
    return 0.0 if mu == 0 else accounting.gaussian_epsilon(1.0 / mu, delta)  # σ = 1/μ


def audit_gaussian_step(step_fn, dim: int, batch_size: float, max_grad_norm: float,
                        noise_multiplier: float, delta: float = 1e-5, calls: int = 200,
                        confidence: float = 0.95, accountant: str = "pld",
                        generator: torch.Generator | None = None) -> GaussianAudit:
    """Audit ``step_fn(G) -> Tensor(d)`` (``audit_dp_step``'s interface) against one Gaussian step.

    ε_upper is the accountant's ε for one step with q = 1 (``accounting.epsilon``);
    ``passed`` is ε_lower <= ε_upper, which a correct step fails with probability <= β.
    ``generator`` draws the secret bits; the step's noise is its own. At d = 1000 and 200
    calls (2·10⁵ scores) a correct step at ε ≈ 2 gets ε_lower ≈ 0.95 ε_upper.
    """
    C, B = check_max_grad_norm(max_grad_norm), check_positive(batch_size, "batch_size")
    sigma = check_noise_multiplier(noise_multiplier, positive=True,
                                   note="σ = 0 claims no privacy, ε = inf: nothing to audit")
    dim, calls = check_count(dim, "dim", 2), check_count(calls, "calls")
    confidence = check_probability(confidence, "confidence", note="e.g. 0.95")
    delta = check_delta(delta)
    eye = C * torch.eye(dim, dtype=torch.float64)  # (d, d) canary j = C·e_j
    bits = torch.rand(int(calls), dim, generator=generator) < 0.5  # (calls, d) secret
    scores = np.empty((int(calls), dim))
    for t in range(int(calls)):
        y = step_fn(eye[bits[t]])  # G: (n_t, d), n_t = Σ_j b_j
        if tuple(y.shape) != (dim,):
            raise ValueError(f"step_fn must return a Tensor of shape ({dim},); got "
                             f"{tuple(y.shape)}")
        scores[t] = y.detach().to("cpu", torch.float64).numpy() * B / C  # x_j
    b = bits.numpy()
    fp, neg = int((scores[~b] > 0.5).sum()), int((~b).sum())  # out, said "in"
    fn, pos = int((scores[b] <= 0.5).sum()), int(b.sum())  # in, said "out"
    mu_lo = mu_lower_bound(fp, neg, fn, pos, confidence)
    eps_lo = _epsilon(mu_lo, delta)
    eps_up = float(accounting.epsilon(1.0, sigma, 1, delta, accountant=accountant))
    mu_hat = max(0.0, stats.norm.isf(fp / neg) - stats.norm.ppf(fn / pos)) if 0 < fp < neg \
        and 0 < fn < pos else float("nan")  # point estimate
    table = pd.DataFrame([{
        "calls": int(calls), "observations": neg + pos, "false_positive_rate": fp / neg,
        "false_negative_rate": fn / pos, "mu_estimate": mu_hat, "mu_lower": mu_lo,
        "mu_claim": 1 / sigma, "epsilon_lower": eps_lo, "epsilon_upper": eps_up,
        "epsilon_claim_exact": _epsilon(1 / sigma, delta), "delta": delta,
        "confidence": confidence, "noise_multiplier": sigma, "accountant": accountant,
        "passed": eps_lo <= eps_up,
    }])
    return GaussianAudit(bool(eps_lo <= eps_up), table, scores, b)


__all__ = ["GaussianAudit", "audit_gaussian_step", "mu_lower_bound"]
