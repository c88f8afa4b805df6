"""The noise of the DP-SGD update: N(0, σ² C² I) on the clipped sum.

Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1, with Poisson sampling (``sampling.py``):

    ḡ = (Σ_i c_i g_i + N(0, σ² C² I)) / B                     B = q N, the expected batch size

The clipped sum comes from the one clipping engine (``clipping/engine.py``); this file draws
the noise, from an explicit generator (or a fresh cryptographically seeded one per draw in
secure mode).

Notation: σ noise multiplier, C max_grad_norm, q sample rate, N data set size.
"""

import torch

from workbench.methods import OPTIMIZER_METHODS as MODES

__all__ = ["MODES", "gaussian_noise", "noised_mean"]


def gaussian_noise(param: torch.Tensor, std: float, generator=None) -> torch.Tensor:
    """N(0, std² I) shaped like ``param`` (drawn on CPU from ``generator`` when given; a
    ``secure.SecureGenerator`` gives a freshly seeded generator for every draw)."""
    if hasattr(generator, "next"):
        generator = generator.next()
    if generator is not None and generator.device != param.device:
        noise = torch.normal(0.0, std, param.shape, generator=generator, dtype=param.dtype)
        return noise.to(param.device)
    return torch.normal(0.0, std, param.shape, generator=generator, dtype=param.dtype,
                        device=param.device)


def noised_mean(clipped_sum, param: torch.Tensor, std: float, batch_size: float,
                generator=None) -> torch.Tensor:
    """(Σ_i c_i g_i + N(0, std² I)) / B in one fresh tensor of ``param``'s dtype (Algorithm 1).

    Bit-identical to ``(clipped_sum.to(dtype).clone() + gaussian_noise(...)) / B`` (IEEE
    addition commutes; ``torch.normal(0, std, shape)`` is ``empty(shape).normal_(0, std)``),
    but the noise buffer is the result: no copy of the sum, no temporary for the quotient.
    ``clipped_sum`` is only read; None stands for a zero sum (a parameter no sample reached).
    """
    out = gaussian_noise(param, std, generator)  # (shape of param), fresh: ours to write
    if clipped_sum is not None:
        out.add_(clipped_sum.detach().to(param.dtype))
    return out.div_(batch_size)
