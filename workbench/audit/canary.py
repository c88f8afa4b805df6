"""Canary audit: an empirical lower bound on ε from one DP-SGD run with gradient canaries.

Steinke, Nasr, Jagielski 2023, "Privacy Auditing with One (1) Training Run" (arXiv
2305.08846). m canaries are each included with probability ½, independently (the secret
bits); after one run the auditor guesses k₊ of them "in", k₋ "out" and abstains on the rest.
Their Theorem 3.1 bounds the number W of correct guesses among r = k₊ + k₋ for an (ε, δ)-DP
run (``one_run_bound.py``, with the δ term 2mδ·max_i (f(v-i) - f(v))/i):

    P[W >= v] <= f(v) + 2mδ·max_i (f(v-i) - f(v))/i,   f(v) = P[Bin(r, e^ε/(1+e^ε)) >= v]

so observing W = v refutes every ε whose right-hand side is < β, and ε_lower is the smallest
ε not refuted at confidence 1 - β. It is sound at every m: a run that is (ε_upper, δ)-DP gets
ε_lower > ε_upper with probability <= β, so ``passed`` fails wrongly at most that often.

How loose it is: ε_lower can never exceed ``epsilon_attainable``, the bound for r correct
guesses out of r (logit(β^(1/r)) at δ = 0, about 4.9 for r = 400 at 95%, less once 2mδ
matters). A correct DP-SGD run with Dirac canaries gets far less (the canaries' scores
overlap), typically a quarter of the accountant's ε or below: a one-run audit catches steps
that leak grossly (no noise, noise off by a factor of ten), not a step with half the noise.
Use ``gaussian_audit.audit_gaussian_step`` for a tight check of the noise.

The run, kept at the level of the DP step (white box, the auditor sees every released step):
canary j is the gradient C·e_j (Dirac, coordinate j < m); at each of T steps each included
canary, and each of ``data_size`` ordinary examples, joins the batch with probability q
(Poisson). Ordinary gradients are fixed, of norm C, on the coordinates m..d-1 (zero rows when
d = m). Canary j's score is Σ_t step_t[j]; the guesses are the top k₊ and bottom k₋ scores.

Notation: m canaries, d coordinates, T steps, q sample rate, C max_grad_norm, σ noise
multiplier, B = q·(data_size + m/2) expected batch size, r guesses, v correct, β = 1 - confidence.
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from workbench import accounting
from workbench.audit.one_run_bound import attainable_bound, epsilon_lower_bound
from workbench.audit.result import AuditResult
from workbench.checks import (
    check_count,
    check_max_grad_norm,
    check_noise_multiplier,
    check_sample_rate,
)
from workbench.viz.audit_privacy import plot_canary_scores

__all__ = ["CanaryAudit", "audit_canaries", "epsilon_lower_bound", "attainable_bound"]


@dataclass
class CanaryAudit(AuditResult):
    """ε_lower from the canaries against ε_upper from the accountant; ``table`` has the numbers."""

    epsilon_lower: float
    epsilon_upper: float
    table: pd.DataFrame
    scores: np.ndarray = field(repr=False)  # (m,) Σ_t step_t[j]
    included: np.ndarray = field(repr=False)  # (m,) bool, the secret bits
    epsilon_attainable: float = float("nan")  # ε_lower if all r guesses were right

    @property
    def passed(self) -> bool:
        return bool(self.epsilon_lower <= self.epsilon_upper)

    @property
    def summary(self) -> str:
        return (f"Canary audit {'passed' if self.passed else 'FAILED'}: ε_lower = "
                f"{self.epsilon_lower:.3f}, ε_upper = {self.epsilon_upper:.3f} (the most this "
                f"configuration can show: {self.epsilon_attainable:.3f})")

    def plot(self, ax, bins: int = 40):
        """``workbench.viz.audit_privacy.plot_canary_scores``: scores and thresholds; artists."""
        return plot_canary_scores(ax, self, bins)


def canary_scores(step_fn, dim, steps, sample_rate, max_grad_norm, included, data_size,
                  generator=None) -> np.ndarray:
    """Run T steps with Dirac canaries C·e_j for the included j; return (m,) Σ_t step_t[j]."""
    m, C, q = len(included), float(max_grad_norm), float(sample_rate)
    canaries = C * torch.eye(m, dim, dtype=torch.float64)[torch.as_tensor(included)]  # (k, d)
    data = torch.zeros(data_size, dim, dtype=torch.float64)
    if dim > m and data_size > 0:  # ordinary gradients live off the canary coordinates
        x = torch.randn(data_size, dim - m, generator=generator, dtype=torch.float64)
        data[:, m:] = C * x / x.norm(dim=1, keepdim=True)  # (data_size, d - m), norm C
    pool = torch.cat([canaries, data])  # (k + data_size, d)
    total = torch.zeros(m, dtype=torch.float64)
    for _ in range(int(steps)):
        take = torch.rand(len(pool), generator=generator,  # Poisson sampling, in float64
                          dtype=torch.float64) < q  # (dpsgd/sampling.py: float32 rounds q)
        y = step_fn(pool[take])
        if tuple(y.shape) != (dim,):
            raise ValueError(f"step_fn must return a Tensor of shape ({dim},); got "
                             f"{tuple(y.shape)}")
        total += y.detach().to("cpu", torch.float64)[:m]
    return total.numpy()


def guess(scores: np.ndarray, k_in: int, k_out: int, generator=None) -> np.ndarray:
    """(m,) +1 for the top k_in scores, -1 for the bottom k_out, 0 (abstain) otherwise.

    Ties (e.g. exact zeros without noise) are broken by a random permutation, not by index."""
    perm = torch.randperm(len(scores), generator=generator).numpy()
    order = perm[np.argsort(scores[perm], kind="stable")]  # ascending, ties shuffled
    g = np.zeros(len(scores), dtype=int)
    g[order[len(scores) - k_in:]] = 1
    g[order[:k_out]] = -1
    return g


def audit_canaries(step_fn_factory, dim: int, steps: int, sample_rate: float,
                   max_grad_norm: float, noise_multiplier: float, delta: float = 1e-5,
                   canaries: int = 1000, guesses: int = 400, confidence: float = 0.95,
                   data_size: int | None = None, generator: torch.Generator | None = None,
                   accountant: str = "rdp") -> CanaryAudit:
    """One-run canary audit of ``step_fn_factory(C, σ, B, generator)`` (``bug_zoo`` style).

    The factory is called once with B = q·(data_size + canaries/2), the expected batch size,
    and a generator for the step's noise seeded from ``generator`` (so one seed fixes the run).
    ``guesses`` r is split into k₊ = ⌈r/2⌉ "in" and k₋ = ⌊r/2⌋ "out" guesses. ``generator``
    draws the secret bits, the data and the Poisson samples. ``data_size`` defaults to
    ``canaries``. ``noise_multiplier`` is the *claim*: it is given to the factory and to
    ``accounting.epsilon`` for ε_upper.
    """
    dim = check_count(dim, "dim")
    m = check_count(canaries, "canaries", 1, dim, note="one coordinate each", high_name="dim")
    r = check_count(guesses, "guesses", 1, m, high_name="canaries")
    n_data = m if data_size is None else check_count(data_size, "data_size")
    q = check_sample_rate(sample_rate)
    C, sigma = check_max_grad_norm(max_grad_norm), check_noise_multiplier(noise_multiplier)
    B = q * (n_data + m / 2)  # expected batch size: the canary count is secret
    included = (torch.rand(m, generator=generator) < 0.5).numpy()  # (m,) secret bits
    seed = int(torch.randint(2 ** 62, (1,), generator=generator))
    step_fn = step_fn_factory(C, sigma, B, torch.Generator().manual_seed(seed))
    scores = canary_scores(step_fn, dim, steps, q, C, included, n_data, generator)
    g = guess(scores, (r + 1) // 2, r // 2, generator)
    v = int(((g == 1) & included).sum() + ((g == -1) & ~included).sum())
    eps_lo = epsilon_lower_bound(r, v, confidence, delta=delta, canaries=m)  # Thm. 3.1
    eps_max = attainable_bound(r, confidence, delta=delta, canaries=m)  # v = r
    eps_up = float(accounting.epsilon(q, sigma, steps, delta, accountant=accountant))
    table = pd.DataFrame([{
        "canaries": m, "guesses": r, "correct": v, "epsilon_lower": eps_lo,
        "confidence": confidence, "epsilon_upper": eps_up, "delta": delta, "steps": int(steps),
        "sample_rate": q, "noise_multiplier": sigma, "epsilon_attainable": eps_max,
        "decision rule": f"score_j = Σ_t step_t[j]; top {(r + 1) // 2} -> in, "
                         f"bottom {r // 2} -> out, abstain on {m - r}",
    }])
    return CanaryAudit(eps_lo, eps_up, table, scores, included, eps_max)
