"""Materialised per-sample gradients held in one (n, ΣP) buffer per group: a few ops for all.

The engine (``engine.py``) needs, from the materialised per-sample gradients g_{p,i} of the
parameters p of clipping group G (Abadi et al. 2016, arXiv 1607.00133, Algorithm 1; per-layer
clipping, McMahan et al. 2018, arXiv 1710.06963, §3),

    s_{G,i} = Σ_{p ∈ G} ||g_{p,i}||²   (n,) float64          Σ_i c_{G,i} g_{p,i}   (shape of p)

The slow twin takes one norm (``flat.many_sample_squares``) and one ``tensordot`` per
parameter. Here every parameter's per-sample gradient is held *loose* (as the materialising
path made it) or, when it is small (n·P ≤ ``SMALL`` numbers), as columns of a buffer G (n, ΣP)
per group, dtype and device (at most ``CHUNK`` numbers each, allocated as the calls come),
into which the materialising paths write each layer's gradient (``put``; a parameter used in
several calls adds into its columns) and then drop it: the buffer *replaces* the tensors, it
does not copy them. Then, per buffer,

    s_G = ||G_i||² by one row norm             Σ_i c_{G,i} g_i = c_G (1, n) @ G   split per p

and per loose tensor one row norm and one (1, n) @ (n, P) product; all the row norms are
stacked, tested for overflow once and squared once. Exact in real arithmetic; the squares
agree with the twin to rounding (one row norm over ΣP numbers instead of one per parameter
summed in float64). A row whose norm overflows (inf) sends the squares back to the
overflow-safe twin (``flat.py``), per parameter.

**The buffers are off by default** (``SMALL = 0``). Measured on BERT's DP step (tiny config,
n = 16, T = 8, CPU time of the clipped sum, 4 interleaved runs): the buffers cut its tensor
ops from 259 to 233 but took 2.51-2.77 ms against 2.16-2.46 ms loose (the per-parameter
twin: 2.52-2.63 ms), and peaked at 2.28x a plain step against 2.08x loose: the copies into
the columns and the allocation of a buffer before the gradients it will hold cost what the
fewer norms and products save at these sizes. ``SMALL`` turns them on.

Notation: n batch, g_{p,i} per-sample gradient of parameter p, c_i clip factor, P numel.
"""

import math

import torch

from workbench.clipping.flat import many_sample_squares, plain_norms
from workbench.clipping.nonfinite import masked

SMALL = 0  # n·P numbers of one parameter at most to take columns in a buffer (off: above)
CHUNK = 2**14  # n·ΣP numbers of one buffer at most (where one parameter alone is not larger)


class Grouped:
    """{id(param): (n, *shape)} per-sample gradients: small ones as columns of a buffer per
    (group, dtype, device) (``put``), the others loose. ``params`` {key: parameter} plans
    the columns; ``group_of(key)`` names a key's clipping group."""

    def __init__(self, n: int, params: dict, group_of):
        self.n, self.group_of = n, group_of
        self.loose: dict = {}
        self.slot: dict = {}  # key -> (buffer key, offset, width, shape)
        self.widths: dict = {}  # buffer key -> total width
        self.buffers: dict = {}  # buffer key -> (n, ΣP), allocated at its first put
        self.views: dict = {}  # key -> its (n, P) columns
        self.members: dict = {}  # buffer key -> [(key, slot)] in column order
        self.filled: dict = {}  # key -> its shape: the keys written, in put order
        last: dict = {}  # (group, dtype, device) -> the buffer key being planned
        for key, p in params.items():  # in the order the gradients will come
            numel = p.numel()
            if 0 < numel and n * numel <= SMALL:
                kind = (group_of(key), p.dtype, p.device)
                where = last.get(kind, (*kind, 0))
                at = self.widths.get(where, 0)
                if at and n * (at + numel) > CHUNK:  # full: the next buffer of this kind
                    where, at = (*kind, where[3] + 1), 0
                last[kind] = where
                self.slot[key] = (where, at, numel, p.shape)
                self.members.setdefault(where, []).append((key, self.slot[key]))
                self.widths[where] = at + numel

    def __contains__(self, key) -> bool:
        return key in self.filled or key in self.loose

    def put(self, key, g: torch.Tensor) -> None:
        """Add g (n, *shape) to key's per-sample gradient (its first part: written)."""
        slot = self.slot.get(key)
        if (slot is not None and key not in self.loose and g.shape[1:] == slot[3]
                and g.shape[0] == self.n):
            cols = self._columns(key, slot, g)  # (n, P)
            if cols is not None:
                g = g if g.dim() == 2 else g.reshape(cols.shape)  # a view: one op, not two
                if key in self.filled:
                    cols.add_(g)
                else:
                    cols.copy_(g)
                    self.filled[key] = slot[3]
                return
        if key in self.filled:  # a later part of another dtype or device: all of it loose
            self.loose[key] = self.views[key].view(self.n, *self.filled.pop(key)).clone()
            self.views[key].zero_()  # its columns add nothing to the buffer's norms and sums
        self.loose[key] = g if key not in self.loose else self.loose[key] + g

    def _columns(self, key, slot, g):
        where = slot[0]
        buf = self.buffers.get(where)
        if buf is None:  # zeros: the columns of a parameter no call reached add nothing
            buf = self.buffers[where] = torch.zeros(self.n, self.widths[where], dtype=g.dtype,
                                                    device=g.device)
            mine = self.members[where]
            for (k, _), cols in zip(mine, buf.split_with_sizes([s[2] for _, s in mine], 1)):
                self.views[k] = cols
        if buf.dtype != g.dtype or buf.device != g.device:
            return None
        return self.views[key]

    def tensors(self) -> dict:
        """{key: (n, *shape)}: the filled columns (views) and the loose tensors."""
        return {**{key: self.views[key].view(self.n, *shape)
                   for key, shape in self.filled.items()}, **self.loose}

    def squares(self, zeros: torch.Tensor) -> dict:
        """{group: s_G (n,) float64} (module docstring); the twin where a row overflows."""
        parts = [(where[0], buf) for where, buf in self.buffers.items()]
        parts += [(self.group_of(key), g) for key, g in self.loose.items()]
        if not parts:
            return {}
        norms = torch.stack([plain_norms(t).to(zeros.device) for _, t in parts])  # (parts, n)
        if bool(torch.isinf(norms).any()):  # one overflow test (and host sync) for all
            return self.slow_squares(zeros)  # ||G_i||² overflowed: per parameter, scaled
        squares = norms.square()  # float64
        groups = [group for group, _ in parts]
        if len(set(groups)) == 1:  # the usual case: one group, one sum
            return {groups[0]: squares.sum(0)}
        return {group: squares[[k for k, g in enumerate(groups) if g == group]].sum(0)
                for group in dict.fromkeys(groups)}

    def slow_squares(self, zeros: torch.Tensor) -> dict:
        """The twin: ``flat.many_sample_squares`` per parameter, summed by group."""
        grads = self.tensors()
        out: dict = {}
        for key, sq in zip(grads, many_sample_squares(list(grads.values()))):
            group = self.group_of(key)
            out[group] = out.get(group, zeros) + sq
        return out

    @torch.no_grad()
    def weighted_sums(self, c: dict, ok=None) -> dict:
        """{key: Σ_i c_{G,i} g_i}; ``ok`` (n,): the rows kept, the others set to 0 (not
        multiplied: 0 · NaN), in the buffers in place (they are this object's own)."""
        cast: dict = {}  # (group, dtype, device) -> c_G in that dtype: converted once

        def factors(group, t):  # (1, n)
            k = (group, t.dtype, t.device)
            if k not in cast:
                cast[k] = c[group].to(device=t.device, dtype=t.dtype).unsqueeze(0)
            return cast[k]

        sums: dict = {}
        for where, buf in self.buffers.items():
            if ok is not None:
                buf.masked_fill_(~ok.to(buf.device).view(-1, 1), 0)
            mine = self.members[where]
            out = factors(where[0], buf).mm(buf)[0]  # (ΣP,)
            for (key, s), part in zip(mine, out.split_with_sizes([s[2] for _, s in mine])):
                if key in self.filled:
                    sums[key] = part if len(s[3]) == 1 else part.view(s[3])
        for key, g in self.loose.items():
            g = g if ok is None else masked(g, ok)  # a copy: a loose one may be the caller's
            rows = g.reshape(g.shape[0], math.prod(g.shape[1:]))  # (n, P)
            sums[key] = factors(self.group_of(key), g).mm(rows).view(g.shape[1:])
        return sums


__all__ = ["CHUNK", "SMALL", "Grouped"]
