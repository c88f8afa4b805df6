"""The loss's reduction over the records, read from the loop's own operations.

The optimizer never sees the loss; ``loss_reduction`` tells it how the loop's loss L combines
the records' terms ℓ_i, and the recorded gradient of record i is rescaled accordingly
(``recorded.py``, ``per_sample/loss.py``, Eq. 2):

    loss_reduction="mean":  L = (1/n) Σ_i ℓ_i  ->  g_i = n · ∂L/∂θ|_i
    loss_reduction="sum":   L =       Σ_i ℓ_i  ->  g_i =     ∂L/∂θ|_i

If the loop's L is not of the declared form, every g_i is scaled by a power of n before
clipping: L = Σ_i ℓ_i under "mean" releases clip(n ∇ℓ_i), L = (1/n) Σ_i ℓ_i under "sum"
releases clip(∇ℓ_i / n). n is the realised size of a Poisson batch, a statistic of which
other records were sampled: adding one record then moves every other record's clipped
contribution, and the sensitivity is no longer C (Abadi et al. 2016, arXiv 1607.00133,
Algorithm 1: ∇ℓ_i must depend on record i alone). A loss *module* with the wrong reduction is
refused by ``per_sample.loss.reduction_of``; a loss written from functions
(``F.cross_entropy(o, y, reduction="sum")``, ``per_token.sum()``, ``((o - y) ** 2).sum()``)
is followed here.

**The invariant:** the loss passed to ``backward`` averages its records' terms under "mean"
and sums them under "sum". ``RecordReduction`` follows the loss window's operations
(``loss_watch.LossFunctions``) and gives each tensor computed from the model's outputs a
*kind*:

- "sum": a loss function with ``reduction="sum"`` (or a loss module with it), or
  ``sum``/``nansum`` over the records (dim 0, or all dims) of a tensor with gradient of n·m
  rows (m rows per record);
- "mean": a loss function or module with its mean, or ``mean``/``nanmean`` over the records;
- under "mean", a "sum" divided by a *count of the batch* (n, or n times a product of a
  batch tensor's leading dims: n·T, n·T·V, the ``numel`` of the outputs) is a "mean"; under
  "sum", a "mean" multiplied by one is a "sum" (the factor applied to the records' terms
  before their reduction counts too: ``(ce_none * (1 / len(x))).sum()`` is a mean); any
  other scaling (a constant, 1 / accumulation steps) keeps the kind. The counts are matched
  by value, so a constant equal to this batch's n (B = qN when n = B) passes this step and is
  refused at a step whose n differs;
- the factor left on the loss (the product of the numbers it was multiplied and divided by,
  the count a conversion consumed excepted) must not be a function of the realised batch:
  ``realised`` refuses f equal to r, 1/r, √r, 1/√r, r/B, B/r or r1/r2 for r a count the loop
  read off a tensor this step (``len(x)``, ``x.shape[0]``, ``x.size(0)``, ``y.numel()``:
  ``count_read``, in the window and from the loader's batch to the forward pass) that is one
  of the step's record counts (this pass's n, the loader's batch), B the expected batch
  size. ``ce_mean * len(x) / B``, ``ce_mean / len(x)`` and accumulation written as
  ``ce_mean(chunk) * n_c / n`` or ``sum(chunk) / n`` released clip(f(n) g_i): one record,
  by changing n, moved every other record's term (1.1-1.9 C), silently until 2026-12-01.
  Matched by value: a constant equal to one of these values at a step where the loop read
  that count (0.5 with n = 2, 1/K with n = K) is refused at that step (the message says to
  move it into the learning rate); f = 1, B, 1/B pass as constants. A count times another
  constant (``ce * 2 * len(x) / B``, ``ce * len(x) / 64`` with B = 8) shows at no single
  step: ``across`` refuses it at the first step of a third size n while f/n^p is one
  constant over the three, p = ±1, ±1/2 (the steps before it are released); a count never
  read off a tensor (a loader's ``len(batch_list)``) passes (a limit);
- a sum of terms of different kinds is "mixed": no single factor makes both right;
- "coupled": a reduction over the records that weighs each record by the others (``PICKS``:
  a max, a top-k, a median, a norm, a cumulative sum... of the records' terms), or any
  operation on a loss of a kind other than the linear ones (``LINEAR``: adding terms,
  scaling by what does not come from the outputs, reshaping, casting): ``L.clamp(max=t)``,
  ``L ** 2``, ``1 / L``, ``torch.where(L > t, L, 0)``. Record i's gradient then depends on
  the other records' terms through a piecewise-linear function the window's second-derivative
  test cannot see (its second derivative vanishes almost everywhere): one record moved the
  update by 1.5-2.4 C / B, silently, until 2026-11-30. (A gate computed from the detached
  loss, ``L * (L.detach() < t)``, is a batch statistic: ``loss_terms.py``.)

``loss.backward()`` on a tensor whose kind is not ``loss_reduction`` raises
``LossCouplingError`` naming the term and the fix. A tensor without a kind (a loss module
with ``reduction="none"`` reduced in a way not listed, a loss the window did not see) passes,
as before. Off with the optimizer's checks (``verify=False``) and for n < 2 (n = 1: the mean
is the sum).

Notation: n records, m rows per record, T positions, V classes, ℓ_i record i's term.
"""

import math
import re
import weakref

import torch

from workbench.per_sample.batch_reductions import DIMS, reduces_dim0
from workbench.per_sample.leaves import call_leaves

SUMS = {"sum", "nansum"}
MEANS = {"mean", "nanmean"}
DIVIDE = {"div", "div_", "true_divide", "true_divide_", "__truediv__", "__itruediv__",
          "divide", "__div__", "__idiv__"}
MULTIPLY = {"mul", "mul_", "__mul__", "__rmul__", "__imul__", "multiply"}
#: reductions that, over the records, weigh each record's term by the others' (their ``dim``
#: read by ``batch_reductions.reduces_dim0``, one table for the forward pass and the loss)
PICKS = frozenset(DIMS)
#: operations that keep a loss linear in the records' terms (``after``: a product or quotient
#: only by what does not come from the model's outputs, the loss as numerator)
LINEAR = (SUMS | MEANS | DIVIDE | MULTIPLY | {
    "add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
    "__isub__", "subtract", "rsub", "neg", "neg_", "__neg__", "negative", "__pos__", "positive",
    "reshape", "reshape_as", "view", "view_as", "squeeze", "squeeze_", "unsqueeze",
    "unsqueeze_", "flatten", "ravel", "expand", "expand_as", "clone", "contiguous", "to",
    "float", "double", "half", "bfloat16", "type", "type_as", "cpu", "cuda", "stack", "cat",
    "concat", "concatenate", "hstack", "vstack", "__getitem__", "select", "narrow", "unbind",
    "split", "chunk", "t", "transpose", "permute", "movedim", "__get__", "requires_grad_",
    "retain_grad", "register_hook", "backward", "detach", "detach_", "sum_to_size"})


def _dims(args, kwargs, ndim: int) -> set[int]:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None or ndim == 0:
        return set(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return {d % ndim for d in dims if isinstance(d, int)}


def _number(v):
    """A Python number, or the value of a 0-d tensor without gradient; else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad \
            and v.device.type != "meta":
        return float(v)
    return None


class RecordReduction:
    """The kinds of one loss window (module docstring)."""

    def __init__(self):
        self.seen: dict[str, list] = {}  # what -> [(n, f)]: the loss's latest factor at
        # each of the last three sizes (``across``), kept from window to window
        self.reset(0)

    def reset(self, n: int, derived=lambda t: True, declared: str = "mean") -> None:
        """n records; ``derived(t)``: is t computed from the model's outputs?
        ``declared``: the optimizer's ``loss_reduction``."""
        self.n, self.on, self.derived, self.declared = n, n >= 2, derived, declared
        self.moved = lambda t: False  # t's dim 0 is time, not the records (loss_watch sets
        # row_mixing's: a time-major view's steps stacked, T == n)
        self.kinds: dict[int, tuple] = {}  # id -> (weakref, kind, what)
        self.counts: set[float] = {float(n)}  # n, n·T, n·T·V, ...: counts of the batch
        self.single: dict[int, tuple] = {}  # id -> (weakref, key): part of one record's row
        self.factors: dict[int, tuple] = {}  # id -> (weakref, f): a Python factor applied
        # to the loss (kinds) or to the records' terms before their reduction
        self.reads: set[int] = set()  # counts the loop read off tensors this step (len(x),
        # x.shape[0], x.size(0), y.numel()): loss_watch shares its own set
        self.records: set[int] = {n}  # the step's record counts: this pass's n, the loader's
        # batch (loss_watch.open)
        self.expected = None  # B, the optimizer's expected batch size

    def find(self, t):
        entry = self.kinds.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1:] if entry is not None and entry[0]() is t else None

    def mark(self, t, kind: str, what: str, f: float = 1.0) -> None:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            self.kinds[id(t)] = (weakref.ref(t), kind, what)
            self._factor(t, f)

    def _factor(self, t, f: float = None):
        """Set (``f`` given) or read t's factor: the product of the Python numbers the window
        multiplied it by since its reduction (or, for the records' terms, before it)."""
        if f is not None:
            if f == 1.0:
                self.factors.pop(id(t), None)
            elif isinstance(t, torch.Tensor):
                self.factors[id(t)] = (weakref.ref(t), f)
            return None
        entry = self.factors.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is t else 1.0

    def read(self, name: str, args, kwargs, out) -> None:
        """A count read off a tensor (``count_read``): kept for ``realised``."""
        r = count_read(name, args, kwargs, out)
        if r is not None:
            self.reads.add(r)

    def realised(self, f: float):
        """How factor ``f`` is a function of the realised batch, or None: f equals r, 1/r,
        √r, 1/√r, r/B, B/r or r1/r2 for r a count the loop read off a tensor this step that
        is a record count of the step (this pass's n, the loader's batch: a chunk's n_c and
        the batch's n), B the expected batch size. Matched by value, so a constant could
        equal one of these by chance (0.1 with n = 10 read by the loop's ``if len(x) == 0``):
        f = 1, B, 1/B and every round number (two significant digits or fewer: 0.1, 0.5,
        0.25, 2, 10) are taken for constants. A factor that follows n is round only at some
        sizes (1/n at n = 10, n/B at n = B/2): it is refused at the first step whose n makes
        it a number of more digits, mostly the first (the steps before it are released)."""
        reads = sorted(r for r in self.reads if r >= 2 and r in self.records)
        if not reads or not math.isfinite(f) or f <= 0:
            return None
        B = self.expected
        constants = [1.0] + ([float(B), 1.0 / B] if B else [])
        if any(math.isclose(f, c, rel_tol=1e-9) for c in constants) or _round(f):
            return None
        forms = []
        for r in reads:
            forms += [(r, f"n = {r}"), (1 / r, f"1/n = 1/{r}"), (math.sqrt(r), f"sqrt(n), n = {r}"),
                      (1 / math.sqrt(r), f"1/sqrt(n), n = {r}")]
            if B:
                forms += [(r / B, f"n/B = {r}/{B:g}"), (B / r, f"B/n = {B:g}/{r}")]
            forms += [(r / s, f"n_c/n = {r}/{s}") for s in reads if s > r]
            forms += [(s / r, f"n/n_c = {s}/{r}") for s in reads if s > r]
        return next((what for v, what in forms if math.isclose(f, v, rel_tol=1e-9)), None)

    def across(self, what: str, f: float):
        """How factor ``f`` follows the realised batch across steps, or None: the same loss
        (``what``) had, at the latest steps of two other sizes n1, n2, factors f1, f2, and
        f_k / n_k^p is one constant c over the three (n, n1, n2 distinct, each a count the
        loop read off a tensor) for p = 1, -1, 1/2 or -1/2: f is c·n, c/n, c·√n or c/√n for a
        constant c that ``realised`` cannot name (``ce * len(x) / 64`` with B = 8, ``2 *
        len(x) / B``: the value of c·n is any number, so no single step shows it; released,
        silently, until 2026-12-01). Three sizes, not two: a weight stepped once (0.5, then
        1.0) at a step whose n happened to double fits c·n over two. A constant keeps f and
        a schedule of the step (β_t) does not follow n: neither is refused. The steps before
        the third size are released."""
        n = self.n
        if n < 2 or n not in self.reads or not math.isfinite(f) or f <= 0:
            return None
        key = re.sub(r"\(\d+(, \d+)*,?\)", "(...)", what)  # (a shape names n: not the loss)
        sizes = [(k, v) for k, v in self.seen.get(key, ()) if k != n][-2:] + [(n, f)]
        self.seen[key] = sizes  # the latest factor of each of the last three sizes
        if len(sizes) < 3:
            return None
        for power, form in ((1.0, "c·n"), (-1.0, "c/n"), (0.5, "c·sqrt(n)"),
                            (-0.5, "c/sqrt(n)")):
            cs = [v / k ** power for k, v in sizes]
            if all(math.isclose(c, cs[0], rel_tol=1e-9) for c in cs[1:]):
                steps = ", ".join(f"{v:.6g} at n = {k}" for k, v in sizes)
                return f"{form} with c = {cs[-1]:.6g}: {steps}"
        return None

    def loss_call(self, name: str, reduction: str, out) -> None:
        """A loss function or module ``name`` with ``reduction`` returned ``out``."""
        if self.on and reduction in ("sum", "mean"):
            self.mark(out, reduction, f"{name}(..., reduction={reduction!r})")

    def _count(self, t: torch.Tensor) -> None:
        """The counts a batch tensor offers as a denominator: n·m · Π of leading dims, of
        the outputs' tensors or another of exactly n rows. (A loader's batch of 8 rows
        offered 8 to a loss over the k = 1 or 2 records kept of it, ``CE(model(x[keep]),
        y[keep]).sum() / len(x)``: clip(g_i k / 8) was released, silently, until
        2026-11-30.)"""
        if t.dim() and t.shape[0] and t.shape[0] % self.n == 0 and (
                t.shape[0] == self.n or self.derived(t)):
            c = 1
            for size in t.shape:
                c *= int(size)
                self.counts.add(float(c))

    def _one_row(self, t):
        entry = self.single.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _rows(self, name, args, kwargs, x, tensors, out) -> bool:
        """Follow the tensors that are one row of the records (``per[i]``, ``x.select(0,
        i)``, ``x.unbind()``, and what is computed from one such row alone): a reduction of
        one is no reduction over the records, whatever its length (a record's 8 positions
        were taken for 8 records at n = 4 or 8 until 2026-11-30). True when ``out`` is one."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if x is not None and x.dim() and self.derived(x) and x.shape[0] % self.n == 0 and (
                (name == "__getitem__" and len(args) > 1 and isinstance(
                    args[1][0] if isinstance(args[1], tuple) and args[1] else args[1], int))
                or (name == "select" and _dims(args, kwargs, x.dim()) == {0})
                or name in ("unbind", "__iter__")):
            for k, o in enumerate(outs):
                if isinstance(o, torch.Tensor):
                    self.single[id(o)] = (weakref.ref(o), (id(x), len(self.single), k))
            return True
        keys = {key for t in tensors for key in [self._one_row(t)]
                if key is not None or self.derived(t)}
        if len(keys) == 1 and None not in keys:  # one row's values alone: still that row
            for o in outs:
                if isinstance(o, torch.Tensor):
                    self.single[id(o)] = (weakref.ref(o), next(iter(keys)))
            return True
        return False

    def after(self, func, args, kwargs, out) -> None:
        """Follow one op of the window: ``out = func(*args, **kwargs)``."""
        if not self.on:
            return
        tensors = [t for t in call_leaves(args, kwargs) if isinstance(t, torch.Tensor)]
        for t in tensors:
            self._count(t)
        name = getattr(func, "__name__", "")
        self.read(name, args, kwargs, out)
        x = tensors[0] if tensors and args and args[0] is tensors[0] else None
        if x is not None and self.moved(x):
            x = None  # (a mean over time steps: no reduction over the records)
        if self._rows(name, args, kwargs, x, tensors, out):
            return  # one record's own values: no kind, no reduction over the records
        if (name in SUMS or name in MEANS) and x is not None and x.requires_grad and x.dim() \
                and x.shape[0] % self.n == 0 and 0 in _dims(args, kwargs, x.dim()) \
                and self.find(x) is None and self.derived(x):
            kind = "sum" if name in SUMS else "mean"
            what = f"{name}() over the records of a {tuple(x.shape)} tensor"
            f = self._factor(x)  # the records' terms scaled first: (ℓ * (1 / n)).sum()
            if f != 1.0:
                kind, what, f = self._convert(kind, what, f, 1.0, "terms times")
            self.mark(out, kind, what, f)
            return
        if name in PICKS and x is not None and x.requires_grad and x.dim() \
                and x.shape[0] % self.n == 0 and self.derived(x) \
                and reduces_dim0(name, args, kwargs, x):
            what = f"{name}() over the records of a {tuple(x.shape)} tensor"
            for o in out if isinstance(out, (tuple, list)) else (out,):
                self.mark(o, "coupled", what)
            return
        found = [k for t in tensors for k in [self.find(t)] if k is not None]
        if not found:
            self._scaled_terms(name, args, x, tensors, out)
            return
        kinds = {k for k, _ in found}
        kind, what = found[0]
        if "coupled" in kinds:
            kind, what = "coupled", next(w for k, w in found if k == "coupled")
        elif not self._linear(name, args, tensors):
            kind, what = "coupled", f"{name}() of {what}"
        elif len(kinds) > 1:
            kind = "mixed"
            what = " and ".join(dict.fromkeys(w for _, w in found))
        scaled = [self._factor(t) for t in tensors if self.find(t) is not None]
        f = next((g for g in scaled if self.realised(g)), scaled[0] if scaled else 1.0)
        # (terms added: a factor from the realised batch on any of them is kept)
        if kind in ("sum", "mean") and len(found) == 1 and (name in MULTIPLY or name in DIVIDE):
            value = self._operand(args, tensors)
            if value is not None:
                if name in DIVIDE:
                    kind, what, f = self._convert(kind, what, f, 1.0 / value, "divided by")
                else:
                    kind, what, f = self._convert(kind, what, f, value, "times")
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            self.mark(o, kind, what, f)

    def _convert(self, kind, what, f, v, how):
        """(kind, what, f) after a factor v: toward the declared kind only, by a count of
        this batch (n, n·T, ...): a sum times 1/n is a mean under "mean", a mean times n a
        sum under "sum", the count consumed; any other factor multiplies f. A constant that
        equals a count of this batch (B = qN when n = B) must not be refused: at another n
        it differs."""
        g = f * v
        if kind == "sum" and self.declared == "mean" and any(
                math.isclose(g * c, 1.0) for c in self.counts):
            return "mean", f"{what} {how} 1/{1 / g:g} (a mean)", 1.0
        if kind == "mean" and self.declared == "sum" and any(
                math.isclose(g, c) for c in self.counts):
            return "sum", f"{what} {how} the batch count {g:g}", 1.0
        return kind, what, g

    def _operand(self, args, tensors):
        """The number a product or quotient scales the loss (or the records' terms) by: a
        Python number, a 0-d tensor without gradient, or a tensor without gradient whose
        entries are all equal (``torch.full((n,), 1 / n)``); else None."""
        others = [a for a in args[:2] if not (isinstance(a, torch.Tensor) and (
            a.requires_grad or self.find(a) is not None))]
        if len(others) != 1:
            return None
        v = _number(others[0])
        if v is None and isinstance(others[0], torch.Tensor) and others[0].numel() \
                and not others[0].requires_grad and others[0].device.type != "meta" \
                and others[0].dtype.is_floating_point:
            o = others[0]
            lo, hi = float(o.min()), float(o.max())
            v = lo if lo == hi else None
        return v if v else None

    def _scaled_terms(self, name, args, x, tensors, out) -> None:
        """The records' terms (a tensor of the outputs without a kind) multiplied or
        divided by a number, or carried through a linear op, keep that factor to their
        reduction: ``(ce_none * (1 / len(x))).sum()`` is a mean."""
        if not isinstance(out, torch.Tensor) or not out.requires_grad or x is None:
            return
        f = self._factor(x)
        if (name in MULTIPLY or name in DIVIDE) and self.derived(x) and x.requires_grad \
                and self._linear(name, args, tensors):
            v = self._operand(args, tensors)
            if v is not None:
                self._factor(out, f * v if name in MULTIPLY else f / v)
        elif f != 1.0 and len(tensors) == 1 and name in LINEAR and name not in SUMS | MEANS:
            self._factor(out, f)

    def _linear(self, name, args, tensors) -> bool:
        """``name`` keeps a loss linear in the records' terms: a ``LINEAR`` operation, and a
        product (quotient: the loss its numerator) with one factor from the outputs."""
        if name not in LINEAR:
            return False
        if name not in MULTIPLY and name not in DIVIDE:
            return True
        from_outputs = [t for t in tensors if t.requires_grad
                        and (self.find(t) is not None or self.derived(t))]
        if name in DIVIDE:
            return all(t is args[0] for t in from_outputs)
        return len(from_outputs) <= 1

    def check(self, loss, loss_reduction: str):
        """(kind, what) of ``loss`` when it is not ``loss_reduction``, else None; ("scaled",
        what) when a factor of the realised batch scales it (``realised``)."""
        found = self.find(loss)
        if found is None:
            return None
        kind, what = found
        how = None
        if kind in ("sum", "mean"):
            how = self.realised(self._factor(loss)) or self.across(what, self._factor(loss))
        if how is not None:
            return "scaled", f"{what} scaled by {self._factor(loss):.6g} ({how})"
        if kind == loss_reduction or self.n < 2:  # (n = 1: the mean is the sum)
            return None
        return found


def _round(f: float) -> bool:
    """Whether ``f`` is a number of two significant decimal digits or fewer (0.1, 0.25, 2.5,
    10, 1200): how constants are written, so one equal to 1/n or n/B by chance is one."""
    return math.isclose(f, float(f"{f:.2g}"), rel_tol=1e-12)


#: the shape reads that return a count of a tensor's rows (``count_read``)
COUNT_READS = frozenset({"__len__", "numel", "nelement", "__get__", "size"})


def count_read(name: str, args, kwargs, out):
    """The count a shape read returns: ``len(x)``, ``x.shape`` / ``x.size()`` (their dim 0),
    ``x.size(0)``, ``x.numel()`` of a tensor of at least one dim; else None."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.dim():
        return None
    if name == "__len__" or name in ("numel", "nelement"):
        return out if isinstance(out, int) else None
    if name == "__get__" or name == "size":
        if isinstance(out, torch.Size):
            return int(out[0]) if len(out) else None
        if name == "size" and isinstance(out, int):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            return out if isinstance(dim, int) and dim % x.dim() == 0 else None
    return None


__all__ = ["COUNT_READS", "DIVIDE", "MEANS", "MULTIPLY", "SUMS", "RecordReduction", "count_read"]
