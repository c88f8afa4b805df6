"""Flat clipping: every sample's whole gradient scaled to norm at most C, then summed.

DP-SGD (Abadi et al. 2016, arXiv 1607.00133, Algorithm 1) bounds each sample's influence by
clipping its gradient over all trainable parameters at once ("flat" clipping):

    c_i = min(1, C / ||g_i||)          clip factor
    ḡ_i = c_i g_i                      ||ḡ_i|| <= C
    Σ_i ḡ_i                            the clipped sum that noise is added to

**No stabiliser.** Many libraries use C / (||g_i|| + 1e-6); we use the exact factor, with
the convention c_i = 1 when ||g_i|| = 0 (C / 0 = inf, then the min gives 1). Every method of
the workbench shares this function, so they agree exactly, and ||ḡ_i|| <= C holds without
the 1e-6 slack.

Notation: n batch size, g_i per-sample gradient (all parameters), C max_grad_norm.
"""

import torch

from workbench.checks import check_max_grad_norm

LOW_PRECISION = (torch.float16, torch.bfloat16)  # norms and squares accumulate in float32


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """c_i = min(1, C / ||g_i||), and 1 where ||g_i|| = 0.

    >>> clip_factors(torch.tensor([0.0, 0.5, 2.0, 4.0]), 1.0)
    tensor([1.0000, 1.0000, 0.5000, 0.2500])
    """
    C = check_max_grad_norm(max_grad_norm)
    return (C / norms).clamp(max=1.0)  # (n,); C / 0 = inf -> 1


def grad_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """||g_i|| over all parameters from materialised per-sample gradients {name: (n, ...)}."""
    squares = [sample_squares(g) for g in grads.values()]  # each (n,)
    return torch.stack(squares).sum(0).sqrt()


def sample_squares(g: torch.Tensor) -> torch.Tensor:
    """||g_i||² for each sample of an (n, ...) tensor, as one reduction: (n,).

    ``g.pow(2).sum(...)`` would first write a second (n, ...) tensor, which doubles the peak
    memory of every method that materialises per-sample gradients
    (``python -m workbench.bench memory`` measures it).
    """
    wide = torch.float32 if g.dtype in LOW_PRECISION else None  # 256² overflows float16
    if g.dim() == 1:
        return g.to(wide or g.dtype).square()
    return torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim())), dtype=wide).square()


def weighted_sum(grads: dict[str, torch.Tensor], c: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: Σ_i c_i g_i} from materialised per-sample gradients."""
    return {name: torch.tensordot(c.to(g.dtype), g, dims=1) for name, g in grads.items()}
