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

**Norms that do not overflow.** ||g_i||² of a float32 gradient overflows float32 once ||g_i||
passes 1.8e19 (a record with entries near 1e18 in a thousand coordinates): the norm would be
inf, c_i = C / inf = 0, and the record would silently vanish from the sum instead of being
clipped. ``sample_norms`` computes each row's norm in the gradient's dtype (one reduction, no
copy) and recomputes only the rows that came out inf, scaled by their largest entry
m_i = max_j |g_ij|:  ||g_i|| = m_i ||g_i / m_i||. Squared norms are then kept in float64,
whose range holds the square of any float32 (or float16) norm; a float64 model's norm above
1.3e154 still overflows there and is treated as non-finite (``nonfinite.py``). Every norm that
sets a clip factor goes through ``sample_norms``: the materialised paths, the fast-gradient-
clipping layers and the shared or fallback parameters of ghost clipping, and the re-check of
any ghost norm that came out non-finite (``ghost.NormSum``).

Notation: n batch size, g_i per-sample gradient (all parameters), C max_grad_norm.
"""

import torch

from workbench.checks import check_max_grad_norm
from workbench.per_sample.precision import in_full_precision

LOW_PRECISION = (torch.float16, torch.bfloat16)  # norms and squares accumulate in float32


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """c_i = min(1, C / ||g_i||), 1 where ||g_i|| = 0, and 0 where ||g_i|| is NaN or inf
    (a non-finite record: ``nonfinite.py`` says what the callers do with it).

    >>> clip_factors(torch.tensor([0.0, 0.5, 2.0, 4.0, float("nan")]), 1.0)
    tensor([1.0000, 1.0000, 0.5000, 0.2500, 0.0000])
    """
    return checked_clip_factors(norms, check_max_grad_norm(max_grad_norm))


def checked_clip_factors(norms: torch.Tensor, C: float) -> torch.Tensor:
    """``clip_factors`` for a C its caller has validated (once per call, at the entry point
    or, in the optimizer, when it is assigned)."""
    c = (C / norms).clamp(max=1.0)  # (n,); C / 0 = inf -> 1
    return torch.where(torch.isfinite(norms), c, torch.zeros_like(c))  # C / NaN is NaN


@in_full_precision  # also inside an autocast block (per_sample/precision.py)
def grad_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """||g_i|| (n,) float64 over all parameters from per-sample gradients {name: (n, ...)}."""
    squares = many_sample_squares(list(grads.values()))  # each (n,) float64
    return torch.stack(squares).sum(0).sqrt()


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the public norms are returned in: float32 for half models, else the model's."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def sample_norms(g: torch.Tensor) -> torch.Tensor:
    """||g_i|| (n,) float64 for each sample of an (n, ...) tensor, without overflow.

    One reduction in g's dtype: ``g.pow(2).sum(...)`` would first write a second (n, ...)
    tensor, and ``vector_norm(..., dtype=float64)`` a float64 copy of g, either doubling the
    peak memory of every method that materialises per-sample gradients (``python -m
    workbench.bench memory``). Rows that overflow (inf) are recomputed alone, scaled by their
    largest entry (module docstring); a row holding NaN or inf stays NaN or inf.
    """
    norms = plain_norms(g)  # (n,)
    if g.dim() == 1:
        return norms
    dims, wide = tuple(range(1, g.dim())), _wide(g)
    over = torch.isinf(norms)
    if over.any():  # rare: ||g_i||² passed the dtype's range, or g_i holds an inf
        rows = g[over]
        m = torch.linalg.vector_norm(rows, ord=float("inf"), dim=dims, keepdim=True)  # max |g|
        scaled = torch.linalg.vector_norm(rows / m, dim=dims, dtype=wide).double()
        norms[over] = scaled * m.flatten().double()  # inf / inf = NaN: stays non-finite
    return norms


def _wide(g: torch.Tensor):
    return torch.float32 if g.dtype in LOW_PRECISION else None  # 256² overflows float16


def plain_norms(g: torch.Tensor) -> torch.Tensor:
    """||g_i|| (n,) float64 by one reduction; inf where ||g_i||² overflowed (``sample_norms``)."""
    if g.dim() == 1:
        return g.to(_wide(g) or g.dtype).abs().double()
    return torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim())), dtype=_wide(g)).double()


def sample_squares(g: torch.Tensor) -> torch.Tensor:
    """||g_i||² (n,) in float64, from ``sample_norms`` (no overflow for float32 gradients)."""
    return sample_norms(g).square()


def many_sample_squares(gs: list) -> list:
    """``[sample_squares(g) for g in gs]`` (the same values, bit for bit) with one overflow
    test for all of them: one host synchronisation per step, not one per parameter. In the
    rare case some row overflowed, each tensor takes ``sample_squares`` on its own."""
    norms = [plain_norms(g) for g in gs]  # each (n,) float64
    if norms and bool(torch.isinf(torch.stack([r.to(norms[0].device) for r in norms])).any()):
        return [sample_squares(g) for g in gs]
    return [r.square() for r in norms]


@in_full_precision  # Σ_i c_i g_i in g's dtype, not autocast's
def weighted_sum(grads: dict[str, torch.Tensor], c: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: Σ_i c_i g_i} from materialised per-sample gradients."""
    return {name: torch.tensordot(c.to(g.dtype), g, dims=1) for name, g in grads.items()}


__all__ = [
    "LOW_PRECISION", "clip_factors", "grad_norms", "many_sample_squares", "norm_dtype",
    "plain_norms", "sample_norms", "sample_squares", "weighted_sum",
]
