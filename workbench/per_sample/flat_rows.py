"""Batch-flattened rows: a position-wise layer called on (n·T, d) instead of (n, T, d).

Hugging Face's OPT decoder layer runs its MLP on ``h.reshape(-1, d)``: final_layer_norm, fc1
and fc2 see (n·T, d) rows, dim 0 is not the batch, and the per-layer rules (which sum over
each sample's positions, Yousefpour et al. 2021, arXiv 2109.12298, Eq. 5) cannot be applied
to the call as it is. A reshape in C order is exact bookkeeping, though: for
x of shape (m, T_1, ..., T_k, *rest) and y = x.reshape(m·T, *rest'), T = Π T_j,
prod(rest') = prod(rest),

    y[r] = the elements of x[r // T, (r mod T) as (t_1..t_k)]                          (1)

so row r of y belongs to sample r // T, whatever the strides. For a layer whose rule works
row by row (``LayerRule.rows``: Linear, LayerNorm, RMSNorm, ...), o = f(y) has the same rows,
and the call *is* the call f(y.reshape(m, T, *rest')) of a batch-first layer:

    ∂ℓ_i/∂W = Σ_{r : r // T = i} g(a_r, b_r)      (n, ...)  the rule on (m, T, ...) views (2)

``FlatRows`` proves (1) for the tensors it follows (the use tracker, ``uses.py``, shows it every
op of the forward pass). A tag (m, T) says: row r is sample r // T's, of m samples. The model's
inputs are tagged (m, 1), the batch on dim 0 (``seed``). A tag is kept by an op that builds
row r of its result from rows r of its tagged operands alone, the other operands carrying no
sample (untainted, ``derived.Taint``) or broadcast along dim 0: an elementwise op
(``ELEMENTWISE``), a transpose, permute, roll, index, squeeze or reduction that leaves dim 0
alone, a softmax or normalisation along another dim, a layer's own op (``linear``,
``layer_norm``, ``embedding``, ``conv2d``, pooling), attention and batched matmuls on operands
tagged alike, a ``cat`` or ``split`` along another dim (``ROW_WISE``, ``keeps_rows``). A reshape
that merges dim 0 of a tagged (m, T) tensor with its next dims tags its result (m, T·Π); one
that splits (m·T) back into m gives (m, 1). Nothing else keeps a tag: rows reordered
(``x[perm]``, ``flip``, dim 0 moved by a transpose: time-major rows), mixed with rows of unknown
order, or written in place by anything but such an elementwise op (the write bumps the version
counter that all views of the storage share, and a tag holds only at the version it was made
at). A layer called on an untagged tensor keeps the batch-on-dim-0 check and its exact
fallback (``recording.batch_problem``); the probe still compares the shapes at n and at one
sample (``selfcheck.probe``). So a tag never rests on shapes alone: time-major rows at T = n,
window-major windows at n = windows per side, give no tag with or without the self-check.

Notation: n batch, T rows per sample, m the flattened tensor's dim 0 (n when right),
a activations, b backprops, ℓ_i per-sample loss.
"""

import math
import weakref

import torch

from workbench.per_sample.registry import find_grad_rule

RESHAPES = frozenset({"reshape", "view", "flatten", "reshape_as", "view_as"})
ELEMENTWISE = frozenset({
    "relu", "relu_", "gelu", "silu", "tanh", "sigmoid", "elu", "selu", "celu", "leaky_relu",
    "hardtanh", "relu6", "mish", "hardswish", "hardsigmoid", "softplus", "erf", "exp", "neg",
    "abs", "pow", "sqrt", "rsqrt", "square", "dropout", "contiguous", "clone", "to", "float",
    "double", "half", "bfloat16", "type_as", "add", "sub", "mul", "div", "__add__", "__radd__",
    "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__neg__", "__pow__", "__rpow__",
    "clamp", "clip", "clamp_min", "clamp_max", "log", "log1p", "expm1", "reciprocal", "maximum",
    "minimum", "where", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "log2",
    "log10", "exp2", "logit", "logsigmoid", "softsign", "tanhshrink", "hardshrink",
    "softshrink", "threshold", "nan_to_num", "fmod", "remainder", "lerp", "addcmul", "addcdiv",
    "erfc", "erfinv", "lgamma", "digamma", "xlogy", "hypot", "copysign", "float_power",
    "true_divide", "floor_divide", "fmax", "fmin", "heaviside", "deg2rad", "rad2deg",
    "positive", "rsub", "__mod__", "__floordiv__", "__abs__", "eq", "ne", "lt", "le", "gt",
    "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "logical_and",
    "logical_or", "logical_xor", "logical_not", "__and__", "__or__", "__xor__", "__invert__",
    "isnan", "isinf", "isfinite", "int", "long", "short", "bool", "byte", "char",
})  # pointwise: row r of the result from rows r of the operands (broadcasting: _elementwise)
ROW_WISE = frozenset({
    "transpose", "permute", "softmax", "log_softmax", "normalize", "matmul", "__matmul__", "bmm",
    "linear", "layer_norm", "group_norm", "rms_norm", "embedding", "conv1d", "conv2d", "conv3d",
    "scaled_dot_product_attention", "unsqueeze", "squeeze", "__getitem__", "mean", "sum",
    "amax", "amin", "logsumexp", "pad", "masked_fill", "roll", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
    "cumsum", "cumprod", "repeat_interleave", "addmm", "expand", "zeros_like", "ones_like",
    "full_like", "gather", "take_along_dim",
})  # row r of the result from rows r of the inputs (``keeps_rows``)
LIKE = ("zeros_like", "ones_like", "full_like")  # constant rows, one per row of x
JOINS = frozenset({"cat", "concat", "concatenate", "stack"})  # along another dim than 0
SPLITS = frozenset({"split", "chunk", "unbind"})  # along another dim than 0: each part
SORTS = frozenset({"topk", "sort"})  # (values, indices) along another dim than 0: each part
REORDERS = frozenset({"__getitem__", "index_select", "gather", "take_along_dim"})  # _reorder
FOLLOWED = RESHAPES | ELEMENTWISE | ROW_WISE | JOINS | SPLITS | SORTS | {
    "einsum", "__getitem__", "__iter__", "index_select"}


def in_place(name: str) -> bool:
    """``x.add_(y)``, ``x += y``, ``x[i] = y``: an op writing into its first argument."""
    return (name[-1:] == "_" and name[-2:] != "__") or name.startswith("__i") \
        or name == "__setitem__"


def merged(src: torch.Size, out: torch.Size) -> int | None:
    """k: ``out``'s dim 0 is the product of ``src``'s first k dims (k ≥ 1), else None (Eq. 1)."""
    size = 1
    for k, d in enumerate(src, start=1):
        size *= d
        if size == out[0]:
            return k
        if size > out[0]:
            return None
    return None


class FlatRows:
    """Tensors whose rows are a batch flattened sample-major: {id: (weakref, m, T, version,
    order)}, ``order`` None where block s holds record s (the proof every rule relies on),
    else a key of ``orders``: block s holds record ``orders[key][s]`` (``_reorder``)."""

    def __init__(self, tainted=None):
        self.tags: dict[int, tuple] = {}
        self.moved: dict[int, tuple] = {}  # tagged rows moved to dim 1 by a permute (_unstacked)
        self.tainted = tainted  # (t) -> whether t was computed from the batch (derived.Taint)
        self.orders: dict[int, torch.Tensor] = {}  # key -> (m,) the records of the m blocks

    def of(self, t) -> tuple[int, int] | None:
        """(m, T) of a tagged tensor whose storage was not written since and whose blocks are
        the records in their order, or None. A write in place bumps the version counter its
        views share: every tag on that storage lapses at once, without a scan of the tags."""
        entry = self.tags.get(id(t))
        return entry[1:3] if entry is not None and entry[0]() is t and \
            t._version == entry[3] and entry[4] is None else None

    def full(self, t) -> tuple | None:
        """(m, T, order) of a tagged tensor, its blocks in the records' order (order None) or
        in another (``orders``): what the ops pass on. Only ``of`` proves rows to a rule."""
        entry = self.tags.get(id(t))
        return (*entry[1:3], entry[4]) if entry is not None and entry[0]() is t and \
            t._version == entry[3] else None

    def order(self, t) -> torch.Tensor | None:
        """The records of t's blocks, (m,), where the model put them in another order than the
        batch's (``x[perm]``), else None."""
        tag = self.full(t)
        return None if tag is None or tag[2] is None else self.orders[tag[2]]

    def tag(self, t: torch.Tensor, m: int, T: int, order: int | None = None) -> None:
        self.tags[id(t)] = (weakref.ref(t), m, T, t._version, order)

    def _reorder(self, name, args, kwargs, result) -> bool:
        """``x[idx]``, ``x[idx, ...]``, ``index_select(x, 0, idx)``, ``gather(x, 0, idx)`` and
        ``take_along_dim(x, idx, 0)`` (one index per row) on tagged rows (m, 1) with a
        one-dimensional integer index along dim 0: block r of the result is record
        ``order(x)[idx[r]]``. The identity order (``h[perm.argsort()]`` after ``x[perm]``, or
        ``h[arange(n), lengths]`` picking each record's last token) tags the result as the
        batch's rows; any other (a sort by length inside the model) is kept as an order, which
        no rule reads as the batch (``of``: None): a layer called on such rows takes the exact
        fallback (``recording.batch_problem``). Until 2026-11-30 row r of such a call was read
        as record r's: per-sample gradients permuted between records, the clipped sum 17% off
        in every mode, the self-check passing when the probed record kept its place. True when
        handled."""
        x = args[0]
        tag = self.full(x)
        if tag is None or tag[1] != 1 or x.dim() < 1:
            return False
        if name == "index_select":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            first = args[2] if len(args) > 2 else kwargs.get("index")
            rest = ()
            if not isinstance(dim, int) or dim % x.dim() != 0:
                return False
        elif name in ("gather", "take_along_dim"):  # gather(x, 0, idx), take_along_dim(x,
            # idx, 0): row r of the result is row idx[r] of x when idx is one index per row
            dim = (args[1] if len(args) > 1 else kwargs.get("dim")) if name == "gather" else \
                (args[2] if len(args) > 2 else kwargs.get("dim"))
            index = (args[2] if len(args) > 2 else kwargs.get("index")) if name == "gather" \
                else (args[1] if len(args) > 1 else kwargs.get("indices"))
            if not isinstance(dim, int) or dim % x.dim() != 0 or not isinstance(
                    index, torch.Tensor) or index.dim() < 1 or index.shape[0] == 0:
                return False
            rows = index.reshape(index.shape[0], -1)
            with torch.no_grad():
                if rows.shape[1] and not bool((rows == rows[:, :1]).all()):
                    return False  # rows of the result gathered from several records
            first, rest = rows[:, 0] if rows.shape[1] else index.reshape(-1), ()
        else:
            index = args[1] if len(args) > 1 else None
            index = index if isinstance(index, tuple) else (index,)
            first, rest = (index[0], index[1:]) if index else (None, ())
        if isinstance(first, list) and first and all(type(i) is int for i in first):
            first = torch.tensor(first)
        if not isinstance(first, torch.Tensor) or first.dim() != 1 or first.dtype in (
                torch.bool, torch.uint8) or first.is_floating_point() or first.is_complex() \
                or result.dim() < 1 or result.shape[0] != first.shape[0]:
            return False
        m = tag[0]
        with torch.no_grad():
            picked = first.detach().to("cpu", torch.long) % max(m, 1)
            new = picked if tag[2] is None else self.orders[tag[2]][picked]
            same = new.numel() == m and bool((new == torch.arange(m)).all())
        for t in rest:  # other tensor indices: constants, or each row its own record's
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and (
                    self.tainted is None or self.tainted(t)) and not (
                    same and tag[2] is None and self.of(t) == (m, 1) and t.dim() == 1):
                return False
            if isinstance(t, torch.Tensor) and t.dim() > 1:
                return False
        if same:
            self.tag(result, m, 1)
        else:
            key = len(self.orders)
            self.orders[key] = new
            self.tag(result, new.numel(), 1, key)
        return True

    def _unstacked(self, name, args, kwargs, result) -> bool:
        """``q, k, v = qkv.permute(2, 0, ...)`` (a fused projection's parts stacked in front of
        the batch, timm's and BEiT's attention): each part of the front dim has the rows."""
        src = args[0]
        entry = self.moved.get(id(src))  # (ref, m, T, order, version)
        if entry is None or entry[0]() is not src or src._version != entry[4]:
            return False
        if name == "__getitem__":
            index = args[1] if len(args) > 1 else None
            if isinstance(index, int) and isinstance(result, torch.Tensor):
                self.tag(result, *entry[1:4])
            return True
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim == 0 and isinstance(result, (tuple, list)):
            for t in result:
                if isinstance(t, torch.Tensor):
                    self.tag(t, *entry[1:4])
        return True

    def seed(self, tensors) -> None:
        """The model's inputs: the batch on dim 0, one row per sample (m, 1)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                self.tag(t, t.shape[0], 1)

    def after(self, name: str, args, kwargs, result) -> None:
        """Follow ``result = name(*args, **kwargs)`` (module docstring)."""
        src = args[0] if args else None
        if self.tags and (in_place(name) or kwargs.get("inplace") is True) and \
                isinstance(src, torch.Tensor):  # F.relu(x, inplace=True) writes x too
            entry = self.tags.get(id(src))  # its tag as of just before this op's one write
            if (name in ELEMENTWISE or name[:-1] in ELEMENTWISE) and entry is not None \
                    and entry[0]() is src \
                    and src._version == entry[3] + 1:
                self.tag(src, *entry[1:3], entry[4])  # for the proof below, then kept only if
                # it holds
                self._elementwise(args, kwargs, src)
            return  # otherwise the write lapsed every tag on src's storage (``of``)
        if name in JOINS and self.tags and args:
            self._joined(args, kwargs, result)
            return
        if name == "einsum" and self.tags and isinstance(result, torch.Tensor):
            tag = summed_rows(args, result, self.full, self.tainted)
            if tag is not None:
                self.tag(result, *tag)
            return
        if self.moved and name in ("unbind", "__getitem__", "__iter__") and \
                isinstance(src, torch.Tensor) and self._unstacked(name, args, kwargs, result):
            return
        if name in SPLITS and self.tags and isinstance(src, torch.Tensor):
            self._split(name, args, kwargs, result)
            return
        if name in SORTS and self.tags and isinstance(src, torch.Tensor):
            self._sorted(name, args, kwargs, result)
            return
        if name == "repeat_interleave" and self.tags and isinstance(src, torch.Tensor) and \
                isinstance(result, torch.Tensor) and self._repeated(args, kwargs, result):
            return
        if not isinstance(result, torch.Tensor) or result.dim() == 0 or src is None:
            return
        if name in REORDERS and self.tags and \
                isinstance(src, torch.Tensor) and self._reorder(name, args, kwargs, result):
            return
        if name in RESHAPES and isinstance(src, torch.Tensor) and src.dim() >= 1:
            self._reshaped(src, result)
        elif name in ROW_WISE and self.tags and isinstance(src, torch.Tensor):
            tag = self.full(src)
            if tag is not None and name == "permute" and _moves_dim0_to_1(args, kwargs, src):
                self.moved[id(result)] = (weakref.ref(result), *tag, result._version)
                return
            if tag is not None and keeps_rows(name, args, kwargs, result, self.full,
                                              self.tainted):
                self.tag(result, *tag)
            elif tag is None and len(args) > 1 and (row := rows_second(
                    name, args, kwargs, result, self.full, self.tainted)) is not None:
                self.tag(result, *row)
        elif name in ELEMENTWISE and self.tags and any(
                id(t) in self.tags for t in (*args, *kwargs.values())):
            self._elementwise(args, kwargs, result)

    def _reshaped(self, src: torch.Tensor, out: torch.Tensor) -> None:
        k, tag = merged(src.shape, out.shape), self.full(src)
        if tag is None:
            return  # src's dim 0 not proved to be the batch's rows: nor are out's
        m, T, order = tag  # each branch keeps a sample's rows in one block: the order holds
        if k is not None:
            self.tag(out, m, T * math.prod(src.shape[1:k]), order)
        elif out.dim() >= 1 and out.shape[0] and src.shape[0] % out.shape[0] == 0 \
                and T % (src.shape[0] // out.shape[0]) == 0:
            # (m·T, ...) -> (m·T / j, j, ...): each new row holds j whole rows of one sample
            # (j | T), m·T / j = m (samples back on dim 0) included; MoE's (tokens, k, d)
            self.tag(out, m, T // (src.shape[0] // out.shape[0]), order)
        elif out.dim() >= 1 and out.shape[0] % src.shape[0] == 0:
            self.tag(out, m, T * (out.shape[0] // src.shape[0]), order)  # each row cut in j

    def _joined(self, args, kwargs, result) -> None:
        """``cat`` / ``stack`` along another dim than 0 of tensors with the same rows, or no
        sample in them (a cls token expanded to the batch): the same rows."""
        parts = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not isinstance(result, torch.Tensor) or not isinstance(parts, (list, tuple)) \
                or not parts or not isinstance(dim, int) or result.dim() < 2 \
                or dim % result.dim() == 0:
            return
        tags = {self.full(t) for t in parts if isinstance(t, torch.Tensor)}
        tag = next(iter(tags - {None}), None) if len(tags - {None}) == 1 else None
        if tag is None or any(self.full(t) is None and (self.tainted is None or self.tainted(t))
                              for t in parts) or any(t.shape[0] != result.shape[0]
                                                     for t in parts):
            return
        self.tag(result, *tag)

    def _split(self, name, args, kwargs, result) -> None:
        """``split`` / ``chunk`` / ``unbind`` along another dim than 0: each part has x's rows."""
        x, tag = args[0], self.full(args[0])
        dim = kwargs.get("dim", args[2] if name != "unbind" and len(args) > 2 else
                         args[1] if name == "unbind" and len(args) > 1 else 0)
        if tag is None or not isinstance(dim, int) or dim % x.dim() == 0 \
                or not isinstance(result, (tuple, list)):
            return
        for t in result:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == x.shape[0]:
                self.tag(t, *tag)

    def _sorted(self, name, args, kwargs, result) -> None:
        """``topk`` / ``sort`` along another dim than 0 (a router's top-k experts per token):
        the values and the indices have x's rows."""
        x, tag = args[0], self.full(args[0])
        at = 2 if name == "topk" else 1  # topk(x, k, dim), sort(x, dim)
        dim = kwargs.get("dim", args[at] if len(args) > at else -1)
        if tag is None or isinstance(dim, bool) or not isinstance(dim, int) or x.dim() == 0 \
                or dim % x.dim() == 0 or not isinstance(result, (tuple, list)):
            return
        for t in result:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == x.shape[0]:
                self.tag(t, *tag)

    def _repeated(self, args, kwargs, result) -> bool:
        """``x.repeat_interleave(r, dim=0)``, r an int: row j of the result is row j // r of x,
        sample j // (T r)'s (a token repeated for each of its k experts): (m, T·r)."""
        x, tag = args[0], self.full(args[0])
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        if tag is None or type(repeats) is not int or repeats < 1 or type(dim) is not int \
                or x.dim() == 0 or dim % x.dim() != 0 or result.dim() != x.dim() \
                or result.shape[0] != x.shape[0] * repeats:
            return False
        self.tag(result, tag[0], tag[1] * repeats, tag[2])
        return True

    def _elementwise(self, args, kwargs, result: torch.Tensor) -> None:
        tag = None
        for t in (*args, *kwargs.values()):
            if not isinstance(t, torch.Tensor):
                continue
            mine = self.full(t)
            if mine is not None and t.shape[0] == 1 and result.shape[0] != 1:
                mine = None  # one row broadcast to every row (an input of one row: positions)
            if mine is None:
                if t.dim() >= result.dim() and t.shape[0] != 1 and (
                        self.tainted is None or self.tainted(t)):
                    tag = None  # rows of unknown order meet these: no proof
                    break
                continue  # broadcast along dim 0, or no sample in it (OPT's positions)
            if t.dim() != result.dim() or t.shape[0] != result.shape[0] or (
                    tag is not None and mine != tag):
                tag = None  # broadcast along other dims is fine; rows must line up
                break
            tag = mine
        if tag is not None:
            self.tag(result, *tag)
        else:
            self.tags.pop(id(result), None)  # an in-place op on a tagged tensor: no proof


DEFAULT_DIM = {"normalize": 1}  # F.normalize(x, p=2.0, dim=1)


def keeps_rows(name: str, args, kwargs, result: torch.Tensor, tag_of, tainted=None) -> bool:
    """Does ``result = name(*args)`` keep dim 0 of its tagged first argument x as its own, row
    r of the result computed from row r of x (and of a second operand tagged alike) alone?
    A transpose or permute that leaves dim 0 in place; a softmax or normalisation along
    another dim; a batched matmul (Swin's window attention, q k^T and p v on (n·windows)
    rows) whose other operand has the same rows, or carries no sample (``tainted``, the
    tracker's: not computed from the batch; ``h @ h.T`` would mix every row into each) and
    is a matrix or broadcast along dim 0."""
    x = args[0]
    if x.dim() < 1 or result.dim() < 1 or result.shape[0] != x.shape[0]:
        return False
    if name in OPS:
        return OPS[name](x, args, kwargs, result, tag_of, tainted)
    if name == "transpose":
        dims = [*args[1:3], *(kwargs.get(k) for k in ("dim0", "dim1") if k in kwargs)]
        return len(dims) == 2 and _spares_dim0(dims, x.dim())
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        dims = dims or kwargs.get("dims", ())
        return len(dims) == x.dim() and isinstance(dims[0], int) and dims[0] % x.dim() == 0
    if name in ("softmax", "log_softmax", "normalize"):
        dim = args[1] if len(args) > 1 and name != "normalize" else (
            args[2] if len(args) > 2 else kwargs.get("dim", DEFAULT_DIM.get(name)))
        return isinstance(dim, int) and _spares_dim0(dim, x.dim())
    other = args[1] if len(args) > 1 else None  # matmul, bmm
    if not isinstance(other, torch.Tensor) or x.dim() < 2 or kwargs:
        return False
    mine = tag_of(other)
    if mine is not None:  # rows of both: each a batch dim of the product, tagged alike
        return x.dim() >= 3 and other.dim() == x.dim() and mine == tag_of(x) \
            and other.shape[0] == x.shape[0]
    if tainted is None or tainted(other):
        return False
    return other.dim() <= 2 or other.dim() < x.dim() or other.shape[0] == 1  # broadcast


def rows_second(name: str, args, kwargs, result, tag_of, tainted):
    """The tag of ``result`` when its rows come from the *second* operand: ``D @ a`` with D
    carrying no sample and broadcast along a's batch dims (Mamba's ``dt_proj.weight @ x``),
    ``addmm(c, a, W)`` (GPT-2's Conv1D: rows of a); else None."""
    a, first = args[1], args[0]
    tag = tag_of(a) if isinstance(a, torch.Tensor) else None
    if tag is None or result.dim() < 1 or kwargs and name != "addmm":
        return None
    if name == "addmm":
        ok = a.dim() == 2 and result.shape[0] == a.shape[0] and all(
            _no_sample(t, tainted) for t in (first, *args[2:3]))
    elif name == "__getitem__":  # W[idx]: a table's rows gathered by a tagged index (MoE's
        # experts' weights per token), row r of the result W[idx[r]]
        ok = (not a.is_floating_point() and not a.is_complex() and a.dtype != torch.bool
              and a.dim() >= 1 and result.shape[0] == a.shape[0] and _no_sample(first, tainted)
              and isinstance(first, torch.Tensor))
    elif name in ("matmul", "__matmul__"):
        ok = (a.dim() >= 3 and result.shape[0] == a.shape[0] and _no_sample(first, tainted)
              and isinstance(first, torch.Tensor) and (first.dim() < a.dim()
                                                       or first.shape[0] == 1))
    else:
        ok = False
    return tag if ok else None


def _moves_dim0_to_1(args, kwargs, x) -> bool:
    dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    dims = dims or kwargs.get("dims", ())
    return len(dims) == x.dim() >= 2 and isinstance(dims[1], int) and dims[1] % x.dim() == 0


def summed_rows(args, result, tag_of, tainted):
    """The tag of ``einsum(eq, *ops)``'s result when one letter is dim 0 of the output and of
    every tagged operand (Mamba-2's chunk scan, 'bclhn,bcshn->bclsh'), tagged alike, and every
    operand without that letter carries no sample; else None."""
    eq, ops = args[0], list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) \
        else list(args[1:])
    if not isinstance(eq, str) or "->" not in eq or "." in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if not out or len(terms) != len(ops) or result.dim() != len(out):
        return None
    b, tags = out[0], set()
    for term, t in zip(terms, ops):
        if b in term:
            if term[0] != b or term.count(b) != 1 or not isinstance(t, torch.Tensor):
                return None
            tags.add(tag_of(t))
        elif not _no_sample(t, tainted):
            return None
    if len(tags) != 1 or None in tags:
        return None
    return tags.pop()


def _expanded(x, args, kwargs, result, tag_of, tainted):  # expand keeping dim 0 as it is
    return x.dim() == result.dim()


def _no_sample(t, tainted) -> bool:
    return not isinstance(t, torch.Tensor) or (tainted is not None and not tainted(t))


def _alike_or_none(t, x, tag_of, tainted) -> bool:
    """Another operand of a row-wise op: the same rows as x, or no sample, broadcast."""
    if not isinstance(t, torch.Tensor):
        return True
    if t.dim() < x.dim() or (t.shape[0] == 1 and x.shape[0] != 1):
        return True  # broadcast along dim 0: one row for every row, as elementwise ops allow
    mine = tag_of(t)
    if mine is not None:
        return mine == tag_of(x) and t.dim() == x.dim() and t.shape[0] == x.shape[0]
    return _no_sample(t, tainted)


def _weighted(x, args, kwargs, result, tag_of, tainted) -> bool:  # linear, embedding
    return (x.dim() >= 2 or (x.dim() == 1 and result.dim() == 2)) and all(
        _no_sample(a, tainted) for a in (*args[1:], *kwargs.values()))


def _convolved(dims):
    def check(x, args, kwargs, result, tag_of, tainted):
        return x.dim() == dims + 2 and all(_no_sample(a, tainted)
                                            for a in (*args[1:3], kwargs.get("weight"),
                                                      kwargs.get("bias")))
    return check


def _normalised(x, args, kwargs, result, tag_of, tainted):  # layer_norm, rms_norm
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return len(shape) < x.dim() and all(_no_sample(a, tainted)
                                        for a in (*args[2:], *kwargs.values()))


def _spares_dim0(dim, ndim: int) -> bool:
    """``dim`` (an int or a sequence of them) names dims of an ndim-tensor other than 0."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (tuple, list)) \
        else ()
    return bool(dims) and all(isinstance(d, int) and d % ndim != 0 for d in dims)


def _reduced(x, args, kwargs, result, tag_of, tainted):  # mean, sum, squeeze over dims ≠ 0
    return _spares_dim0(args[1] if len(args) > 1 else kwargs.get("dim"), x.dim())


def _unsqueezed(x, args, kwargs, result, tag_of, tainted):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(dim, int) and _spares_dim0(dim, result.dim())


def _indexed(x, args, kwargs, result, tag_of, tainted):
    """``x[:, ...]``, ``x[..., k]``: basic indexing that leaves dim 0 whole (no tensor index,
    which could move dims to the front)."""
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in index):
        return False
    first = next((i for i in index if i is not None), Ellipsis)
    if first is Ellipsis:
        return sum(i is not None and i is not Ellipsis for i in index) < x.dim()
    return isinstance(first, slice) and first == slice(None)


def _padded(x, args, kwargs, result, tag_of, tainted):  # pairs from the last dim backwards
    pad = tuple(args[1] if len(args) > 1 else kwargs.get("pad", ()))
    return len(pad) // 2 < x.dim() or tuple(pad[2 * x.dim() - 2:2 * x.dim()]) == (0, 0)


def _along(x, args, kwargs, result, tag_of, tainted):  # cumsum, repeat_interleave along dim ≠ 0
    dim = kwargs.get("dim", args[2] if name_dim_third(args) else args[1] if len(args) > 1
                     else None)
    return isinstance(dim, int) and _spares_dim0(dim, x.dim())


def name_dim_third(args) -> bool:
    """``repeat_interleave(x, repeats, dim)``: dim third; ``cumsum(x, dim)``: second."""
    return len(args) > 2


def _attended(x, args, kwargs, result, tag_of, tainted):  # SDPA: q, k, v, attn_mask
    others = [*args[1:4], kwargs.get("key"), kwargs.get("value"), kwargs.get("attn_mask")]
    return x.dim() >= 3 and all(_alike_or_none(t, x, tag_of, tainted) for t in others)


def _filled(x, args, kwargs, result, tag_of, tainted):  # masked_fill(x, mask, value)
    return all(_alike_or_none(t, x, tag_of, tainted) for t in (*args[1:], *kwargs.values()))


def _picked(dim_at: int, index_at: int, index_name: str):
    """``gather(x, dim, index)`` (dim second) and ``take_along_dim(x, indices, dim)`` (dim
    third) along a dim other than 0: row r of the result is row r of x picked at row r of the
    index, whose rows are x's or carry no sample (DeBERTa's relative positions expanded to the
    batch: ``gather(q @ k_pos^T, -1, pos.expand(n, ...))``)."""
    def check(x, args, kwargs, result, tag_of, tainted):
        dim = args[dim_at] if len(args) > dim_at else kwargs.get("dim")
        index = args[index_at] if len(args) > index_at else kwargs.get(index_name)
        return isinstance(dim, int) and _spares_dim0(dim, x.dim()) and \
            isinstance(index, torch.Tensor) and index.dim() == x.dim() and \
            _alike_or_none(index, x, tag_of, tainted)
    return check


def _group_normalised(x, args, kwargs, result, tag_of, tainted):
    return x.dim() >= 2 and all(_no_sample(a, tainted) for a in (*args[2:], *kwargs.values()))


def _rolled(x, args, kwargs, result, tag_of, tainted):  # Swin's shifted windows
    return _spares_dim0(args[2] if len(args) > 2 else kwargs.get("dims"), x.dim())


def _pooled(dims):
    def check(x, args, kwargs, result, tag_of, tainted):
        return x.dim() == dims + 2
    return check


OPS = {"expand": _expanded, "roll": _rolled, "cumsum": _along, "cumprod": _along,
       "repeat_interleave": _along, **dict.fromkeys(LIKE, lambda *_: True),
       **{f"{kind}{d}d": _pooled(d) for d in (1, 2, 3)
          for kind in ("adaptive_avg_pool", "adaptive_max_pool", "avg_pool", "max_pool")},
       "linear": _weighted, "embedding": _weighted, "conv1d": _convolved(1),
       "conv2d": _convolved(2), "conv3d": _convolved(3), "layer_norm": _normalised,
       "rms_norm": _normalised, "group_norm": _group_normalised, "mean": _reduced,
       "sum": _reduced, "amax": _reduced, "amin": _reduced, "logsumexp": _reduced,
       "unsqueeze": _unsqueezed, "squeeze": _reduced, "__getitem__": _indexed, "pad": _padded,
       "scaled_dot_product_attention": _attended, "masked_fill": _filled,
       "gather": _picked(1, 2, "index"), "take_along_dim": _picked(2, 1, "indices")}
"""op name -> (x, args, kwargs, result, tag_of, tainted) -> whether the result keeps x's rows
(x tagged, the result's dim 0 x's: checked before)."""


def unflattened(rows: FlatRows | None, layer, x, output) -> tuple[int, int] | None:
    """(m, T) when ``output = layer(x)`` is a position-wise layer on tagged rows (Eq. 2)."""
    if rows is None or not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    tag = rows.of(x)
    if tag is None or tag[1] == 1 or x.shape[0] != tag[0] * tag[1] or output.dim() == 0 \
            or output.shape[0] != x.shape[0] or not row_wise(layer):
        return None  # (m, 1): dim 0 is the batch itself, the call as it is
    return tag


def passed_on(rows: FlatRows, layer, x, outputs) -> None:
    """A layer with a rule called on x tagged (m, 1): its outputs with dim 0 of m carry the
    same batch, as its rule reads them (``recording.checked_shapes``). Its own ops may run
    where no mode sees them (a layer tapped by ``skip_weights.py``), so the call passes the
    tag on, as it passes the taint (``derived.Taint.through``)."""
    tag = rows.full(x) if isinstance(x, torch.Tensor) else None
    if tag is None or tag[1] != 1 or find_grad_rule(layer) is None:
        return
    for t in outputs:
        if t.dim() >= 1 and t.shape[0] == tag[0] and rows.full(t) is None:
            rows.tag(t, *tag)


def row_wise(layer) -> bool:
    """Does ``layer``'s rule (grad and norm) work row by row (``LayerRule.rows``)?"""
    from workbench.clipping.registry import find_norm_rule
    from workbench.per_sample.registry import find_grad_rule
    from workbench.rules._rule import find_layer_rule

    rule = find_layer_rule(layer)
    if rule is None or not rule.rows or find_grad_rule(layer) is not rule.grad \
            or find_norm_rule(layer) not in (None, rule.norm):
        return False  # a rule registered apart from the LayerRule: not known to be row-wise
    return rule.rows is True or bool(rule.rows(layer))


def rule_less_rows(rows: FlatRows | None, layer, args, kwargs, outputs) -> tuple | None:
    """(m, T) when a layer without a rule (per-layer vmap) is called on flattened rows and
    computes its outputs row by row: every Tensor among its arguments and every output it
    returns for the gradient tagged (m, T), T > 1, the outputs' tags proved op by op inside
    its forward (a Mixture-of-Experts router and experts on (n·T, d) tokens). vmap then maps
    each sample's T rows (Eq. 2). Else None: the batch-on-dim-0 check as before."""
    if rows is None or not rows.tags or not outputs or find_grad_rule(layer) is not None:
        return None
    from workbench.per_sample.leaves import call_leaves

    tensors = [t for t in call_leaves(args, kwargs) if isinstance(t, torch.Tensor)]
    tag = rows.of(outputs[0])
    if tag is None or tag[1] == 1 or not tensors:
        return None
    for t in (*tensors, *outputs):
        if t.dim() == 0 or t.shape[0] != tag[0] * tag[1] or rows.of(t) != tag:
            return None
    return tag


def as_batch(t: torch.Tensor, tag: tuple[int, int]) -> torch.Tensor:
    """(m·T, ...) -> (m, T, ...), a view where the strides allow."""
    return t.reshape(*tag, *t.shape[1:])


__all__ = ["ELEMENTWISE", "FOLLOWED", "FlatRows", "RESHAPES", "ROW_WISE", "SORTS", "as_batch",
           "in_place", "keeps_rows", "merged", "passed_on", "row_wise", "rule_less_rows",
           "unflattened"]
