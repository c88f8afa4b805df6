"""Adaptive clipping: C follows a target quantile of the per-sample gradient norms, privately.

Andrew, Thakkar, McMahan, Ramaswamy (2021), "Differentially Private Learning with Adaptive
Clipping", NeurIPS, arXiv:1905.03871, §2-3. Each logical step releases, besides the noisy
clipped sum, a noisy count of the records whose gradient was not clipped, centred so that one
record moves it by 1/2 (add/remove):                                                      (1)

    b̃ = (Σ_i (1[||g_i|| <= C] - 1/2) + N(0, σ_b²)) / B + 1/2,

and moves C geometrically towards the γ-quantile of the norms:                             (2)

    C ← C · exp(-η (b̃ - γ)).

**Privacy.** The two releases are Gaussian queries of sensitivities C and 1/2; together they
are exactly one Gaussian query with noise multiplier σ where (their Thm. 1)               (3)

    σ⁻² = σ_Δ⁻² + (2 σ_b)⁻²,    so the clipped sum gets   σ_Δ = (σ⁻² - (2 σ_b)⁻²)^(-1/2),

and the accountant charges the σ the user asked for, step by step, as without adaptation: the
total release is what the claim says. σ_b defaults to B / 20 (their §3 suggestion); it must
exceed σ / 2 ((2 σ_b)⁻² < σ⁻²), or no noise would be left for the gradient; σ must be > 0
(the count's noise comes out of the gradient's). C used for clipping and for the
noise σ_Δ C is the same C within a step; it changes only between logical steps.

Clipping every record in one group (flat clipping) is required: per-layer clip norms would
need one count per group (refused with the reason). Works in every ``method``: the
norms are computed by every mode anyway (``optimizer.last["norms"]``).

Notation: C clip norm, γ target quantile, η learning rate of C, σ total noise multiplier,
σ_Δ the gradient's share, σ_b the count's noise, B = qN the expected batch size.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench.checks import check_positive
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.dpsgd.privatise import gaussian_noise


@dataclass(frozen=True)
class AdaptiveClipping:
    """Settings of Eq. (1)-(2): γ, η and σ_b (None: B / 20)."""

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float | None = None

    def __post_init__(self):
        if not (isinstance(self.target_quantile, (int, float))
                and 0 < self.target_quantile < 1):
            raise ValueError(f"AdaptiveClipping: target_quantile must be in (0, 1) (the share "
                             f"of records left unclipped); got {self.target_quantile!r}")
        check_positive(self.learning_rate, "AdaptiveClipping: learning_rate")
        if self.count_noise_multiplier is not None:
            check_positive(self.count_noise_multiplier, "AdaptiveClipping: count_noise_multiplier")


def gradient_noise_multiplier(sigma: float, sigma_b: float) -> float:
    """σ_Δ of Eq. (3), or a ValueError when σ_b leaves no noise for the gradient.

    >>> round(gradient_noise_multiplier(1.0, 12.8), 5)
    1.00076
    """
    if not sigma > 0:  # the optimizer's noise_multiplier, set to 0 after construction too
        raise ValueError(f"adaptive clipping needs noise_multiplier > 0 (got {sigma!r}): the "
                         f"count of unclipped records is released with noise taken out of "
                         f"the gradient's (Eq. 3), and without noise there is none to share; "
                         f"set noise_multiplier > 0, or train without adaptive_clipping")
    rest = sigma ** -2 - (2 * sigma_b) ** -2
    if rest <= 0:
        raise ValueError(f"adaptive clipping: count_noise_multiplier={sigma_b:g} is too small "
                         f"for noise_multiplier={sigma:g}: Eq. (3) needs sigma_b > sigma / 2"
                         f" = {sigma / 2:.3g}; raise it (default: expected batch size / 20)")
    return rest ** -0.5


class AdaptiveClipDPOptimizer(DPOptimizer):
    """DPOptimizer whose ``max_grad_norm`` follows the γ-quantile of the norms, Eq. (1)-(3).

    ``last["unclipped_fraction"]`` is b̃ of the last logical step, ``last["max_grad_norm"]``
    the C the next step clips to.
    """

    def __init__(self, optimizer, model, *, adaptive: AdaptiveClipping, **kwargs):
        super().__init__(optimizer, model, **kwargs)
        try:
            self._check_adaptive(adaptive)
        except Exception:  # refused after the recorder was attached: the model as it was
            self.detach("make_private refused its settings")  # (its hooks stayed until
            raise  # 2026-11-30, recording every later forward pass)

    def _check_adaptive(self, adaptive: AdaptiveClipping) -> None:
        if isinstance(self.max_grad_norm, list):
            raise ValueError("adaptive clipping needs one max_grad_norm for the whole model "
                             "(flat clipping): per-layer clip norms would need one private "
                             "count per group; pass a single number")
        if not self.noise_multiplier > 0:
            raise ValueError("adaptive clipping needs noise_multiplier > 0: its count of "
                             "unclipped records must be noised as well (Eq. 1)")
        if dist.is_available() and dist.is_initialized():
            raise NotImplementedError("adaptive clipping under torch.distributed is not "
                                      "supported: the count would have to be all-reduced and "
                                      "noised once; use a fixed max_grad_norm")
        self.adaptive = adaptive
        B = self.expected_batch_size
        self.count_noise_multiplier = (adaptive.count_noise_multiplier
                                       if adaptive.count_noise_multiplier is not None else B / 20)
        gradient_noise_multiplier(self.noise_multiplier, self.count_noise_multiplier)  # checks
        self._centred_count = 0.0

    def accumulate_clipped_sum(self, scale=None) -> None:
        C = self.max_grad_norm
        super().accumulate_clipped_sum(scale)
        norms = self.last["norms"]  # inf or NaN (a non-finite record) counts as clipped
        self._centred_count += float(((norms <= C).to(torch.float64) - 0.5).sum())  # Eq. (1)

    def reset_virtual_step(self) -> None:
        super().reset_virtual_step()
        self._centred_count = 0.0  # the abandoned batch's records are not counted either

    def noise_std(self) -> float:
        """σ_Δ C: the gradient's share of the noise, Eq. (3)."""
        return gradient_noise_multiplier(self.noise_multiplier,
                                         self.count_noise_multiplier) * self.max_grad_norm

    def privatise(self) -> None:
        super().privatise()
        B, a = self.expected_batch_size, self.adaptive
        zero = torch.zeros((), dtype=torch.float64)
        noise = float(gaussian_noise(zero, self.count_noise_multiplier, self.generator))
        unclipped = (self._centred_count + noise) / B + 0.5  # Eq. (1)
        self.max_grad_norm = self.max_grad_norm * math.exp(
            -a.learning_rate * (unclipped - a.target_quantile))  # Eq. (2)
        self._centred_count = 0.0
        self.last["unclipped_fraction"] = unclipped
        self.last["max_grad_norm"] = self.max_grad_norm


__all__ = ["AdaptiveClipDPOptimizer", "AdaptiveClipping", "gradient_noise_multiplier"]
