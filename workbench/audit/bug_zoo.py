"""A zoo of DP-SGD steps: the correct one and wrong ones seen in real code.

Each factory takes (C, σ, B, generator) and returns ``step_fn(G) -> Tensor(d)`` for per-sample
gradients G of shape (n, d). The correct step is Abadi et al. 2016 (arXiv 1607.00133),
Algorithm 1, with the sum divided by the expected batch size B:

    step(G) = (Σ_i min(1, C / ||g_i||) g_i + N(0, σ² C² I)) / B

Every wrong step differs from it in one place, and its docstring names that place. They
exist so that ``audit_dp_step`` can be shown (and tested) to catch each of them.

Notation: n realised batch size, d coordinates, g_i row i of G, C max_grad_norm,
σ noise multiplier, B expected batch size.
"""

import torch

CORRECT = "correct"


def _clip_rows(G: torch.Tensor, C: float) -> torch.Tensor:
    """(n, d) rows scaled by c_i = min(1, C / ||g_i||) (c_i = 1 for a zero row)."""
    return G * (C / G.norm(dim=1, keepdim=True)).clamp(max=1.0)  # (n, d)


def _noise(d: int, std: float, generator, like: torch.Tensor) -> torch.Tensor:
    return torch.normal(0.0, std, (d,), generator=generator, dtype=like.dtype)  # (d,)


def correct_step(C, sigma, B, generator=None):
    """The claim: (Σ_i clip_C(g_i) + N(0, σ²C² I)) / B, fresh noise on every call."""
    def step(G):
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def inverted_clip_factor(C, sigma, B, generator=None):
    """Bug: clip factor min(1, ||g|| / C) instead of min(1, C / ||g||): large gradients pass
    unclipped and small ones are shrunk, so one sample's influence is unbounded."""
    def step(G):
        c = (G.norm(dim=1, keepdim=True) / C).clamp(max=1.0)  # (n, 1) inverted
        return ((c * G).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def clip_batch_gradient(C, sigma, B, generator=None):
    """Bug: clip the summed (batch) gradient to C instead of each sample's gradient. The
    noise is calibrated to per-sample sensitivity C, but a batch-clipped sum does not bound
    how much any one sample moves the direction; the mean differs from Σ_i clip_C(g_i)."""
    def step(G):
        s = G.sum(0)
        s = s * (C / s.norm()).clamp(max=1.0)
        return (s + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def noise_std_sigma_not_sigma_c(C, sigma, B, generator=None):
    """Bug: noise std σ instead of σC (forgets that σ is in units of the clip norm).
    Invisible when C = 1; audit with C != 1."""
    def step(G):
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma, generator, G)) / B
    return step


def noise_for_mean_applied_to_sum(C, sigma, B, generator=None):
    """Bug: noise of the *mean*, N(0, (σC/B)²), is added to the *sum* before dividing by B,
    so the update's noise std is σC/B² (B times too little)."""
    def step(G):
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C / B, generator, G)) / B
    return step


def noise_for_sum_applied_to_mean(C, sigma, B, generator=None):
    """Bug (the converse): noise of the *sum*, N(0, σ²C²), added after dividing by B, so the
    update's noise std is σC (B times too much: private, but needlessly useless)."""
    def step(G):
        return _clip_rows(G, C).sum(0) / B + _noise(G.shape[1], sigma * C, generator, G)
    return step


def noise_reused_across_steps(C, sigma, B, generator=None):
    """Bug: the noise is drawn once (e.g. a buffer made in ``__init__``, or a generator
    re-seeded on every call) and the same vector is added at every step; averaging steps
    cancels nothing and differences of steps reveal the clipped sums exactly."""
    cache = {}

    def step(G):
        if "noise" not in cache:
            cache["noise"] = _noise(G.shape[1], sigma * C, generator, G)
        return (_clip_rows(G, C).sum(0) + cache["noise"]) / B
    return step


def clip_norm_ten_percent_high(C, sigma, B, generator=None):
    """Bug: clip to 1.1·C instead of C (a clip norm set from a noisy estimate, or a "tolerance"
    on the threshold): each sample can move the sum by 1.1·C while the noise is calibrated to
    C, so the true ε is that of noise multiplier σ/1.1. Invisible on samples with norm <= C."""
    def step(G):
        return (_clip_rows(G, 1.1 * C).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def clip_only_outliers(C, sigma, B, generator=None, k=10.0):
    """Bug: clip only gradients with norm above k·C (k = 10), e.g. ``if norm > k * C`` meant
    as "clip outliers": a sample with norm up to k·C passes unclipped, so the sensitivity is
    k·C while the noise is calibrated to C."""
    def step(G):
        norms = G.norm(dim=1, keepdim=True)  # (n, 1)
        c = torch.where(norms > k * C, C / norms, torch.ones_like(norms))  # (n, 1)
        return ((c * G).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def per_coordinate_clipping(C, sigma, B, generator=None):
    """Bug: clip each coordinate to [-C, C] (``clip_grad_value_``) instead of each sample's
    L2 norm to C; a sample's L2 norm can then be up to C√d, so σC noise is too little."""
    def step(G):
        return (G.clamp(-C, C).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def no_noise(C, sigma, B, generator=None):
    """Bug: clipping without noise (e.g. noise behind a flag that is off): no privacy at all."""
    def step(G):
        return _clip_rows(G, C).sum(0) / B
    return step


def divide_by_realised_batch(C, sigma, B, generator=None):
    """Bug: divide by the realised batch size n, not the expected B = qN. Under Poisson
    sampling n depends on who is in the batch, so the scale of the update leaks membership
    (see ``workbench.dpsgd.optimizer``). Invisible on batches with n = B."""
    def step(G):
        n = max(G.shape[0], 1)
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / n
    return step


def laplace_noise(C, sigma, B, generator=None):
    """Bug: Laplace noise of the right variance (σ²C²) instead of Gaussian: the Gaussian
    mechanism's privacy analysis (and every RDP/PLD accountant) no longer applies."""
    def step(G):
        u = torch.rand(G.shape[1], generator=generator, dtype=G.dtype) - 0.5  # (d,) U(-½, ½)
        b = sigma * C / 2 ** 0.5  # Laplace scale with variance 2b² = σ²C²
        lap = -b * torch.sign(u) * torch.log1p(-2 * u.abs())
        return (_clip_rows(G, C).sum(0) + lap) / B
    return step


def noise_clamped(C, sigma, B, generator=None):
    """Bug: the noise clamped to ±3σC (a "safety" clamp on outliers): where a coordinate
    hits the bound the release is the clipped sum plus a known constant, so it gives the
    sum away (ε = ∞) while the variance is 97% of the claim's."""
    def step(G):
        z = _noise(G.shape[1], sigma * C, generator, G).clamp(-3 * sigma * C, 3 * sigma * C)
        return (_clip_rows(G, C).sum(0) + z) / B
    return step


def noise_skipped_once(C, sigma, B, generator=None):
    """Bug: no noise on the first call (a noise buffer created lazily, zero until the first
    step has run): that one release is the exact clipped sum (ε = ∞)."""
    calls = [0]

    def step(G):
        calls[0] += 1
        z = _noise(G.shape[1], sigma * C, generator, G)
        return (_clip_rows(G, C).sum(0) + (0 * z if calls[0] == 1 else z)) / B
    return step


def lone_record_unclipped(C, sigma, B, generator=None):
    """Bug: a fast path for a batch of one record skips the clip (``if n == 1: return g``):
    Poisson sampling draws such batches, and that record's influence is unbounded."""
    def step(G):
        total = G.sum(0) if G.shape[0] == 1 else _clip_rows(G, C).sum(0)
        return (total + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


ZOO = {
    CORRECT: correct_step,
    "inverted_clip_factor": inverted_clip_factor,
    "clip_batch_gradient": clip_batch_gradient,
    "noise_std_sigma_not_sigma_c": noise_std_sigma_not_sigma_c,
    "noise_for_mean_applied_to_sum": noise_for_mean_applied_to_sum,
    "noise_for_sum_applied_to_mean": noise_for_sum_applied_to_mean,
    "noise_reused_across_steps": noise_reused_across_steps,
    "clip_norm_ten_percent_high": clip_norm_ten_percent_high,
    "clip_only_outliers": clip_only_outliers,
    "per_coordinate_clipping": per_coordinate_clipping,
    "no_noise": no_noise,
    "divide_by_realised_batch": divide_by_realised_batch,
    "laplace_noise": laplace_noise,
    "noise_clamped": noise_clamped,
    "noise_skipped_once": noise_skipped_once,
    "lone_record_unclipped": lone_record_unclipped,
}


__all__ = [
    "CORRECT", "ZOO", "clip_batch_gradient", "clip_norm_ten_percent_high", "clip_only_outliers",
    "correct_step", "divide_by_realised_batch", "inverted_clip_factor", "laplace_noise",
    "lone_record_unclipped", "no_noise", "noise_clamped", "noise_for_mean_applied_to_sum",
    "noise_for_sum_applied_to_mean", "noise_reused_across_steps", "noise_skipped_once",
    "noise_std_sigma_not_sigma_c", "per_coordinate_clipping",
]
