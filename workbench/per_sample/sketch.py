"""A record's gradient compared by parameter, without holding it: random projections.

The self-check (``selfcheck.py``) compares the fast result for one record i with its exact
twin g_i. Comparing only the norm ||g_i|| is blind where the sum is not: a wrong per-sample
gradient of a *small* parameter (a relative position bias read on rows that are not the
batch's, MPNet at n = T) changes ||g_i|| by less than the tolerance, while every record's
contribution to that parameter's released sum is someone else's gradient. A check that
only sums rows (``.grad`` against Σ_i g_i) is blind too: a misattribution keeps the sum.

So the check compares, for every parameter p, the record's *vector* g_{i,p}, through fixed
random directions r_{p,1}, r_{p,2} (standard normal, from a private generator with a fixed
seed, so both sides draw the same ones and nobody's random stream moves):

    s_{p,k}(g) = ⟨g_{i,p}, r_{p,k}⟩        k = 1, 2          q_p(g) = ||g_{i,p}||²

An error δ in g_{i,p} shifts s_{p,k} by ⟨δ, r_{p,k}⟩ ~ N(0, ||δ||²): two projections and the
norm miss an error well above the tolerance with probability ~(tolerance / ||δ||)², while
only 3 numbers per parameter are kept (the model-sized g_i is not held through the batch's
backward pass, which would add a model to the first step's peak). s is linear, so the fast
side may add a parameter's parts call by call (a layer called twice); q is kept only for a
parameter seen in one part. The directions are drawn in chunks of ``CHUNK`` numbers, in the
same order on both sides, so their memory is a chunk's, whatever the parameter.

Tolerance, per parameter (``compare``): |s_f − s_e| and |√q_f − √q_e| at most
tol · (||g_{i,p}|| + ||ĝ_{i,p}||) + tol · FLOOR · ||g_i||, with tol the self-check's
(``selfcheck.TOLERANCE``: 1e-7 in float64, 1e-3 in float32, where a misattribution is off
by O(1)); the floor (relative to the whole record) leaves rounding in a parameter whose
gradient cancels to almost nothing below it.

Notation: g_{i,p} the exact gradient of record i for parameter p, ĝ the fast one, r the
directions, s projections, q squared norms.
"""

import math

import torch

SEED = 20_231_129  # the directions' seed: fixed, private (no global random state moves)
PROJECTIONS = 2
CHUNK = 2**14  # numbers of a parameter per chunk of directions (float64: 256 KiB for two)
FLOOR = 1e-2  # of the whole record's norm, per parameter (module docstring)


class RowSketch:
    """s_{p,k} and q_p of one record's gradient, accumulated from parts (module docstring);
    ``params``: {key: parameter} in a fixed order (the key is the caller's: a name or id)."""

    def __init__(self, params: dict):
        self.params = params
        self.order = {key: k for k, key in enumerate(params)}
        self.dots: dict = {}  # key -> (PROJECTIONS,) float64
        self.squares: dict = {}  # key -> float64 scalar, or None (several parts)

    def add(self, key, part: torch.Tensor) -> None:
        """Add one part of the record's gradient for parameter ``key`` (its shape)."""
        if key not in self.order:
            return
        dots, square = self._project(key, part.detach())
        if key in self.dots:
            self.dots[key] = self.dots[key] + dots
            self.squares[key] = None  # a sum of parts: its norm is not the parts' norms
        else:
            self.dots[key], self.squares[key] = dots, square

    def add_zero(self, key) -> None:
        """A parameter whose part is zero (the backward pass never reached it)."""
        if key in self.order and key not in self.dots:
            p = self.params[key]
            self.dots[key] = torch.zeros(PROJECTIONS, dtype=torch.float64, device=p.device)
            self.squares[key] = torch.zeros((), dtype=torch.float64, device=p.device)

    def _project(self, key, g: torch.Tensor):
        gen = torch.Generator(device=g.device).manual_seed(SEED + 7919 * self.order[key])
        dots = torch.zeros(PROJECTIONS, dtype=torch.float64, device=g.device)
        square = torch.zeros((), dtype=torch.float64, device=g.device)
        for chunk in g.reshape(-1).split(CHUNK):
            chunk = chunk.double()
            r = torch.randn(PROJECTIONS, chunk.numel(), generator=gen, dtype=torch.float64,
                            device=g.device)  # the same draws on both sides: same chunks
            dots += r @ chunk
            square += chunk @ chunk
        return dots, square

    @property
    def norm(self) -> float:
        """||g_i|| from the parameters' q (the exact side adds each parameter once)."""
        return math.sqrt(sum(float(q) for q in self.squares.values() if q is not None))

    def numbers(self) -> dict:
        """{key: (s_1, ..., s_K, √q or None)} as Python floats (one host sync for all)."""
        if not self.dots:
            return {}
        nan = torch.full((1,), math.nan, dtype=torch.float64)
        rows = [torch.cat([self.dots[k], nan.to(self.dots[k].device) if q is None
                           else q.sqrt().reshape(1)]) for k, q in self.squares.items()]
        values = torch.stack([r.cpu() for r in rows]).tolist()
        return {k: (*row[:-1], None if math.isnan(row[-1]) else row[-1])
                for k, row in zip(self.squares, values)}


def of(params: dict, grads: dict) -> RowSketch:
    """The sketch of a whole record's gradient ``grads`` ({key: tensor}, one part each)."""
    sketch = RowSketch(params)
    for key, g in grads.items():
        sketch.add(key, g)
    return sketch


def differences(fast: RowSketch, exact: RowSketch, tol: float, atol: float) -> list:
    """[(key, how far over the tolerance)] of the parameters whose part differs (module
    docstring), worst first; a parameter the fast side never added counts as zero."""
    got, want = fast.numbers(), exact.numbers()
    total = math.sqrt(sum((w[-1] or 0.0) ** 2 for w in want.values()))
    floor = tol * FLOOR * total + atol
    bad = []
    for key, w in want.items():
        g = got.get(key, (0.0,) * PROJECTIONS + (0.0,))
        size = (w[-1] or 0.0) + (g[-1] if g[-1] is not None else (w[-1] or 0.0))
        bound = tol * size + floor
        errors = [abs(a - b) for a, b in zip(g[:-1], w[:-1])]
        if g[-1] is not None and w[-1] is not None:
            errors.append(abs(g[-1] - w[-1]))
        worst = max(errors) / bound
        if not math.isfinite(worst) or worst > 1:
            bad.append((key, worst))
    return sorted(bad, key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)


__all__ = ["CHUNK", "FLOOR", "PROJECTIONS", "SEED", "RowSketch", "differences", "of"]
