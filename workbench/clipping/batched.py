"""Norms and clipped sums of many small materialised per-sample gradients, a few ops for all.

The engine (``engine.py``) needs, from materialised per-sample gradients {key: g (n, *shape)}
of the parameters of group G,

    s_G,i = Σ_{p ∈ G} ||g_{p,i}||²   (n,) float64         Σ_i c_{G,i} g_{p,i}   (shape of p)

The slow twin takes one norm (``flat.many_sample_squares``) and one ``tensordot`` per
parameter: a handful of tensor operations each, which on a small model (a real architecture
at a tiny width: 25 parameters, 3 379 numbers) is most of a DP step's time. Here the small
gradients of one group, dtype and device are concatenated once into G (n, ΣP) (all the
copies together at most ``SMALL`` numbers, 4 MiB in float32: a bounded extra memory) and

    s_G = ||G_i||² by one row norm        Σ_i c_i g_i = (c (1, n) @ G)  split back per p

Exact in real arithmetic; the sums match ``tensordot`` bit for bit on CPU BLAS in the tests
(the same dot product per coordinate), the squares agree to rounding (one float32 row norm
over ΣP numbers instead of one per parameter added in float64). A row whose norm overflows
(inf) sends the squares back to the slow twin (overflow-safe, ``flat.py``). Gradients of
other dtypes (float16, bfloat16) and large ones keep the per-parameter path.

Notation: n batch, g_{p,i} per-sample gradient of parameter p, c_i clip factor, P numel.
"""

import torch

from workbench.clipping.flat import many_sample_squares
from workbench.clipping.nonfinite import masked

SMALL = 2**20  # numbers (n·ΣP) of per-sample gradients copied into the concatenations
BATCHED_DTYPES = (torch.float32, torch.float64)


class Concatenated:
    """The gradients {key: (n, *shape)} in chunks: (group, [(key, g)], G (n, ΣP) or None)."""

    def __init__(self, grads: dict, group_of):
        self.grads, self.group_of = grads, group_of
        chunks, slots, total = [], {}, 0  # slots: (group, dtype, device) -> its items
        for key, g in grads.items():
            group = group_of(key)
            if (g.dtype not in BATCHED_DTYPES or g.dim() < 1
                    or total + g.numel() > SMALL):  # the copies stay below SMALL numbers
                chunks.append((group, [(key, g)], False))
                continue
            total += g.numel()
            slot = (group, g.dtype, g.device)
            if slot not in slots:
                slots[slot] = []
                chunks.append((group, slots[slot], True))
            slots[slot].append((key, g))
        self.chunks = [(group, items, self._flat(items) if batched and len(items) > 1
                        else None) for group, items, batched in chunks]

    @staticmethod
    def _flat(items) -> torch.Tensor:
        n = items[0][1].shape[0]
        return torch.cat([g.reshape(n, g.shape[1:].numel()) for _, g in items], 1)

    def squares(self, zeros: torch.Tensor) -> dict:
        """{group: s_G (n,) float64} (module docstring); the slow twin where a row overflows."""
        out: dict = {}
        rows = []
        for group, items, flat in self.chunks:
            if flat is None:
                for (_, g), sq in zip(items, many_sample_squares([g for _, g in items])):
                    out[group] = out.get(group, zeros) + sq
                continue
            r = torch.linalg.vector_norm(flat, dim=1).double()  # (n,)
            rows.append(r)
            out[group] = out.get(group, zeros) + r.square()
        if rows and bool(torch.isinf(torch.stack([r.to(zeros.device) for r in rows])).any()):
            return self.slow_squares(zeros)  # ||G_i||² overflowed: per parameter, scaled
        return out

    def slow_squares(self, zeros: torch.Tensor) -> dict:
        out: dict = {}
        for key, sq in zip(self.grads, many_sample_squares(list(self.grads.values()))):
            group = self.group_of(key)
            out[group] = out.get(group, zeros) + sq
        return out

    @torch.no_grad()
    def weighted_sums(self, c: dict, ok=None) -> dict:
        """{key: Σ_i c_{G,i} g_i}: ``tensordot`` per parameter alone, one product per
        chunk; ``ok`` (n,): the rows kept (``nonfinite.masked``, not multiplied)."""
        sums: dict = {}
        cast: dict = {}  # (group, dtype, device) -> c_G in that dtype: converted once
        for group, items, flat in self.chunks:
            g0 = items[0][1]
            cg = cast.get((group, g0.dtype, g0.device))
            if cg is None:
                cg = cast[group, g0.dtype, g0.device] = c[group].to(g0.dtype)
            if flat is None:
                for key, g in items:
                    sums[key] = torch.tensordot(cg, g if ok is None else masked(g, ok), dims=1)
                continue
            flat = flat if ok is None else masked(flat, ok)
            out = cg.unsqueeze(0).mm(flat)[0]  # (ΣP,)
            widths = [g.shape[1:].numel() for _, g in items]
            for (key, g), part in zip(items, out.split(widths)):
                sums[key] = part.view(g.shape[1:])
        return sums


__all__ = ["BATCHED_DTYPES", "SMALL", "Concatenated"]
