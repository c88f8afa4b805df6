"""The designed batches of ``audit_dp_step``: per-sample gradients whose correct step is known.

A correct DP-SGD step (Abadi et al. 2016, arXiv 1607.00133, Algorithm 1) has the exact mean
μ(G) = Σ_i min(1, C/||g_i||) g_i / B (``expected_step``). Each batch puts records where a
particular mistake moves that mean:

    designed batch       a huge record (100C, spread over every coordinate: per-layer or
                         per-coordinate clipping changes its clipped norm), a tiny one, a zero
                         one (c = 1, no NaN), a 30C outlier on e_0, aligned 0.8C records on e_1
                         (their sum exceeds C: batch-level clipping shows); n = max(6, round(B))
    neighbour            the same without the huge record (n = B - 1: dividing by n shows)
    small batch          two records, n = 2; and one record of norm 5C alone, n = 1 (a step
                         whose fast path for a lone record skipped the clip passed until
                         2026-11-30: no designed batch had n = 1)
    clip boundary        32 norms from C/2 to 8C on the last coordinate, ``repeats`` times
                         (clipping to κC moves it by Σ_k (min(r_k, κ) - 1)_+ C/B)
    outlier per coord.   30C e_j for every j: a norm that leaves out one parameter, or a
                         parameter that takes the unclipped sum, shows on its own coordinate
    dense records        32·``repeats`` copies of one record of norm 100C with |entries| all
                         100C/sqrt(d): clipping each layer to C on its own (any split of the
                         coordinates, each part then of norm > C for d < 10^4) moves each copy's
                         clipped value by >= (sqrt 2 - 1) C, every copy the same way
    NaN record           the designed batch plus a ~100C record whose first coordinate is NaN
                         (``nan_record_batch``; not a mean check: its μ is undefined)
    sizes and scales     ``sweep_batches``: every n from 1 to 9 and each side of the powers of
                         two to 1024 (a step whose clip runs only on a first physical batch of
                         64, or only for n = 1, or skips it for 2 <= n <= 5), records in random
                         directions with norms from 10^-8 C to 10^8 C at every position (a
                         clip factor floored at 0.01 moves a 1000C record by 9C; the largest
                         record of the other batches is 100C, where it is exact)

Notation: n batch size, d coordinates, g_i row i of G, C max_grad_norm, B expected batch size.
"""

import torch

_N_BOUNDARY = 32  # rows of the clip-boundary batch (times ``boundary_repeats``)
OUTLIERS = "mean · outlier on every coordinate"  # reported in the designed batch's row
DENSE = "mean · dense records"  # likewise
ALONE = "mean · one record (n=1)"  # reported in the small batch's row


def boundary_norms(repeats: int = 1) -> torch.Tensor:
    """Norms (units of C) of the clip-boundary rows: 32 from 1/2 to 8, each ``repeats`` times."""
    return torch.logspace(-1, 3, _N_BOUNDARY, base=2, dtype=torch.float64).repeat(repeats)


def design_batches(dim: int, batch_size: float, C: float, generator=None,
                   boundary_repeats: int = 1) -> dict:
    """{name: G (n, dim) float64}: the designed batch, its neighbour, a small batch, the
    clip-boundary batch (``boundary_repeats`` copies of its 32 norms), an outlier per
    coordinate and ``boundary_repeats``·32 copies of a dense record."""
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
    norms = C * boundary_norms(boundary_repeats)  # C/2 .. 8C
    boundary = norms[:, None] * torch.eye(dim, dtype=torch.float64)[-1]  # (32 r, dim) on e_{d-1}
    dense = 100 * C * torch.ones_like(u).copysign(u) / dim ** 0.5  # (dim,) |entries| equal
    return {"mean · designed batch": G, "mean · neighbour (huge removed)": G[1:],
            "mean · small batch (n=2)": torch.stack([0.9 * C * e1, 0.5 * C * v / v.norm()]),
            "mean · clip boundary": boundary,
            ALONE: (5 * C * v / v.norm())[None],  # (1, dim): one record, clipped to C
            OUTLIERS: 30 * C * torch.eye(dim, dtype=torch.float64),  # (dim, dim): each clipped
            DENSE: dense.expand(_N_BOUNDARY * boundary_repeats, dim).clone()}  # (32 r, dim)


SWEEP_SIZES = (*range(1, 10), 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257,
               511, 512, 513, 1023, 1024, 1025)
"""Batch sizes of ``sweep_batches``: the small ones each, and each side of the powers of two a
step may cut a batch at (physical batches, chunks, vectorised paths)."""
SWEEP_SCALES = torch.logspace(-8, 8, 17, dtype=torch.float64)
"""Record norms of ``sweep_batches``, in units of C: half below C, half above, C itself."""


def sweep_batches(dim: int, C: float, generator=None) -> dict:
    """{"sizes and scales n=<n>": G (n, dim)} for every n of ``SWEEP_SIZES``: rows in random
    directions whose norms cycle through ``SWEEP_SCALES`` · C (the first record above C, the
    second below, from a start that moves with n), so that every batch of two or more holds
    records above and below C and every position of the large batches holds records far
    above C."""
    out = {}
    k, half = len(SWEEP_SCALES), len(SWEEP_SCALES) // 2  # SWEEP_SCALES[half] = 1
    for n in SWEEP_SIZES:
        u = torch.randn(n, dim, generator=generator, dtype=torch.float64)
        first = half + 1 + n % half  # above C
        at = (first + 5 * torch.arange(n)) % k  # 5 is prime to k: every scale in turn
        if n > 1:
            at[1] = n % half  # below C
        norms = C * SWEEP_SCALES[at]  # (n,)
        out[f"sizes and scales n={n}"] = u * (norms / u.norm(dim=1))[:, None]
    return out


def nan_record_batch(G: torch.Tensor, C: float) -> torch.Tensor:
    """G plus one record of norm ~100C whose first coordinate is NaN: (n + 1, dim)."""
    dim = G.shape[1]
    bad = torch.full((dim,), 100 * C / dim ** 0.5, dtype=G.dtype)
    bad[0] = float("nan")
    return torch.cat([G, bad[None]])


def expected_step(G: torch.Tensor, C: float, batch_size: float) -> torch.Tensor:
    """μ(G) = Σ_i min(1, C/||g_i||) g_i / B, the exact mean of a correct step."""
    return (G * (C / G.norm(dim=1, keepdim=True)).clamp(max=1.0)).sum(0) / batch_size


__all__ = ["ALONE", "DENSE", "OUTLIERS", "SWEEP_SCALES", "SWEEP_SIZES", "boundary_norms",
           "design_batches", "expected_step", "nan_record_batch", "sweep_batches"]
