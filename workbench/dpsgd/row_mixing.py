"""Rows of two records combined: a batch partner (mixup, CutMix, x + x.roll(1, 0)).

Mixup (Zhang et al. 2018, arXiv 1710.09412) trains on x̃_i = λ x_i + (1 - λ) x_π(i) and
ỹ_i = λ y_i + (1 - λ) y_π(i), π a permutation of the batch. Record i's input then holds
record π(i)'s data: removing record j moves the gradient of the record paired with it, so
one record reaches two clipped contributions and the sensitivity is 2C, not C (the DP unit
would have to be the pair). No reduction over the records is involved, so
``loss_terms.BatchStatistics`` does not see it by itself; ``RowOrder`` follows the *order
of the rows* instead:

- a tensor whose rows are the records' in another order, ``x[π]``, ``x.index_select(0, π)``,
  ``x.roll(k, 0)``, ``x.flip(0)``, carries that order (a key: the index tensor, the shift);
- an operation keeps its first argument's order;
- an operation combining two data tensors (no gradient; in the loss window also the model's
  outputs) with the same number of rows in *different* orders mixes records: its result is
  a batch statistic (``what``). A loss pairing records (``F.margin_ranking_loss(o, o.flip(0),
  ·)``, a hinge between neighbours) is piecewise linear: the window's second-derivative test
  sees nothing, the row order does.

Reordering a batch consistently (``x[π]``, ``y[π]``, π from ``randperm``) keeps every record
whole and is not one. (An order computed from the data, ``argsort``, is a statistic of the
batch already: ``loss_terms.REDUCTIONS``.)

An order is the tuple of source rows, read from the index's values, so every spelling of
a partner index gives one: ``randperm``, ``torch.roll(torch.arange(n), 1)``, a NumPy
permutation (``torch.from_numpy``, ``torch.tensor``), a Python list (``perm.tolist()``),
orders composed (``x.roll(1, 0).roll(-1, 0)`` is the batch's own order again). Only the
first spelling was followed until 2026-11-30: the others passed mixup silently (0.27-0.58 of
the step). An index is an order only where it is a whole permutation of the rows it picks
(``w[y]``, a class weight per label, picks a table's rows: no order); a tensor index only
where the window made it (``FRESH``, or an op on such an index), or, before the forward
pass, any (``torch.from_numpy`` makes its tensor without a torch function the window sees;
so there a label tensor that happens to be a permutation of 0..n-1 picking the n rows of a
table, n = K classes, is taken for a partner index: refused, never silent). Not in the loss
window: the model's output carries no order, so ``y[perm]`` beside ``model(x[perm])`` (perm
made before the window) would be taken for a partner of the output's rows.

A partner need not come from a permutation: one drawn per record with repeats
(``x[torch.randint(0, n, (n,))]``, ``torch.multinomial``), the batch's halves
(``a, b = x.chunk(2)``, ``x[:h]`` with ``x[h:]``, ``narrow``, ``split``), neighbours by
slices (``x[1:] - x[:-1]``) or a roll spelled by ``torch.cat([x[1:], x[:1]])``: each passed
silently until 2026-11-30. A slice's rows are kept relative to the tensor it was cut from
(its *base*) and compared only with other slices of that base: a batch cut by hand from a
data set (``X[i:i + b]``) is the batch, not a partner of every fresh b rows beside it.
What is no partner (a review's finds, 2026-11-30): a draw of k values from another range
than range(k) picks a table's rows (a diffusion schedule ``alphas[t]`` beside
``alphas[t - 1]``, a noise bank, negatives from an embedding table), and a partner draw
picks a partner only in a tensor made in the window or handed out by the engine's loader
(``seen``; a table made before it is none, K == n classes or not); a stack over dim 0
joins (nanoGPT's windows of a token stream, stacked); one record's own tensor (``x[i]``,
``for r in x``) has no records on dim 0, so its slices pair none (a record's own deltas).
Left: a draw of k values from range(k) into a table of k rows made in the same window is
taken for a partner (refused, never silent).

Stop 50 (2026-11-30), each silent before: a random index of any spelling (a partner drawn
excluding the record itself, ``torch.multinomial(1 - torch.eye(n), 1)``, a shift drawn mod n,
``randint_like``, noise cast to long, a NumPy draw, ``[0] * n``) picks a partner where it
indexes a batch's k rows with k values in range(k); one record's own tensor (``x[i]``,
``for r in x``) carries which record it is (``_ident``), so mixup written as a loop over the
records, a stack of ``x[(i + 1) % n]`` or rows written one by one (``out[i] = x[j]``) are
followed, while records' own losses added (of any shape: ``LOSSY``) stay the loss's
reduction, and a sum over several records then passed through anything but a linear map
(``relu(1 - o[i] + o[j])``: ``POOLED_OK``) pairs them; a time-major view's rows are steps,
not records (``MOVES``); and an earlier batch's records mixed into this batch's
(``Earlier``: mixup with the previous batch, or an earlier micro-batch of the step; a
tensor computed from a batch, a statistic or a copy, and the model's outputs keep that
batch's group, so a running mean of earlier batches or a queue of earlier outputs is one).

Notation: n rows, π a permutation (an index tensor over dim 0).
"""

import operator
import weakref

import torch
from torch.utils._pytree import tree_flatten

REORDER = {"__getitem__", "index_select", "roll", "flip", "take_along_dim", "randperm",
           "narrow"}
CATS = {"cat", "concat", "concatenate", "vstack", "row_stack"}
"""Over dim 0 these join rows (no row holds two records'), the result taking the pieces'
orders in turn; over another dim they combine rows, like any op."""
SPLITS = {"chunk", "split", "tensor_split", "split_with_sizes", "unsafe_split",
          "unsafe_chunk"}
"""Ops returning consecutive pieces of the rows (``x.chunk(2)``: half-batch mixup's halves)."""
DRAWN = {"randint", "multinomial"}
"""Ops drawing a random index, repeats allowed. A random index (drawn, or computed from a
draw or from noise: ``(torch.arange(n) + torch.randint(1, n, (n,))) % n``,
``(torch.rand(n) * n).long()``, ``torch.multinomial(1 - torch.eye(n), 1)[:, 0]``) of k
values in range(k) picks a partner row per row of a k-row batch, though no permutation
(a partner drawn per record, excluding itself or not); of values beyond the rows, or into
a tensor of another row count, it picks a table's rows (a diffusion schedule
``alphas[t]``, a noise bank, negatives from an embedding table): ``_values`` reads them."""
STACKS = {"stack"}
"""Over dim 0 a stack makes each piece one row (nanoGPT's ``torch.stack([data[i:i + T] for i
in ix])``): no row holds two pieces' rows. Pieces that are one record each of one batch
(``torch.stack([x[(i + 1) % n] for i in range(n)])``) stack to those records' order."""


ADDS = {"add", "__add__", "__radd__", "__iadd__", "add_"}
"""Records' own losses (``LOSSY``'s results) added are the loss's reduction, no partner."""
LOSSY = {"cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
         "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
         "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss",
         "multilabel_soft_margin_loss", "multilabel_margin_loss", "multi_margin_loss",
         "hinge_embedding_loss", "cosine_embedding_loss", "triplet_margin_loss", "ctc_loss",
         "sum", "mean", "max", "min", "amax", "amin", "logsumexp", "norm",
         "linalg_vector_norm", "prod", "nansum", "nanmean"}
"""A loss function or a reduction of one record's own values: a record's loss term
(``sum(ce(o[i], y[i], reduction='none') for i ...)``: accepted, of any shape), while a
plain element of the outputs is no loss (``relu(1 - o[i] + o[j])`` pairs records)."""
POOLED_OK = {*ADDS, "sub", "__sub__", "__isub__", "sub_", "mul", "__mul__", "__rmul__",
             "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_", "neg", "__neg__",
             "sum", "mean", "detach", "item", "clone", "to", "float", "double", "type", "view",
             "reshape", "squeeze", "unsqueeze", "flatten", "__format__", "__repr__", "tolist",
             "__float__", "requires_grad_", "retain_grad", "contiguous", "cpu", "cuda", "__get__"}
"""What a sum over several records' own values may go through: linear maps (by numbers
and by no record's values) and reading it. Anything else (``relu(1 - o[i] + o[j])``, the
log of a sum) pairs the records summed: a loss coupling them, piecewise linear or not."""
MOVES = {"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"}
"""Ops that may move dim 0 away: a time-major view ``o.transpose(0, 1)`` has steps, not
records, on dim 0 (its rows pair no records, T == n or not)."""
FRESH = {"randperm", "arange", "tensor", "as_tensor", "from_numpy", "asarray"}
"""Ops whose 1-d integer output the window follows as a possible index (the loop made it)."""
FREE = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
        "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
        "normal", "eye", "new_zeros", "new_ones", "new_full", "new_empty"}
"""Ops whose output holds no record's data (noise, a mask, a zero buffer): no row order, so
a per-record mask drawn for a shuffled batch (``x[perm] * (torch.rand(n, 1) > 0.1)``) or a
one-hot written into zeros is no partner (both refused until 2026-11-30)."""


def _whole(name: str, args) -> bool:
    """``x[:] = v``, ``x[...] = v``, ``x.copy_(v)`` on a tensor that is no view: the write
    replaces every value of x, so nothing of x's own rows stays beside v's."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0]._base is not None:
        return False
    if name == "copy_":
        return True
    if name != "__setitem__" or len(args) < 2:
        return False
    key = args[1] if isinstance(args[1], tuple) else (args[1],)
    return all(k is Ellipsis or k == slice(None) for k in key)


def _values(index, fresh, m: int, whole=None, drawn=None) -> list | None:
    """An index's values as Python ints where it is a whole permutation of the m rows, else
    None: a 1-d integer tensor the window saw made (``fresh``), or (``whole``: before the
    forward pass) one no op of the window made (``torch.from_numpy``: no torch function),
    or a list or NumPy array of ints. Only a permutation: a lookup by labels (``w[y]``, the
    labels made by ``torch.tensor`` in the loader's collate) picks a table's rows, not the
    batch's, and a subset of the rows changes the row count (no partner row by row). A
    slice of the rows is their range; an index the window saw drawn at random (``drawn``:
    ``randint``, ``multinomial``) any values within the rows, repeats and a subset too (a
    partner drawn per record passed mixup silently until 2026-11-30)."""
    if isinstance(index, slice):
        return list(range(m)[index]) if m else None
    if isinstance(index, torch.Tensor) and drawn is not None and drawn(index) \
            and index.dim() in (1, 2) and index.shape[-1:] != (0,) and len(index) == m \
            and (index.dim() == 1 or index.shape[1] == 1) and not index.is_floating_point() \
            and index.dtype != torch.bool and not index.is_complex():  # (m, 1): multinomial's
        values = index.reshape(-1).tolist()
        return values if all(-m <= v < m for v in values) else None
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.shape[0] != m or index.dtype == torch.bool \
                or index.is_floating_point() or index.is_complex() \
                or not ((whole is not None and whole(index)) or fresh(index)):
            return None
        values = index.tolist()
    elif isinstance(index, list) or (type(index).__module__ == "numpy"
                                     and getattr(index, "ndim", None) == 1):
        if len(index) != m:
            return None
        values = index.tolist() if not isinstance(index, list) else index
        try:
            values = [operator.index(v) for v in values if not isinstance(v, bool)]
        except TypeError:
            return None
        if drawn is not None and len(values) == m and all(-m <= v < m for v in values):
            return values  # made in Python on the batch's rows: NumPy's draw, [0] * n
    else:
        return None
    return values if sorted(v % m if m else v for v in values) == list(range(m)) else None


def _positions(values: list):
    """The rows picked, None where they are all of them in order."""
    out = tuple(values)
    return None if out == tuple(range(len(out))) else out


def _key(rows: tuple):
    """("rows", rows), None for the batch's own order (rows 0, 1, ..., in order)."""
    return None if rows == tuple(range(len(rows))) else ("rows", rows)


def _inner_key(key, inner) -> bool:
    """The dim-0 part of an item key is one record's own value (``mu[y[i]]``)."""
    first = key[0] if isinstance(key, tuple) and key else key
    return isinstance(first, torch.Tensor) and inner(first) is not None


def _int_first(key) -> int | None:
    """The dim-0 part of an item key that is one int, ``x[i]``, ``x[i, :, 2]``, ``x[perm[i]]``
    (a 0-d integer tensor), else None."""
    first = key[0] if isinstance(key, tuple) and key else key
    if isinstance(first, torch.Tensor):  # (a 0-d uint8 index is a mask to torch)
        return int(first) if not first.dim() and not first.is_floating_point() \
            and first.dtype not in (torch.bool, torch.uint8) and not first.is_complex() \
            else None
    if isinstance(first, bool) or first is None or isinstance(first, (slice, list, tuple)):
        return None
    try:
        return operator.index(first)  # (an int, a NumPy integer)
    except TypeError:
        return None


def _has(table: dict, t) -> bool:
    """t is in ``table`` (id -> weak reference): the id's tensor itself, not a reused id."""
    ref = table.get(id(t))
    return ref is not None and ref() is t


def _moves0(name: str, args, kwargs, ndim: int) -> bool:
    """``name(*args)`` (``MOVES``) moves dim 0 of its ndim-dim input away."""
    rest = args[1:]
    if name == "t":
        return ndim == 2
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        dims = kwargs.get("dims", dims)
        return bool(dims) and isinstance(dims[0], int) and not _is0(dims[0], ndim)
    if name in ("movedim", "moveaxis"):
        ends = [kwargs.get("source", rest[0] if rest else None),
                kwargs.get("destination", rest[1] if len(rest) > 1 else None)]
        return any(_is0(d, ndim) for e in ends
                   for d in (e if isinstance(e, (tuple, list)) else (e,)))
    dims = [kwargs.get("dim0", rest[0] if rest else None),
            kwargs.get("dim1", rest[1] if len(rest) > 1 else None)]
    return any(_is0(d, ndim) for d in dims)  # transpose, swapaxes, swapdims


def moved_to(name: str, args, kwargs, ndim: int, at: int) -> int | None:
    """Where ``name(*args)`` (``MOVES``) puts the dim now at ``at`` of its ndim-dim input
    (None: not told)."""
    rest = args[1:]

    def norm(d):
        return d % ndim if isinstance(d, int) and not isinstance(d, bool) and ndim else None
    if name == "t":
        return 1 - at if ndim == 2 else at
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        dims = [norm(d) for d in kwargs.get("dims", dims)]
        return dims.index(at) if at in dims else None
    if name in ("movedim", "moveaxis"):
        src = kwargs.get("source", rest[0] if rest else None)
        dst = kwargs.get("destination", rest[1] if len(rest) > 1 else None)
        src = [norm(d) for d in (src if isinstance(src, (tuple, list)) else (src,))]
        dst = [norm(d) for d in (dst if isinstance(dst, (tuple, list)) else (dst,))]
        if None in src or None in dst or len(src) != len(dst):
            return None
        if at in src:
            return dst[src.index(at)]
        order = [d for d in range(ndim) if d not in src]  # the others keep their order
        free = [d for d in range(ndim) if d not in dst]
        return free[order.index(at)]
    a = norm(kwargs.get("dim0", rest[0] if rest else None))
    b = norm(kwargs.get("dim1", rest[1] if len(rest) > 1 else None))
    if a is None or b is None:
        return None
    return b if at == a else a if at == b else at  # transpose, swapaxes, swapdims


def _leading_new_dims(name: str, args, kwargs, ndim: int) -> int:
    """How many new dims ``name(*args)`` puts before dim 0 (``x[None]``, ``x[None, :, None]``,
    ``x[None, ...]``, ``x.unsqueeze(0)``), 0 if none or not told."""
    if name == "unsqueeze":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return int(isinstance(dim, int) and not isinstance(dim, bool) and (
            dim == 0 or dim == -(ndim + 1)))
    if name != "__getitem__" or len(args) < 2 or ndim < 1:
        return 0
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    lead = 0
    for item in index:
        if item is not None:
            break
        lead += 1
    rest = index[lead:]
    if not lead or not rest:  # (``x[None]``: the whole tensor behind one new dim)
        return lead
    first = rest[0]
    return lead if first is Ellipsis or (isinstance(first, slice) and first == slice(None)) \
        else 0


def _ndim(args) -> int:
    """The first tensor argument's (or first piece's) number of dims, 0 if none."""
    first = args[0] if args else None
    if isinstance(first, (tuple, list)) and first:
        first = first[0]
    return first.dim() if isinstance(first, torch.Tensor) else 0


def _is0(dim, ndim: int) -> bool:
    """``dim`` names dim 0 (``-ndim`` too: ``x.roll(1, -2)`` of a 2-d x)."""
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and (
        dim == 0 or (ndim > 0 and dim == -ndim))


def _dim0(name: str, args, kwargs, default=0) -> bool:
    """The op works on dim 0 (``cat``'s, ``chunk``'s, ``narrow``'s ``dim``)."""
    at = {"narrow": 1, "cat": 1, "concat": 1, "concatenate": 1, "stack": 1,
          "unbind": 1, "select": 1}.get(name, 2)
    if name in ("vstack", "row_stack"):
        return True
    dim = kwargs.get("dim", kwargs.get("axis", args[at] if len(args) > at else default))
    return _is0(dim, _ndim(args) + (1 if name in STACKS else 0))


def _order(name: str, args, kwargs, m: int, fresh, whole=None, drawn=None):
    """The rows of its first argument's m rows that ``name(*args)`` takes, in turn
    (positions), None for all of them in order, ``False`` for no reordering (the first
    argument's order is kept). ``z[torch.arange(n), y]`` picks each record's own entry:
    the batch's own order (the caller composes the positions with the argument's order)."""
    index = None
    if name == "narrow" and _dim0(name, args, kwargs) and len(args) > 3 \
            and isinstance(args[2], int) and isinstance(args[3], int):
        index = slice(args[2] % m if m else 0, (args[2] % m if m else 0) + args[3])
    if name == "__getitem__" and len(args) > 1:
        index = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        index = list(index) if isinstance(index, range) else index
    elif name == "index_select" and _is0(kwargs.get("dim", args[1] if len(args) > 1 else None),
                                         _ndim(args)):
        index = kwargs.get("index", args[2] if len(args) > 2 else None)
    elif name == "take_along_dim" and _is0(kwargs.get("dim", args[2] if len(args) > 2
                                                      else None), _ndim(args)):
        index = args[1]
    if index is not None:
        values = _values(index, fresh, m, whole, drawn)
        if values is None:
            return False
        positions = tuple(v % m for v in values)
        return None if positions == tuple(range(m)) else positions
    if name == "roll":
        dims = kwargs.get("dims", args[2] if len(args) > 2 else None)
        shifts = kwargs.get("shifts", args[1] if len(args) > 1 else None)
        if _is0(dims, _ndim(args)) and m:
            k = shifts[0] if isinstance(shifts, (tuple, list)) else shifts
            if isinstance(k, int):
                return _positions([(i - k) % m for i in range(m)])
    if name == "flip":
        dims = kwargs.get("dims", args[1] if len(args) > 1 else None)
        if _is0(dims, _ndim(args)):
            return _positions(list(range(m - 1, -1, -1)))
    return False


RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel"}
REPEATS = {"repeat", "tile", "repeat_interleave"}


def _index_values(index, m: int) -> list | None:
    """Any integer index's values over m rows (a 1-d tensor, list, range or NumPy array, each
    value in range(-m, m)), else None: a mask, a slice, a 2-d index."""
    if isinstance(index, range):
        index = list(index)
    if isinstance(index, torch.Tensor):
        if index.dim() != 1 or index.dtype in (torch.bool, torch.uint8) \
                or index.is_floating_point() or index.is_complex():
            return None
        values = index.tolist()
    elif isinstance(index, list) or (type(index).__module__ == "numpy"
                                     and getattr(index, "ndim", None) == 1
                                     and getattr(index, "dtype", None) is not None
                                     and index.dtype.kind in "iu"):
        values = index.tolist() if not isinstance(index, list) else index
        if any(isinstance(v, bool) for v in values):
            return None
        try:
            values = [operator.index(v) for v in values]
        except TypeError:
            return None
    else:
        return None
    return values if all(-m <= v < m for v in values) else None


def _repeated(name: str, args, kwargs, m: int) -> tuple | None:
    """The positions ``name(*args)`` takes of its first argument's m rows where it takes one
    row more than once (``x[[0, 0, 1]]``, ``x.index_select(0, idx)`` with repeats,
    ``x.repeat(2, 1)``, ``x.repeat_interleave(2, 0)``), else None: each record behind one row
    of the model's input (``LossWatch.forward_begins``). A filter, a slice, a permutation
    take none twice."""
    values = None
    if name == "__getitem__" and len(args) > 1:
        key = args[1]
        if isinstance(key, tuple):
            if not key or any(isinstance(k, (torch.Tensor, list)) or type(k).__module__
                              == "numpy" for k in key[1:]):
                return None  # (z[arange(n), y]: an advanced index over several dims)
            key = key[0]
        values = _index_values(key, m)
    elif name == "index_select" and _is0(kwargs.get("dim", args[1] if len(args) > 1
                                                   else None), _ndim(args)):
        values = _index_values(kwargs.get("index", args[2] if len(args) > 2 else None), m)
    elif name in ("repeat", "tile") and len(args) > 1:
        reps = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) \
            else args[1:]
        reps = kwargs.get("repeats", kwargs.get("dims", reps))
        ndim = _ndim(args)
        if isinstance(reps, (tuple, list, torch.Size)) and all(isinstance(r, int) for r in reps) \
                and len(reps) >= ndim and ndim:
            k = reps[len(reps) - ndim]  # (the factor over dim 0 of the input)
            values = list(range(m)) * k if k > 1 else None
    elif name == "repeat_interleave" and len(args) > 1:
        reps = kwargs.get("repeats", args[1])
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
        if isinstance(reps, int) and reps > 1 and _is0(dim, _ndim(args)):
            values = [i for i in range(m) for _ in range(reps)]
    if values is None or len(set(v % m for v in values)) == len(values):
        return None
    return tuple(v % m for v in values)


def _op(name: str, args) -> str:
    """How a loop spells ``name`` on a batch x, for a message."""
    if name == "__getitem__":
        return "x[index] with an index that repeats rows (x[torch.randint(0, n, (n,))], " \
            "x[torch.multinomial(w, n, replacement=True)], a list with repeats)"
    if name in CATS:
        return f"torch.{name}() of pieces holding the same records (torch.cat([x[:h], x[:h]]))"
    return f"{name}() over dim 0"


def repeats(key) -> int:
    """The most rows of one record in a key's rows (1: each record once, or no key)."""
    rows = key[1] if key is not None and key[0] == "rows" else \
        key[3] if key is not None and key[0] == "of" else ()
    counts: dict = {}
    for r in rows:
        counts[r] = counts.get(r, 0) + 1
    return max(counts.values(), default=1)


class Earlier:
    """The records' tensors of earlier batches: the batches the engine's loader (or the
    user's, ``watch_loader``) handed out, each a group, and the inputs of the model's
    training passes. Mixup with the previous batch (``0.7 * x + 0.3 * x_prev``) pairs a
    record of this step with one of an earlier step (or, accumulating, of an earlier batch
    of this step): that record then reaches a step it was not sampled for. The *current*
    group is the one the last training pass's inputs came from (a loop that draws its
    batches ahead, ``list(loader)``, trains on an earlier-drawn one), else the last handed
    out. Each window's ``RowOrder`` reads it; weak references only."""

    def __init__(self):
        self.table: dict[int, tuple] = {}  # id -> (weakref, group): a handed-out batch's
        # tensors (group >= 1), an earlier pass's inputs (group 0)
        self.inputs: dict[int, weakref.ref] = {}  # the latest training pass's inputs
        self.group = self.current = 0
        self.storages: set[int] = set()  # the data set's tensors' storages (``data_set``)

    def data_set(self, dataset) -> None:
        """The loader's data set: its tensors' storages, where it holds them (a
        ``TensorDataset``, a ``Subset`` of one), so a record of it joined to the batch by the
        loop (an anchor, a prototype record in every batch) is told from the batch's rows."""
        for _ in range(4):
            tensors = getattr(dataset, "tensors", None)
            if isinstance(tensors, (tuple, list)):
                self.storages = {t.untyped_storage().data_ptr() for t in tensors
                                 if isinstance(t, torch.Tensor) and t.numel()}
                return
            dataset = getattr(dataset, "dataset", None)
            if dataset is None:
                return

    def of_data_set(self, t) -> bool:
        """t views a tensor of the data set (a record taken from it by the loop)."""
        return bool(self.storages) and t.numel() > 0 \
            and t.untyped_storage().data_ptr() in self.storages

    def _prune(self) -> None:
        if len(self.table) > 256:
            self.table = {k: e for k, e in self.table.items() if e[0]() is not None}

    def handed(self, batch) -> None:
        """The engine's loader hands out ``batch``: the current group from now on."""
        self._prune()
        self.group += 1
        self.current = self.group
        for t in tree_flatten(batch)[0]:
            if isinstance(t, torch.Tensor) and t.dim():
                self.table[id(t)] = (weakref.ref(t), self.group)

    def derive(self, tensors, out) -> None:
        """``out`` computed from ``tensors``: of their group where they have one (``x.float()``
        trained on, ``x.clone()`` kept for the next step's mixup, silent until 2026-11-30)."""
        groups = {e[1] for t in tensors for e in [self.table.get(id(t))]
                  if e is not None and e[1] and e[0]() is t}
        if groups:  # (several: the earliest, whose records it holds beside the others')
            g = min(groups)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dim():
                    self.table[id(t)] = (weakref.ref(t), g)

    def outputs(self, tensors) -> None:
        """The model's outputs of a training pass: of the current group (their detached copies
        kept for a later step, a MoCo queue, are an earlier batch's there)."""
        if self.current:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.dim():
                    self.table[id(t)] = (weakref.ref(t), self.current)

    def fed(self, inputs) -> None:
        """A training pass of the model begins on ``inputs``: their group is the current
        one; the last pass's inputs are an earlier batch's."""
        self._prune()
        for k, ref in self.inputs.items():
            if ref() is not None and k not in self.table:
                self.table[k] = (ref, 0)
        self.inputs, groups = {}, []
        for t in tree_flatten(inputs)[0]:
            if isinstance(t, torch.Tensor) and t.dim():
                entry = self.table.get(id(t))
                if entry is not None and entry[0]() is t and entry[1]:
                    groups.append(entry[1])
                elif entry is not None:
                    del self.table[id(t)]  # (fed again: this pass's)
                self.inputs[id(t)] = weakref.ref(t)
        if groups:  # the newest batch among the inputs (a state carried beside it is older)
            self.current = max(groups)

    def holds(self, t, before: bool) -> bool:
        """t is an earlier batch's: before the forward pass also the last pass's inputs (the
        next batch is being prepared), after it not (they are this pass's)."""
        entry = self.table.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1] != self.current
        ref = self.inputs.get(id(t)) if before else None
        return ref is not None and ref() is t

    def now(self, t) -> bool | None:
        """t is of the current group (None: no group was handed out, a loop by hand)."""
        if not self.group:
            return None
        entry = self.table.get(id(t))
        return entry is not None and entry[0]() is t and entry[1] == self.current


class RowOrder:
    """The row orders of a window's data tensors (module docstring)."""

    def __init__(self, whole: bool = False, earlier: Earlier | None = None):
        self.whole = whole  # before the forward pass: a whole permutation is an index too
        self.earlier = earlier
        self.old: dict[int, weakref.ref] = {}  # id -> weakref: computed from an earlier
        # batch's tensors in this window (x_prev[:n], x_prev.flip(-1))
        self.cur: dict[int, weakref.ref] = {}  # id -> weakref: computed from the current
        # batch's (Earlier.now)
        self.moved: dict[int, weakref.ref] = {}  # id -> weakref: dim 0 moved away (MOVES)
        self.at: dict[int, int | None] = {}  # id -> the records' dim of a moved tensor
        self.steps: dict[int, weakref.ref] = {}  # id -> weakref: a time step of such
        self.losses: dict[int, weakref.ref] = {}  # id -> weakref: a record's loss (LOSSY)
        self.pooled: dict[int, weakref.ref] = {}  # id -> weakref: a sum over several
        # records' own values (POOLED_OK)
        self.keys: dict[int, tuple] = {}  # id -> (weakref, ("rows", source rows))
        self.indices: dict[int, tuple] = {}  # id -> (weakref, drawn): indices the window made
        self.free: dict[int, weakref.ref] = {}  # id -> weakref: tensors of no record (FREE)
        self.bases: dict[int, torch.Tensor] = {}  # id -> a tensor slices were cut from
        self.seen: dict[int, weakref.ref] = {}  # id -> weakref: made in the window (or the
        # engine's batch): a partner draw picks its rows, a table's made before it are no
        # batch (``alphas[t]``, K == n classes)
        self.inner: dict[int, tuple] = {}  # id -> (weakref, ident): one record's (x[i]): its
        # dim 0 holds no records, slicing it pairs none (a record's own deltas)
        self.records = frozenset()  # the row counts of the records the last mix combined
        self.writes: dict[int, tuple] = {}  # id -> (weakref, space, rows): records written
        # row by row (out[i] = x[j]), None for a row not written yet
        self.how: dict[int, tuple] = {}  # id -> (weakref, op): the op that took a record
        # twice into a key's rows (before the forward pass: ``one_row``)
        self.extra: dict[int, tuple] = {}  # id -> (weakref, what): rows of the data set
        # the loop joined to the batch (``one_row``)
        self.regrouped: dict[int, tuple] = {}  # id -> (weakref, op, n, numel): dim 0 cut
        # across the n records of a batch of numel values (``one_row``)

    def key(self, t):
        entry = self.keys.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _free(self, t) -> bool:
        return _has(self.free, t)

    def made(self, t) -> bool:
        """t is an index the loop made (``FRESH``, ``DRAWN``, or computed from such): no
        data, so its ``argsort`` (a permutation inverted) is no statistic of the batch."""
        entry = self.indices.get(id(t))
        return entry is not None and entry[0]() is t

    def drawn(self, t) -> bool:
        """t is an index the loop drew at random (``DRAWN``, or computed from such)."""
        return self.made(t) and self.indices[id(t)][1]

    def after(self, name: str, args, kwargs, tensors, out, ours=None) -> str | None:
        """Follow ``out = name(*args, **kwargs)`` (``_after``); before the forward pass also
        the rows that hold one record twice and those cut across records (``one_row``)."""
        what = self._after(name, args, kwargs, tensors, out, ours)
        if self.whole and tensors and isinstance(tensors[0], torch.Tensor):
            self._rows_followed(name, args, tensors, out)
        return what

    def _rows_followed(self, name, args, tensors, out) -> None:
        """Name the op behind a key holding a record twice (``how``, carried while the key
        holds it), and follow a reshape that moves dim 0 across records (``regrouped``:
        ``x.reshape(-1)[:k * L].view(k, L)``, packing), until a reshape back to whole records."""
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim()]
        before = next((e for t in tensors for e in [self.how.get(id(t))]
                       if e is not None and e[0]() is t), None)
        for t in outs:
            if repeats(self.key(t)) > 1:
                self.how[id(t)] = (weakref.ref(t), before[1] if before is not None else
                                   _op(name, args))
        first = tensors[0]
        extra = next((e for t in tensors for e in [self.extra.get(id(t))]
                      if e is not None and e[0]() is t and t.dim()
                      and len(outs) == 1 and outs[0].shape[0] == t.shape[0]), None)
        if extra is not None:
            self.extra[id(outs[0])] = (weakref.ref(outs[0]), extra[1])
        elif name in CATS and _dim0(name, args, {}) and len(outs) == 1 \
                and self.earlier is not None and self.earlier.storages:
            pieces = [t for t in tensors if t.dim()]
            stray = [t for t in pieces if self.earlier.of_data_set(t)
                     and not self._batchlike(t, None)]
            if stray and any(self._batchlike(t, None) for t in pieces):
                self.extra[id(outs[0])] = (weakref.ref(outs[0]), (
                    f"torch.{name}() of the batch with {int(stray[0].shape[0])} row(s) taken "
                    f"from the training set by the loop ({tuple(stray[0].shape)}, not drawn "
                    f"by the sampler)"))
        cut = next((e for t in tensors for e in [self.regrouped.get(id(t))]
                    if e is not None and e[0]() is t), None)
        if cut is not None:
            if name in RESHAPES and len(outs) == 1 and int(outs[0].shape[0]) == cut[2] \
                    and outs[0].numel() == cut[3]:
                return  # (whole records again: x.reshape(-1).view(n, -1))
            for t in outs:
                self.regrouped[id(t)] = (weakref.ref(t), *cut[1:])
        elif name in RESHAPES and first.dim() and not self._moved(first) \
                and self.earlier is not None and self.earlier.group \
                and self._batchlike(first, None) and isinstance(out, torch.Tensor) \
                and (not out.dim() or out.shape[0] != first.shape[0]) and first.shape[0] >= 2:
            # (only a batch a loader handed out: by hand, any tensor the window made is
            # "the batch", and data made as (n T, D) then viewed (n, T, D) is no packing)
            what = f"{name}() of a {tuple(first.shape)} tensor of the batch into " \
                f"{tuple(out.shape)}"
            self.regrouped[id(out)] = (weakref.ref(out), what, int(first.shape[0]),
                                       first.numel(), out.numel() // max(
                                           int(out.shape[0]) if out.dim() else 1, 1))

    def one_row(self, t) -> str | None:
        """Why the model's input t is not one row per record, else None: a record behind k
        rows (an index with repeats, overlapping pieces joined, a repeat), or rows cut
        across records (a reshape of dim 0), or the records moved off dim 0 (k = 0)."""
        if not isinstance(t, torch.Tensor) or not t.dim():
            return None
        if self._moved(t) and self._batchlike(t, None):  # (``model(x.t())``, a sequence-
            # first loop: each time step was clipped as a record, silently, until 2026-12-01;
            # one record moved the released sum by T·C)
            at = self.records_dim(t)
            return ("its records were moved off dim 0 (a sequence-first view: x.t(), "
                    "x.transpose(0, 1), x.permute(1, 0, ...)"
                    + ("" if at is None else f"; the records are on its dim {at}")
                    + "), so each row the model sees holds a value of every record, and the "
                    "engine, which takes dim 0 of the model's input as the records, would clip "
                    "each such row as one record", 0)
        key = self.key(t)
        base = self.bases.get(key[1]) if key is not None and key[0] == "of" else None
        k = repeats(key) if key is None or key[0] == "rows" or (
            base is not None and self._batchlike(base, None)) else 1  # (rows of a table
        # made before the window, a class mean looked up per record: no batch's)
        if k > 1:
            entry = self.how.get(id(t))
            how = entry[1] if entry is not None and entry[0]() is t else "an op of the loop"
            return (f"its rows were rebuilt from the batch's by {how}, which takes a record "
                    f"{k} times", k)
        entry = self.extra.get(id(t))
        if entry is not None and entry[0]() is t:
            return (f"its rows join {entry[1]}: such a record is in every step the loop "
                    f"joins it to, while the accountant charges it at the sampling rate q, as "
                    f"any other record (its real epsilon is that of q = 1)", 1)
        entry = self.regrouped.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        n, numel, width = entry[2], entry[3], entry[4]  # (width: a row's values where the
        # cut was made; a later pad or slice keeps its rows, not their length)
        size = numel // max(n, 1)
        k = max((((j + 1) * size - 1) // width - (j * size) // width + 1
                 for j in range(n)), default=1) if size and width else 1
        return (f"its rows were cut across the records by {entry[1]} (records joined and cut "
                f"into rows of another length: packing), so a record's values sit in up to "
                f"{k} rows and every later row moves when it is removed", max(k, 2))

    def _after(self, name: str, args, kwargs, tensors, out, ours=None) -> str | None:
        """Follow ``out = name(*args, **kwargs)``; ``what`` when it mixes two records.
        ``ours(t)``: t is computed from the model's outputs (in the loss window), a record's
        own values although it carries gradient."""
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim():
                self.seen[id(t)] = weakref.ref(t)
        if tensors and isinstance(tensors[0], torch.Tensor):
            self._time_major(name, args, kwargs, tensors, out)
        if self.earlier is not None and tensors:
            if any(self._old(t) for t in tensors):
                mixed = self._with_earlier(name, args, kwargs, tensors, out, ours)
                if mixed is not None:
                    return mixed
            elif any(self._now(t) for t in tensors):
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.cur[id(t)] = weakref.ref(t)
        if isinstance(out, torch.Tensor) and out.dim() in (1, 2) \
                and not out.is_floating_point() and out.dtype != torch.bool \
                and not out.is_complex() and (out.dim() == 1 or name in DRAWN) and (
                    name in FRESH or name in DRAWN or name in FREE
                    or (tensors and all(self.made(t) or self._free(t) for t in tensors))):
            random = name in DRAWN or name in FREE or any(  # (a coin per record too)
                self.drawn(t) or self._free(t) for t in tensors)
            self.indices[id(out)] = (weakref.ref(out), random)  # an index the loop made, or
            if name in DRAWN or name in FREE or (  # one computed from such: not data
                    tensors and all(self._free(t) for t in tensors)):
                self.free[id(out)] = weakref.ref(out)
            return None
        if (name == "unbind" or name == "__iter__") and tensors and tensors[0].dim() \
                and _dim0(name, args, kwargs, 0):  # a record each (``for r in x``)
            if self.made(tensors[0]):  # the positions of an index (``for j in perm``)
                return None
            batch = self._batchlike(tensors[0], ours)
            for i, t in enumerate(tree_flatten(out)[0]):
                if isinstance(t, torch.Tensor):
                    self._one(t, self._inner(tensors[0]) or self._ident(tensors[0], i, batch))
            return None
        if name in SPLITS and tensors and tensors[0].dim() and _dim0(name, args, kwargs):
            self._pieces(tensors[0], out)
            return None
        into = (name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))) \
            and bool(tensors) and self._free(tensors[0]) \
            and not all(self._free(t) for t in tensors[1:])  # records' data written into a
        if into:  # tensor of none (a one-hot by scatter_ into zeros): data now, in the
            self.free.pop(id(tensors[0]), None)  # order of what was written
        if name in FREE or (tensors and all(self._free(t) for t in tensors)) or (
                name in REORDER and tensors and self._free(tensors[0])):  # (bank[idx])
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.free[id(t)] = weakref.ref(t)
            return None
        if _whole(name, args):  # x takes v's order, nothing of x's own is left
            src = args[2] if name == "__setitem__" and len(args) > 2 else \
                args[1] if len(args) > 1 else None
            key = self.key(src) if isinstance(src, torch.Tensor) else None
            if key is None:
                self.keys.pop(id(args[0]), None)
            else:
                self.keys[id(args[0])] = (weakref.ref(args[0]), key)
            return None
        first = tensors[0] if tensors else None  # torch.cat([a, b], 1): the list's first
        if first is None:
            return None
        joins = (name in CATS or name in STACKS) and _dim0(name, args, kwargs)
        if name not in REORDER and not joins:  # data of one row count in two orders: mixed
            data = [t for t in tensors if (not t.requires_grad or (ours and ours(t)))
                    and t.dim() and t.shape[0] >= 2 and not self._free(t)
                    and not (into and t is tensors[0])]
            mixed = self._neighbours(name, args, kwargs, tensors, data) \
                or self._records_combined(name, tensors, ours, into)
            if mixed is not None:
                return mixed
            # (``where(mask, x[perm], x)``: the mask comes first, one row, so its rows were
            # the only ones compared)
            for rows in {t.shape[0] for t in data}:
                same = [t for t in data if t.shape[0] == rows]
                records = self._mixed(same) if len(same) >= 2 else frozenset()
                if records:
                    self.records = records
                    shape = next(tuple(t.shape) for t in same if self.key(t) is not None)
                    return (f"{name}() of rows of two different records (a batch partner, "
                            f"x[perm], x.roll(k, 0), x[torch.randint(0, n, (n,))] or another "
                            f"slice of the batch, x[:h] beside x[h:], as in mixup or CutMix) "
                            f"of a {shape} tensor")
            if self._record_written(name, args, into):
                return None
            if into:
                keys = {self.key(t) for t in data if t.shape[0] == tensors[0].shape[0]}
                if len(keys) == 1 and None not in keys:
                    self.keys[id(tensors[0])] = (weakref.ref(tensors[0]), keys.pop())
                return None
        if joins:
            pieces = args[0] if args else kwargs.get("tensors", ())
            if not self._records_joined(name, pieces, out):
                if name in STACKS:
                    if isinstance(out, torch.Tensor):
                        self._set(out, None)
                else:
                    self._joined(pieces, out)
            return None
        one = self._inner(first) or (  # a scalar or noise times one record's: its still
            (not first.dim() or self._free(first)) and not into and self._own(tensors, ours))
        if one:  # one record's own rows: reordered or sliced, still its own
            owns = [t for t in tensors if self._inner(t) is not None]
            lossy = name in LOSSY or (owns and all(self._loss(t) for t in owns))
            pooled = any(self._pooled(t) for t in tensors) or (
                name in ADDS and len({self._inner(t)[:2] for t in owns}) > 1)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._one(t, one)
                    if lossy:
                        self.losses[id(t)] = weakref.ref(t)
                    if pooled:
                        self.pooled[id(t)] = weakref.ref(t)
            return None
        if not first.dim():
            return None
        m = int(first.shape[0])
        batch = self._batchlike(first, ours)  # rows a draw may pair
        at = _int_first(args[1]) if name == "__getitem__" and len(args) > 1 else \
            _int_first(args[2]) if name == "select" and len(args) > 2 \
            and _is0(args[1], first.dim()) else None
        if at is not None and not self.made(first):  # (perm[i] is a position, no record's)
            ident = (("looked up", id(out)), 0, frozenset(), None, False) \
                if _inner_key(args[1], self._inner) else self._ident(first, at, batch)
            for t in tree_flatten(out)[0]:  # (mu[y[i]]: a table's row, by a record's value,
                if isinstance(t, torch.Tensor):  # no record of mu's) x[i]: one record's (a
                    self._one(t, ident)  # row of a batch is not told from a table's row: x
                    # + c * x[0] is left; refusing it refused every per-record loop,
                    # out[i] = aug(x[i]), ce(o[i], y[i], weight=w): a review)
        new = _order(name, args, kwargs, m, self.made, self._unseen if self.whole else None,
                     self.drawn if batch else None)
        if new is False and self.whole and self.earlier is not None and self.earlier.group \
                and self._now(first):  # (before the forward pass, a loader's batch: a record
            new = _repeated(name, args, kwargs, m) or False  # picked twice, x[[0, 0, 1]];
            # in a loop by hand a table made in the window, w[y], is not told from a batch)
        # (positions in first's rows: a slice, a permutation, a drawn partner)
        key = self.key(first) if new in (False, None) else self._sub(first, new)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() and (
                    t.shape[0] == m or new not in (False, None)):
                self._set(t, key)
        return None

    def handed(self, batch) -> None:
        """The engine loader's batch, handed out before the window: the batch's tensors."""
        for t in tree_flatten(batch)[0]:
            if isinstance(t, torch.Tensor) and t.dim():
                self.seen[id(t)] = weakref.ref(t)

    def derive(self, name: str, tensors, out) -> None:
        """``out`` computed from ``tensors`` (``BatchStatistics.after``, every op, statistics'
        too): of their loader batch's group (``Earlier.derive``); a tensor made from a
        batch's shape (``ones_like(x)``) holds no record's values."""
        if self.earlier is not None and tensors and name not in FREE \
                and not all(self._free(t) for t in tensors):
            self.earlier.derive(tensors, out)

    def _now(self, t) -> bool:
        """t is the current batch's (``Earlier.now``), or computed from it in this window."""
        ref = self.cur.get(id(t))
        return (ref is not None and ref() is t) or bool(self.earlier.now(t))

    def _old(self, t) -> bool:
        """t is an earlier batch's (``Earlier``), or computed from one in this window."""
        ref = self.old.get(id(t))
        return (ref is not None and ref() is t) or self.earlier.holds(t, self.whole)

    def _with_earlier(self, name, args, kwargs, tensors, out, ours) -> str | None:
        """An earlier batch's tensor combined with this batch's data (mixup with the
        previous batch, silent until 2026-11-30): ``what``; else its result is an earlier
        batch's too (a join over dim 0 keeps its pieces apart: a replay is no mix)."""
        if (name in CATS or name in STACKS) and _dim0(name, args, kwargs):
            return None
        if name in REORDER and self._old(tensors[0]):  # (x_prev[mask]: picked, not mixed)
            tensors = tensors[:1]
        loop = self.earlier.now(tensors[0]) is None  # by hand: any data the window saw
        now = [t for t in tensors if not self._old(t) and t.dim() and not self._free(t)
               and not self.made(t) and (not t.requires_grad or bool(ours and ours(t)))
               and (self._now(t) or bool(ours and ours(t)) or (loop and self._seen(t)))]
        if now:
            self.records = frozenset(int(t.shape[0]) for t in now)
            return (f"{name}() of an earlier batch's records (a tensor the model ran on in an "
                    f"earlier pass, or a batch the loader handed out before: mixup with the "
                    f"previous batch, or the same records forwarded again as another view) "
                    f"with a {tuple(now[0].shape)} tensor of this batch: rows of two different "
                    f"records combined, or one record behind two passes of the step")
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.old[id(t)] = weakref.ref(t)
        return None

    def _unseen(self, t) -> bool:
        """Before the forward pass, an index no op of the window made (``torch.from_numpy``
        is no torch function): a permutation may be one. A tensor the window saw made by
        another op (a slice of the labels, a collate's stack) is data: labels that happen
        to be a permutation of a table's rows (K == n classes, a micro-batch of 3) are no
        partner (refused until 2026-11-30)."""
        return not self._seen(t)

    def _seen(self, t) -> bool:
        return _has(self.seen, t)

    def _inner(self, t):
        """t's ident (``_ident``) where t is one record's (x[i]), else None."""
        entry = self.inner.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _one(self, t, ident) -> None:
        self.inner[id(t)] = (weakref.ref(t), ident)

    def _ident(self, t, i: int, batch: bool) -> tuple:
        """Which record ``t[i]`` is: (space, row, row counts, also, keyed). Rows of a batch (the
        loader's, or the outputs) in any order share the space ("rows", m), so ``o[i]`` and
        ``y[i]`` are one record and ``x[i]`` beside ``x[j]`` two; a slice of a data set its
        base's rows, and ``also`` its place in the slice as the batch's (("rows", m), i),
        for a permutation of it (``x.roll(1, 0)``: ``keyed``, its rows reordered; a table
        made in a loop by hand is not, K == n or not); any other tensor its own rows; a
        time-major view (``MOVES``) none: each of its rows a space of its own."""
        m = int(t.shape[0])
        i %= max(m, 1)
        if self._moved(t):
            return ("moved", id(t), i), 0, frozenset(), None, False
        key = self.key(t)
        if key is not None and key[0] == "of":
            return ("of", key[1], key[2]), key[3][i], key[4], (("rows", m), i), False
        if key is None and not batch:
            self.bases[id(t)] = t  # kept: its id names it while the window lasts
            return ("of", id(t), m), i, frozenset({m}), None, False
        return (("rows", m), (i if key is None else key[1][i]), frozenset({m}), None,
                key is not None)

    def _batchlike(self, t, ours) -> bool:
        """t's rows are the records': the loader's batch or computed from it (``_now``), or
        the outputs; in a loop by hand (no loader hands batches out) any tensor the window
        made. A table made in the window (``protos = CENT.clone()``, K == n classes) is
        none where a loader hands batches out (refused by its lookups until 2026-11-30)."""
        if ours and ours(t):
            return True
        if self.earlier is not None and self.earlier.group:
            return self._now(t)
        return self._seen(t)

    def _moved(self, t) -> bool:
        return _has(self.moved, t)

    def _time_major(self, name, args, kwargs, tensors, out) -> None:
        """Follow dim 0 moved away (``MOVES``: ``o.transpose(0, 1)``, time-major) and back:
        a time step of it (``xt[t]``, ``for xt in xs``) has the records on dim 0 again
        (``steps``), and steps stacked over dim 0 have time there (``moved``): a mean over
        it is over time, no statistic of the batch (refused at T == n until 2026-11-30)."""
        first, mark, at = tensors[0], None, None
        if self._moved(first):  # (``at``: where the records' dim went; None: not told)
            at = self.records_dim(first)
            step = (name == "__getitem__" and len(args) > 1
                    and _int_first(args[1]) is not None) \
                or (name == "select" and len(args) > 1 and _is0(args[1], first.dim())) \
                or (name in ("unbind", "__iter__") and _dim0(name, args, kwargs, 0))
            if name in MOVES and at is not None:  # (moved again: back to dim 0, or on)
                at = moved_to(name, args, kwargs, first.dim(), at)
                mark = None if at == 0 else self.moved
            elif step:  # (a time step: dim 0 gone)
                at = at - 1 if at else None
                mark = self.steps if at in (0, None) else self.moved
            else:
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                if not outs or any(t.dim() != first.dim() for t in outs):
                    at = None  # (another rank: the records' dim is not followed on)
                mark = self.moved
        elif name in MOVES and _moves0(name, args, kwargs, first.dim()):
            mark, at = self.moved, moved_to(name, args, kwargs, first.dim(), 0)
        elif not self.made(first) and not self._free(first) and (
                lead := _leading_new_dims(name, args, kwargs, first.dim())):
            mark, at = self.moved, lead  # (``k[None]``, ``k.unsqueeze(0)``: the records on
            # dim 1, broadcast against another tensor's records on dim 0)
        elif name in STACKS and _dim0(name, args, kwargs):
            pieces = args[0] if args and isinstance(args[0], (tuple, list)) else ()
            if pieces and all(isinstance(p, torch.Tensor) and self._step(p) for p in pieces):
                mark, at = self.moved, 1
        elif self._step(first) and name not in CATS and name not in SPLITS:
            mark = self.steps
        if mark is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    mark[id(t)] = weakref.ref(t)
                    if mark is self.moved:
                        self.at[id(t)] = at

    def records_dim(self, t) -> int | None:
        """The dim holding t's records: 0, or where a ``MOVES`` op put it (``x.T``: 1; a
        time-major view: 1); None where that was not followed."""
        if not self._moved(t):
            return 0
        at = self.at.get(id(t))
        return at if at is None or at < t.dim() else None  # (an entry of another tensor
        # that had the id, or a view under vmap: not told)

    def _step(self, t) -> bool:
        return _has(self.steps, t)

    def moved_dim0(self, t) -> bool:
        """t's dim 0 is no longer the records' (``_time_major``)."""
        return self._moved(t)

    def _pooled(self, t) -> bool:
        return _has(self.pooled, t)

    def _loss(self, t) -> bool:
        return _has(self.losses, t)

    def _own(self, tensors, ours):
        """The one ident of the records' own tensors among ``tensors`` (data), else None."""
        idents = {self._inner(t) for t in tensors if (not t.requires_grad or (ours and ours(t)))
                  and not self._free(t)} - {None}
        return idents.pop() if len(idents) == 1 else None

    def _records_combined(self, name, tensors, ours, into) -> str | None:
        """Two records' own tensors combined (``0.7 * x[i] + 0.3 * x[(i + 1) % n]``: mixup
        written as a loop over the records, silent until 2026-11-30): ``what``."""
        own = [t for t in tensors if (not t.requires_grad or (ours and ours(t)))
               and not self._free(t) and not (into and t is tensors[0])]
        pooled = [t for t in tensors if self._pooled(t)]
        if pooled and (name not in POOLED_OK or (name in POOLED_OK - ADDS - {"sub", "__sub__",
                                                                             "__isub__", "sub_"}
                                                 and len(pooled) < len(tensors)
                                                 and any(self._inner(t) for t in tensors
                                                         if not self._pooled(t)))):
            self.records = frozenset().union(*(self._inner(t)[2] for t in pooled
                                               if self._inner(t)))
            return (f"{name}() of a sum over several records' own values (a loss pairing "
                    f"records, relu(1 - o[i] + o[j]): rows of two different records combined")
        if name in ADDS and own and all(self._loss(t) or (not t.dim() and t.requires_grad)
                                        for t in own if self._inner(t)):
            return None  # records' own losses summed (sum(ce(o[i], y[i]) for i ...))
        idents = [self._inner(t) for t in own]
        for a in idents:
            for b in idents:
                if a is None or b is None:
                    continue
                if (a[0] == b[0] and a[1] != b[1]) or (
                        a[3] is not None and b[4] and a[3][0] == b[0] and a[3][1] != b[1]):
                    self.records = a[2] | b[2]
                    return (f"{name}() of two records' own rows, x[i] beside x[j] (a batch "
                            f"partner picked record by record, as in mixup written as a loop "
                            f"over the batch): rows of two different records combined")
        return None

    def _record_written(self, name, args, into: bool) -> bool:
        """``out[i] = x[j]`` (or an augmentation of it): row i of ``out`` now holds record
        j's, so a loop ``out[i] = x[(i + 1) % n]`` leaves ``out`` in the order of
        ``x.roll(-1, 0)``. A tensor of no record (``empty_like``) takes an order once every
        row is written; another keeps its other rows' order."""
        if name != "__setitem__" or len(args) < 3 or not isinstance(args[2], torch.Tensor) \
                or not isinstance(args[0], torch.Tensor) or not args[0].dim() \
                or self._inner(args[0]) is not None:
            return False
        target, at, ident = args[0], _int_first(args[1]), self._inner(args[2])
        m = int(target.shape[0])
        if at is None or ident is None or ident[0][0] not in ("rows", "of"):
            return False
        space, key = ident[0], self.key(target)
        entry = self.writes.get(id(target))
        if entry is not None and entry[0]() is target and entry[1] == space:
            rows = entry[2]
        elif into:  # (the target was free: ``_free`` until this write)
            rows = [None] * m  # (records' data written into zeros: an order once full)
        elif space == ("rows", m) and (key is None or key[0] == "rows"):
            rows = list(range(m) if key is None else key[1])
        elif space[0] == "of" and key is not None and key[0] == "of" and key[1] == space[1] \
                and len(key[3]) == m:
            rows = list(key[3])
        elif space == ("of", id(target), m) and key is None:
            rows = list(range(m))  # (x[i] = x[j] in place)
        else:
            return False
        rows[at % m] = ident[1]
        self.writes[id(target)] = (weakref.ref(target), space, rows)
        self.free.pop(id(target), None)
        if None in rows:
            self._set(target, None)
        elif space[0] == "rows" or sorted(rows) == list(range(space[2])):
            self._set(target, _key(tuple(rows)))
        else:
            self._set(target, ("of", space[1], space[2], tuple(rows), ident[2] | {m}))
        return True

    def _records_joined(self, name, pieces, out) -> bool:
        """``torch.stack([x[(i + 1) % n] for i in range(n)])`` (or a cat of one-row pieces):
        the records' rows in that order, as ``x.roll(-1, 0)``; a cat of one record's pieces
        is still that record's. False where the pieces are not records' own."""
        pieces = list(pieces) if isinstance(pieces, (tuple, list)) else []
        idents = [self._inner(t) if isinstance(t, torch.Tensor) else None for t in pieces]
        if not pieces or None in idents or not isinstance(out, torch.Tensor) \
                or len({i[0] for i in idents}) != 1:
            return False
        if name in CATS and len(set(idents)) == 1:
            self._one(out, idents[0])
            return True
        if name in CATS and any(t.dim() == 0 or t.shape[0] != 1 for t in pieces):
            return False  # (records' own rows flattened, n·T rows in order: no key)
        space, rows = idents[0][0], tuple(i[1] for i in idents)
        sizes = frozenset().union(*(i[2] for i in idents))
        if space[0] == "rows":
            self._set(out, _key(rows) if len(rows) == space[1] else None)
        else:
            self._set(out, _key(rows) if sorted(rows) == list(range(space[2])) else
                      ("of", space[1], space[2], rows, sizes | {len(rows)}))
        return True

    def _neighbours(self, name, args, kwargs, tensors, data) -> str | None:
        """Differences of neighbours (``torch.diff(x, dim=0)``), silent until 2026-11-30:
        ``what``, the records' row counts in ``records``."""
        whole = [t for t in data if self._inner(t) is None]
        if name == "diff" and tensors and any(tensors[0] is t for t in whole):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            if isinstance(dim, int) and dim % tensors[0].dim() == 0:
                self.records = frozenset({int(tensors[0].shape[0])})
                return (f"diff() over dim 0 of a {tuple(tensors[0].shape)} tensor: rows of "
                        f"two different records (neighbours) combined")
        return None

    def _set(self, t, key) -> None:
        if key is None:
            self.keys.pop(id(t), None)
        else:
            self.keys[id(t)] = (weakref.ref(t), key)

    def _sub(self, t, positions) -> tuple | None:
        """The key of t's rows at ``positions``. A key is ("rows", source rows) of the batch
        (a permutation, a drawn partner: compared with every tensor of that row count), or
        ("of", id(base), rows of base, source rows) for rows a slice picked from ``base``
        (compared only with the base's other slices: ``X[i:i + b]``, a batch cut from a data
        set by hand, is no partner of a fresh b rows, but ``x[:h]`` is one of ``x[h:]``)."""
        key = self.key(t)
        if key is None:
            if not isinstance(positions, tuple) or len(positions) == t.shape[0]:
                return _key(positions)  # a permutation of t: of the batch
            self.bases[id(t)] = t  # kept: its id names it while the window lasts
            return ("of", id(t), int(t.shape[0]), positions,
                    frozenset({int(t.shape[0]), len(positions)}))
        if key[0] == "rows":
            return _key(tuple(key[1][i] for i in positions))
        if sorted(positions) == list(range(int(t.shape[0]))):  # a permutation of a batch cut
            return _key(positions)  # from a data set: of the batch, as the batch's own
        rows = tuple(key[3][i] for i in positions)
        return _key(rows) if sorted(rows) == list(range(key[2])) else \
            (*key[:3], rows, key[4] | {len(rows)})  # (every row count on the way: a
        # batch cut from a data set by hand, X[i:i + b], then halved, has b among them)

    def _mixed(self, same) -> frozenset:
        """Tensors of one row count holding rows of different records: two orders of the
        batch, or two different slices of one base; the row counts the records may have
        been seen in (the tensors', and for slices every one from the base's on:
        ``BatchStatistics.settle`` keeps a statistic over n·m rows only), else empty."""
        batch = {k if k is None or k[0] == "rows" else None for k in map(self.key, same)}
        if len(batch) > 1:
            return frozenset({int(same[0].shape[0])})
        slices: dict[int, set] = {}
        sizes: dict[int, frozenset] = {}
        for k in map(self.key, same):
            if k is not None and k[0] == "of":
                slices.setdefault(k[1], set()).add(k[3])
                sizes[k[1]] = sizes.get(k[1], frozenset()) | k[4]
        return next((sizes[base] for base, rows in slices.items() if len(rows) > 1),
                    frozenset())

    def _pieces(self, t, out) -> None:
        """``t.chunk(k)``, ``t.split(s)``: each piece its consecutive rows of t, so
        half-batch mixup (``a, b = x.chunk(2); 0.7 * a + 0.3 * b``) pairs two records
        (silent until 2026-11-30)."""
        start = 0
        for piece in out if isinstance(out, (tuple, list)) else ():
            if isinstance(piece, torch.Tensor) and piece.dim():
                k = int(piece.shape[0])
                self._set(piece, self._sub(t, tuple(range(start, start + k))))
                start += k

    def _joined(self, pieces, out) -> None:
        """``torch.cat(pieces)`` over dim 0: the pieces' rows in turn (``torch.cat([x[1:],
        x[:1]])`` is ``x.roll(-1, 0)``); pieces of two bases (two batches joined, noise
        beside data) or none reordered: no order."""
        pieces = [t for t in pieces if isinstance(t, torch.Tensor)] \
            if isinstance(pieces, (tuple, list)) else []
        if not isinstance(out, torch.Tensor) or not out.dim() or not pieces \
                or any(self._free(t) or not t.dim() for t in pieces) \
                or all(self.key(t) is None for t in pieces):
            if isinstance(out, torch.Tensor):
                self._set(out, None)
            return
        keys = [self.key(t) for t in pieces]
        bases = {("rows",) if k is None or k[0] == "rows" else k[:3] for k in keys}
        sizes = frozenset().union(*(k[4] for k in keys if k is not None and k[0] == "of"))
        if len(bases) != 1 or any(k is None for k in keys) and bases != {("rows",)}:
            self._set(out, None)
            return
        base = bases.pop()
        rows = tuple(r for t, k in zip(pieces, keys)
                     for r in (range(int(t.shape[0])) if k is None
                               else k[1] if k[0] == "rows" else k[3]))
        self._set(out, _key(rows) if base == ("rows",) or sorted(rows) == list(
            range(base[2])) else (*base, rows, sizes | {len(rows)}))


__all__ = ["DRAWN", "REORDER", "RESHAPES", "repeats", "SPLITS", "STACKS", "Earlier", "RowOrder"]
