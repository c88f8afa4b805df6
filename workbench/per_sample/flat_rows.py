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
order, or written in place by anything but a write that keeps each row (an elementwise op,
``h[..., 0] = 0``, a mask filled: ``WRITES``; the write bumps the version counter that all
views of the storage share, and a tag holds at a later version only where every write since
kept the rows of a view aligned with the tagged tensor's: ``_kept``), or by a write of rows
addressed by an integer index (``x[idx] = v``, ``index_add_``, ``index_put_``, ``index_copy_``)
unless entry k's row idx[k] is the record of every operand's row k, which keeps the tag or,
into a tensor carrying no sample (a fresh ``torch.zeros``), makes one (``_row_writes``: the
wav2vec2 family's length mask, the eager MoE experts' outputs added back at their tokens;
tokens gathered from (n·T) rows, ``h[token_idx]``, carry their records as an order). A layer
called on a tensor computed from the batch that carries no tag in the records' order takes the
exact fallback (``unproved``, ``recording.batch_problem``): rows are proved, never assumed from a
shape. So time-major rows at T = n, window-major windows at n = windows per side, a sort
written as ``out[inv] = h``, give no tag with or without the self-check.
Ops are followed with gradients on or off: a custom ``autograd.Function`` runs its forward
without them and returns the very tensor its ops made (BLOOM's GELU).

Notation: n batch, T rows per sample, m the flattened tensor's dim 0 (n when right),
a activations, b backprops, ℓ_i per-sample loss.
"""

import math
import weakref

import torch

from workbench.per_sample.registry import find_grad_rule

RESHAPES = frozenset({"reshape", "view", "flatten", "unflatten", "reshape_as", "view_as"})
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
    "isnan", "isinf", "isfinite", "int", "long", "short", "bool", "byte", "char", "detach",
})  # pointwise: row r of the result from rows r of the operands (broadcasting: _elementwise)
ROW_WISE = frozenset({
    "transpose", "permute", "softmax", "log_softmax", "normalize", "matmul", "__matmul__", "bmm",
    "linear", "layer_norm", "group_norm", "rms_norm", "embedding", "conv1d", "conv2d", "conv3d",
    "scaled_dot_product_attention", "unsqueeze", "squeeze", "__getitem__", "mean", "sum",
    "amax", "amin", "logsumexp", "pad", "masked_fill", "roll", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
    "cumsum", "cumprod", "repeat_interleave", "addmm", "expand", "zeros_like", "ones_like",
    "full_like", "gather", "take_along_dim", "baddbmm", "batch_norm", "repeat", "argmax",
    "argmin", "argsort", "glu", "unfold", "interpolate", "flip", "index_select", "empty_like",
    "new_zeros", "new_ones", "new_full", "new_empty",
})  # row r of the result from rows r of the inputs (``keeps_rows``)
LIKE = ("zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones",
        "new_full", "new_empty")  # constant rows, one per row of x (with x's dim 0: an
# output buffer a recurrence fills step by step, ``out[:, t] = h``)
JOINS = frozenset({"cat", "concat", "concatenate", "stack"})  # along another dim than 0
SPLITS = frozenset({"split", "chunk", "unbind"})  # along another dim than 0: each part
SORTS = frozenset({"topk", "sort"})  # (values, indices) along another dim than 0: each part
REORDERS = frozenset({"__getitem__", "index_select", "gather", "take_along_dim"})  # _reorder
ROW_WRITES = frozenset({"__setitem__", "index_put_", "index_put", "index_add_", "index_add",
                        "index_copy_", "index_copy"})  # rows addressed by an index: _row_writes
FOLLOWED = RESHAPES | ELEMENTWISE | ROW_WISE | JOINS | SPLITS | SORTS | ROW_WRITES | {
    "einsum", "__getitem__", "__iter__", "index_select"}


AUGMENTED = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
})  # x += y, ...: not every name starting "__i" (``__invert__``, ``__iter__``, ``__index__``,
# ``__int__`` write nothing: read as writes until 2026-12-01, ``~mask`` lost its row tag, so
# the wav2vec2 family's ``h[~mask] = 0`` sent every layer after it to the exact fallback)


def in_place(name: str) -> bool:
    """``x.add_(y)``, ``x += y``, ``x[i] = y``: an op writing into its first argument."""
    return (name[-1:] == "_" and name[-2:] != "__") or name in AUGMENTED \
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


class IdentityRef(weakref.ref):
    """A weak reference that only compares identities and reads no values (a tag's, the
    taint's): ``owned.py`` does not count it as a reader, so a tensor tagged here may still
    have its storage freed by its one holder (the DP LSTM's hooked U = hh(H_prev), 25 MB at
    imdb_lstm's b = 64, was kept to the BPTT node's end by the tags' plain weak references:
    1.20x a plain step's peak instead of 1.13x, from 2026-11-30 to 2026-12-01)."""

    __slots__ = ()


class FlatRows:
    """Tensors whose rows are a batch flattened sample-major: {id: (weakref, m, T, version,
    order)}, ``order`` None where block s holds record s (the proof every rule relies on),
    else a key of ``orders``: block s holds record ``orders[key][s]`` (``_reorder``)."""

    def __init__(self, tainted=None):
        self.tags: dict[int, tuple] = {}
        self.moved: dict[int, tuple] = {}  # tagged rows moved to dim 1 by a permute (_unstacked)
        self.computed = tainted  # (t) -> whether t was computed from the batch (derived.Taint)
        self.tainted = None if tainted is None else self._carries  # ... and may carry a
        # sample's values: not a parameter's slice picked by a loop's index (``_picked``)
        self.picked: dict[int, tuple] = {}  # id -> (weakref, version): ``_picked``
        self.orders: dict[int, torch.Tensor] = {}  # key -> (m,) the records of the m blocks
        self._spans: dict[tuple, list] = {}  # (log, tag, stride 0) -> the writes' span
        # from a version on (``_spanned``)
        self.writes: dict[int, dict] = {}  # storage -> {version: (stride 0, offset, extent,
        # (m, T, order))}: the writes in place that kept the written view's rows (``_kept``)
        self.n: int | None = None  # the batch's size, from the model's inputs (``seed``)
        self.clean: int | None = None  # id of a tensor an op is writing that carried no
        # sample before the write (``uses.UseTracker._after`` notes it before the taint spreads)
        self._order_keys: dict = {}  # (count, bytes) -> key of ``orders``: equal orders, one key

    def of(self, t) -> tuple[int, int] | None:
        """(m, T) of a tagged tensor whose storage was not written since and whose blocks are
        the records in their order, or None. A write in place bumps the version counter its
        views share: every tag on that storage lapses at once, without a scan of the tags."""
        entry = self.tags.get(id(t))
        return entry[1:3] if entry is not None and entry[0]() is t and \
            (t._version == entry[3] or self._kept(t, entry)) and entry[4] is None else None

    def full(self, t) -> tuple | None:
        """(m, T, order) of a tagged tensor, its blocks in the records' order (order None) or
        in another (``orders``): what the ops pass on. Only ``of`` proves rows to a rule."""
        entry = self.tags.get(id(t))
        return (*entry[1:3], entry[4]) if entry is not None and entry[0]() is t and \
            (t._version == entry[3] or self._kept(t, entry)) else None

    def _kept(self, t: torch.Tensor, entry: tuple, version: int | None = None) -> bool:
        """Every write into t's storage since its tag (each bumps the version counter the
        storage's views share) was one that kept the rows of the view it wrote
        (``_wrote``: ``h[..., 0] = 0``, ``h[:, 0].mul_(2)``, a mask filled in place), with
        the same tag, each of that view's rows inside the storage block of t's row of the
        same index: t's rows still hold. The tag is renewed at t's version (or at
        ``version``, the one before a write being followed)."""
        if not self.writes or t.dim() < 1:
            return False
        log = self.writes.get(_storage(t))
        if log is None:
            return False
        own = (t.stride(0), t.storage_offset(), _extent(t))
        upto, tag = t._version if version is None else version, (*entry[1:3], entry[4])
        if not self._spanned(log, own, tag, entry[3] + 1, upto):
            for v in range(entry[3] + 1, upto + 1):
                w = log.get(v)
                if w is None or w[3] != tag or not _aligned(own, w[:3]):
                    return False
        self.tags[id(t)] = (entry[0], *entry[1:3], upto, entry[4])
        return True

    def _spanned(self, log: dict, own: tuple, tag: tuple, lo: int, hi: int) -> bool:
        """A sufficient test for ``_kept``'s scan of versions lo..hi: every write of ``log``
        from the first version asked about onwards had ``tag`` and a stride of own's, and own's
        rows with all of theirs lie inside one window of ``stride 0`` elements (so each write
        is ``_aligned`` with own). The writes' span is extended once per new version, so a
        recurrence's views of one (n, T, H) block, each made before the loop and read at its
        step, no longer rescan every write since their tag (imdb_lstm: 256 steps, ~250k
        checks a step, its DP step 1.7x -> 3.6x a plain one, from 2026-11-30 to 2026-12-01).
        False: not shown this way (the exact scan decides)."""
        key = (id(log), tag, own[0])
        span = self._spans.get(key)
        if span is None:
            span = self._spans[key] = [lo, lo - 1, None, None, True]  # [a, b, low, high, ok]
        a, b, low, high, ok = span
        while ok and b < hi:
            w = log.get(b + 1)
            if w is None or w[3] != tag or w[0] != own[0] or w[2] < 0:
                ok = False
                break
            b += 1
            low = w[1] if low is None else min(low, w[1])
            high = w[1] + w[2] if high is None else max(high, w[1] + w[2])
        span[1:] = [b, low, high, ok]
        if not (a <= lo and hi <= b) or own[0] <= 0 or own[2] < 0 or low is None:
            return False
        return max(own[1] + own[2], high) - min(own[1], low) < own[0]

    def _untouched(self, args, dest: torch.Tensor) -> None:
        """Before following ``op(..., out=dest)``: an operand on dest's storage, tagged just
        before the write, whose elements the write did not touch (each row's window of the
        operand and of dest disjoint: ``torch.mul(f, c[t], out=c[t + 1])`` in a recurrence),
        keeps its tag at the version the write made."""
        if dest.dim() < 1:
            return
        ptr, v = _storage(dest), dest._version
        where = (dest.stride(0), dest.storage_offset(), _extent(dest))
        for t in args:
            if not isinstance(t, torch.Tensor) or t is dest or t.dim() < 1:
                continue
            entry = self.tags.get(id(t))
            if entry is None or entry[0]() is not t or entry[3] == v or _storage(t) != ptr:
                continue
            if (entry[3] == v - 1 or self._kept(t, entry, v - 1)) and _disjoint(
                    (t.stride(0), t.storage_offset(), _extent(t)), where):
                self.tags[id(t)] = (entry[0], *entry[1:3], v, entry[4])

    def _wrote(self, t: torch.Tensor) -> None:
        """A write in place into t that kept t's rows (tagged at its new version)."""
        tag = self.full(t)
        if tag is not None and t.dim() >= 1:
            self.writes.setdefault(_storage(t), {})[t._version] = (
                t.stride(0), t.storage_offset(), _extent(t), tag)

    def order(self, t) -> torch.Tensor | None:
        """The records of t's blocks, (m,), where the model put them in another order than the
        batch's (``x[perm]``), else None."""
        tag = self.full(t)
        return None if tag is None or tag[2] is None else self.orders[tag[2]]

    @staticmethod
    def _tag_at(entry: tuple) -> tuple:
        return (*entry[1:3], entry[4])

    def tag(self, t: torch.Tensor, m: int, T: int, order: int | None = None) -> None:
        self.tags[id(t)] = (IdentityRef(t), m, T, t._version, order)

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
        if tag is None or x.dim() < 1 or x.shape[0] != tag[0] * tag[1]:
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
            if isinstance(first, torch.Tensor) and first.dim() > 1 and all(
                    d == 1 for d in first.shape[1:]) and all(
                    _broadcast_along_dim0(t, first, self.tainted) for t in rest):
                first, rest = first.reshape(-1), ()  # mask[arange(n)[:, None, None, None],
                # kv] (transformers' padding mask): one index per row, the others the same
                # for every row
        if isinstance(first, list) and first and all(type(i) is int for i in first):
            first = torch.tensor(first)
        if not isinstance(first, torch.Tensor) or first.dim() != 1 or first.dtype in (
                torch.bool, torch.uint8) or first.is_floating_point() or first.is_complex() \
                or result.dim() < 1 or result.shape[0] != first.shape[0]:
            return False
        m = tag[0]
        for t in rest:  # other indices pick inside row idx[r] (one entry per row): whatever
            # computed them, row r of the result is row idx[r]'s and its gradient goes there
            # alone (an index carries none; a record's index read by another record's row is
            # a coupling of values, the self-check's halves: ``selfcheck.check_model_halves``)
            if isinstance(t, torch.Tensor) and (t.dim() > 1 or t.dtype in (
                    torch.bool, torch.uint8)):
                return False
        with torch.no_grad():  # row r of x: block r // T (Mixture-of-Experts' h[token_idx],
            # its routing weights w[token_idx, top_k_pos] on (n·T, ...) tokens)
            new = self._records(tag, first.detach().to("cpu", torch.long) % max(x.shape[0], 1))
            same = new.numel() == m and bool((new == torch.arange(m)).all())
        if same:
            self.tag(result, m, 1)
        else:
            self.tag(result, new.numel(), 1, self._order_key(new))
        return True

    def _carries(self, t) -> bool:
        """t was computed from the batch and may hold a sample's values: not a slice of a
        tensor carrying no sample picked by scalar indices alone (``_picked``)."""
        if not self.computed(t):
            return False
        entry = self.picked.get(id(t)) if self.picked else None
        return entry is None or entry[0]() is not t or entry[1] != t._version

    def _picked(self, args, result) -> None:
        """``W[e]``, e a 0-d integer tensor computed from the batch (a Mixture-of-Experts
        block's loop over the experts the batch hit, ``gate_up_proj[expert_idx]``: Qwen2-MoE,
        OLMoE, Mixtral eager) and W carrying no sample: the result is W's values, the same
        for every row it meets, though computed from the batch by its index; a layer's op on
        tagged rows and it (``F.linear(h[token_idx], W[e])``) keeps the rows. The index's
        coupling of values (which expert a record's tokens reach depends on the router) is
        the self-check's halves' to see, as for every index."""
        src = args[0]
        index = args[1] if len(args) > 1 else None
        index = index if isinstance(index, tuple) else (index,)
        if not isinstance(result, torch.Tensor) or self._carries(src) or not any(
                isinstance(i, torch.Tensor) for i in index) or not all(
                i is None or i is Ellipsis or isinstance(i, (int, slice)) or (
                    isinstance(i, torch.Tensor) and i.dim() == 0 and not i.is_floating_point()
                    and not i.is_complex() and i.dtype != torch.bool) for i in index):
            return
        self.picked[id(result)] = (IdentityRef(result), result._version)

    def _order_key(self, records: torch.Tensor) -> int:
        """The key of ``orders`` holding ``records`` (one key for equal orders: the rows a
        Mixture-of-Experts block gathers for an expert, ``h[token_idx]``, and its routing
        weights gathered at the same tokens then meet in an elementwise op, tagged alike)."""
        found = (records.numel(), records.numpy().tobytes())
        key = self._order_keys.get(found)
        if key is None:
            key = self._order_keys[found] = len(self.orders)
            self.orders[key] = records
        return key

    def _records(self, tag: tuple, rows: torch.Tensor) -> torch.Tensor:
        """The record of each of ``rows`` (integer row numbers, CPU) of a tensor tagged
        ``tag`` = (m, T, order): block ``row // T``, in the order's records."""
        blocks = rows // tag[1]
        return blocks if tag[2] is None else self.orders[tag[2]][blocks]

    def _row_writes(self, name, args, kwargs, result, clean: bool) -> None:
        """``x[idx, ...] = v``, ``index_put_``, ``x.index_add_(0, idx, src)``,
        ``index_copy_`` (and the out-of-place ``index_add``, ``index_copy``, ``index_put``):
        entry k of the one-dimensional integer index ``idx`` writes row idx[k] of x from entry
        k of the other operands (the other indices, the values, ``src``'s row k). Row r of the
        result holds record ρ(r)'s values, ρ x's records by its tag, when every operand
        carrying a sample is tagged with one row per entry and entry k's row is record
        ρ(idx[k])'s: then the result keeps x's tag. x is tagged, or carried no sample before
        the write (a fresh ``torch.zeros``: ``clean``), whose rows are then the batch's n
        records' blocks of x.shape[0] / n rows each (the proof says so). So the mask the
        wav2vec2 family writes at each record's length, ``z[(arange(n), lengths - 1)] = 1``,
        and a Mixture-of-Experts block's expert outputs added back at their tokens,
        ``out.index_add_(0, token_idx, f(h[token_idx]))`` (Qwen2-MoE, OLMoE, Mixtral eager),
        keep their tags; ``index_add_`` with a permuted index, a write of row r from row
        (r + 1) mod n, or values of unknown rows do not (until 2026-12-01 none did: their
        layers took the exact fallback)."""
        x = args[0]
        inplace = in_place(name)
        dest = x if inplace else result
        if not isinstance(dest, torch.Tensor) or dest.shape[:1] != x.shape[:1]:
            return
        tag = None
        if inplace:
            entry = self.tags.get(id(x))
            if entry is not None and entry[0]() is x and (
                    x._version == entry[3] + 1 or self._kept(x, entry, x._version - 1)):
                tag = self._tag_at(entry)
        else:
            tag = self.full(x)
            clean = tag is None and not (self.tainted is None or self.tainted(x))
        if tag is None and clean and self.n and x.shape[0] % self.n == 0 and x.shape[0]:
            tag = (self.n, x.shape[0] // self.n, None)  # no sample in it yet: any blocks
        self.tags.pop(id(dest), None)
        if tag is None or tag[0] * tag[1] != x.shape[0]:
            return
        parts = _write_parts(name, args, kwargs)
        if parts is None:
            return
        first, rest, value, aligned = parts
        if isinstance(first, list) and first and all(type(i) is int for i in first):
            first = torch.tensor(first)
        if not isinstance(first, torch.Tensor) or first.dim() != 1 or first.dtype in (
                torch.bool, torch.uint8) or first.is_floating_point() or first.is_complex():
            return
        k = first.shape[0]
        for t in rest:
            if isinstance(t, torch.Tensor) and not (t.dim() == 0 or (
                    t.dim() == 1 and t.shape[0] == k)) or not (
                    t is None or isinstance(t, (int, slice, torch.Tensor))):
                return  # another index that would reshape the entries
        with torch.no_grad():
            want = self._records(tag, first.detach().to("cpu", torch.long) % x.shape[0])
            for t in (*rest, value):
                if not isinstance(t, torch.Tensor) or _no_sample(t, self.tainted):
                    continue
                mine = self.full(t)
                if mine is None or t.dim() == 0 or t.shape[0] != k or (
                        t is value and not aligned(t)) or not torch.equal(
                        self._records(mine, torch.arange(k)), want):
                    return
        self.tag(dest, *tag)
        if inplace:
            self._wrote(dest)  # aligned views of the storage keep their rows (``_kept``)

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
        sizes: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                self.tag(t, t.shape[0], 1)
                sizes[t.shape[0]] = sizes.get(t.shape[0], 0) + 1
        counts = sorted(sizes.values(), reverse=True)  # the batch's size: most inputs' dim 0
        # (a position table passed beside the batch, (1, T), is not it); a tie: not known
        self.n = max(sizes, key=sizes.get) if counts and (
            len(counts) == 1 or counts[0] > counts[1]) else None

    def after(self, name: str, args, kwargs, result) -> None:
        """Follow ``result = name(*args, **kwargs)`` (module docstring). With ``out=`` the
        destination is the result, not an operand, and a write into it that kept its rows
        keeps those of the views made of it before (``_kept``: a recurrence's gate buffers
        split once, written at every step)."""
        if kwargs and "axis" in kwargs:  # torch's alias of dim= (``x.sort(axis=0)``): every
            kwargs = {("dim" if k == "axis" else k): v for k, v in kwargs.items()}  # reader
            # below reads dim= (a sort along the records read as the default dim -1 was kept)
        if kwargs and "out" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != "out"}
            if isinstance(result, torch.Tensor) and self.writes is not None:
                self._untouched(args, result)
            self._follow(name, args, kwargs, result)
            if isinstance(result, torch.Tensor):
                self._wrote(result)
            return
        self._follow(name, args, kwargs, result)

    def _follow(self, name: str, args, kwargs, result) -> None:
        src = args[0] if args else None
        if name in ROW_WRITES and name != "__setitem__" or (
                name == "__setitem__" and len(args) > 1 and _advanced_first(args[1])):
            clean, self.clean = self.clean == id(src), None
            if isinstance(src, torch.Tensor) and src.dim() >= 1:
                self._row_writes(name, args, kwargs, result, clean)
            return
        if self.tags and (in_place(name) or kwargs.get("inplace") is True) and \
                isinstance(src, torch.Tensor):  # F.relu(x, inplace=True) writes x too
            entry = self.tags.get(id(src))  # its tag as of just before this op's one write
            if entry is None or entry[0]() is not src or src.dim() < 1 or not (
                    src._version == entry[3] + 1 or self._kept(src, entry, src._version - 1)):
                return  # the write lapsed every tag on src's storage (``of``)
            self.tag(src, *entry[1:3], entry[4])  # for the proofs below, then kept only if
            # one holds
            if name in ELEMENTWISE or name[:-1] in ELEMENTWISE:
                self._elementwise(args, kwargs, src)
            elif name not in WRITES or not _rows_written(name, args, kwargs, self._tag_at(entry),
                                                         self.full, self.tainted):
                self.tags.pop(id(src), None)
                return
            self._wrote(src)  # other views of the storage keep their rows too (``_kept``)
            return
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
        if name == "__getitem__" and self.computed is not None and isinstance(
                src, torch.Tensor) and self.full(src) is None:
            self._picked(args, result)
        if name in RESHAPES and isinstance(src, torch.Tensor) and src.dim() >= 1:
            self._reshaped(src, result)
        elif name in ROW_WISE and self.tags and isinstance(src, torch.Tensor):
            tag = self.full(src)
            if tag is not None and name == "permute" and _moves_dim0_to_1(args, kwargs, src):
                self.moved[id(result)] = (IdentityRef(result), *tag, result._version)
                return
            if tag is not None and keeps_rows(name, args, kwargs, result, self.full,
                                              self.tainted):
                self.tag(result, *tag)
            elif tag is None and (len(args) > 1 or name in SECOND) and (row := rows_second(
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
                if mine[2] is not None:  # a record's row picked from the batch (h[[0]],
                    tag = None  # index_select) broadcast to every record's rows: each row
                    break  # reads record 0's (probe W, 2026-12-01)
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


def _advanced_first(index) -> bool:
    """``x[idx, ...]``: the index of dim 0 is a tensor or list of integers (``_row_writes``)."""
    first = index[0] if isinstance(index, tuple) and index else index
    return (isinstance(first, torch.Tensor) and first.dtype not in (torch.bool, torch.uint8)
            and not first.is_floating_point()) or (
        isinstance(first, list) and bool(first) and all(type(i) is int for i in first))


def _write_parts(name, args, kwargs):
    """(idx, other indices, values, aligned) of a row write (``_row_writes``), or None:
    ``aligned(v)``: whether v's dim 0 runs along idx's entries (no broadcast over them)."""
    x = args[0]
    if name == "__setitem__":
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        value = args[2] if len(args) > 2 else None
    elif name in ("index_put_", "index_put"):
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        value = args[2] if len(args) > 2 else kwargs.get("values")
        if not isinstance(index, (tuple, list)) or not index:
            return None
        index = tuple(index)
    else:  # index_add(x, dim, index, source, alpha=...), index_copy(x, dim, index, source)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        idx = args[2] if len(args) > 2 else kwargs.get("index")
        value = args[3] if len(args) > 3 else kwargs.get("source")
        if not isinstance(dim, int) or x.dim() == 0 or dim % x.dim() != 0 or not isinstance(
                value, torch.Tensor) or value.dim() != x.dim():
            return None
        alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
        if isinstance(alpha, torch.Tensor):
            return None
        return idx, (), value, lambda v: True
    if any(i is Ellipsis for i in index):
        return None

    def aligned(v):
        with torch._C.DisableTorchFunction():
            part = x[index]
        return v.dim() == part.dim()
    return index[0], index[1:], value, aligned


def _broadcast_along_dim0(t, first: torch.Tensor, tainted) -> bool:
    """An index beside ``first`` (m, 1, ..., 1) that is the same for every row: a basic index
    (an int, a slice, None), or a tensor carrying no sample that broadcasts along first's dim 0
    (fewer dims, or dim 0 of 1)."""
    if not isinstance(t, torch.Tensor):
        return t is None or isinstance(t, (int, slice))
    return t.dtype != torch.bool and _no_sample(t, tainted) and (
        t.dim() < first.dim() or t.shape[0] == 1)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def _extent(t: torch.Tensor) -> int:
    """How far past its row's first element a row of t reaches in storage (-1: no element;
    None-like large for a negative stride, which ``_aligned`` refuses)."""
    if any(st < 0 for st in t.stride()):
        return 1 << 62
    return sum((size - 1) * st for size, st in zip(t.shape[1:], t.stride()[1:]) if size) \
        if all(t.shape[1:]) else -1


def _aligned(own: tuple, written: tuple) -> bool:
    """Do row r of the written view and row r of t (each (stride 0, offset, extent)) lie
    inside one window of ``stride 0`` elements, for every r? The windows of different r are
    then disjoint, so the write put nothing of row r into another row of t."""
    s0, off, ext = own
    w0, woff, wext = written
    if s0 != w0 or s0 <= 0 or wext < 0:
        return s0 == w0 and wext < 0  # an empty write changes nothing
    d = woff - off
    return max(d + wext, ext) - min(d, 0) < s0


WRITES = frozenset({"__setitem__", "masked_fill_", "fill_", "zero_", "copy_"})  # _rows_written


def _disjoint(own: tuple, written: tuple) -> bool:
    """No element of the written view is one of t's (each (stride 0, offset, extent), rows of
    both inside windows of ``stride 0`` elements: ``_aligned``'s layout)."""
    s0, off, ext = own
    w0, woff, wext = written
    if s0 != w0 or s0 <= 0 or ext < 0 or wext < 0:
        return False
    d = woff - off
    return max(d + wext, ext) - min(d, 0) < s0 and (d > ext or d + wext < 0)


def _rows_written(name, args, kwargs, tag, tag_of, tainted) -> bool:
    """Does the write in place ``name(x, ...)`` into tagged x keep row r of x from row r of x
    and of operands with x's rows or no sample? ``x[i] = v`` with an index leaving dim 0 whole
    (``h[..., 0] = 0``: basic indexing, or a mask with x's rows) and v a constant, a tensor
    carrying no sample, or x's rows; ``masked_fill_`` by such a mask; ``fill_``, ``zero_``;
    ``copy_`` from x's rows or a tensor carrying no sample."""
    x = args[0]
    if name in ("fill_", "zero_"):
        return all(_no_sample(v, tainted) for v in (*args[1:], *kwargs.values()))
    if name == "masked_fill_":
        return _filled(x, args, kwargs, None, tag_of, tainted)
    if name == "copy_":
        v = args[1] if len(args) > 1 else kwargs.get("src")
        return _no_sample(v, tainted) or (
            isinstance(v, torch.Tensor) and tag_of(v) == tag and v.shape == x.shape)
    index, value = (args[1], args[2]) if len(args) > 2 else (None, None)
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool:  # h[mask] = v
        return index.dim() >= 1 and index.shape[0] == x.shape[0] and (
            tag_of(index) == tag or _no_sample(index, tainted)) and (
            not isinstance(value, torch.Tensor) or (value.numel() == 1
                                                   and _no_sample(value, tainted)))
    if not _indexed(x, (x, index), {}, None, tag_of, tainted):
        return False
    if not isinstance(value, torch.Tensor) or _no_sample(value, tainted):
        return True
    with torch._C.DisableTorchFunction():
        part = x[index]
    return tag_of(value) == tag and value.dim() == part.dim() and \
        value.shape[0] == x.shape[0]


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


SECOND = {"gather": (2, "index"), "take_along_dim": (1, "indices"), "baddbmm": (1, "batch1"),
          "index_select": (2, "index"), "scaled_dot_product_attention": (1, "key")}
"""op name -> (position, keyword) of the operand whose rows ``rows_second`` reads."""


def rows_second(name: str, args, kwargs, result, tag_of, tainted):
    """The tag of ``result`` when its rows come from another operand than the first: ``D @ a``
    with D carrying no sample and broadcast along a's batch dims (Mamba's
    ``dt_proj.weight @ x``), ``addmm(c, a, W)`` (GPT-2's Conv1D: rows of a), a table's
    entries gathered by a tagged index, ``baddbmm(c, a, b)``; else None."""
    at, key = SECOND.get(name, (1, None))
    a, first = args[at] if len(args) > at else kwargs.get(key), args[0]
    tag = tag_of(a) if isinstance(a, torch.Tensor) else None
    if tag is None or result.dim() < 1 or kwargs and name not in ("addmm", *SECOND):
        return None
    if name in ("gather", "take_along_dim"):  # a table carrying no sample picked at each
        # row's own indices (RoBERTa's token-type buffer gathered by the position ids)
        dim = args[3 - at] if len(args) > 3 - at else kwargs.get("dim")
        ok = (isinstance(dim, int) and _spares_dim0(dim, a.dim()) and isinstance(
            first, torch.Tensor) and first.dim() == a.dim() and _no_sample(first, tainted)
              and result.shape[0] == a.shape[0] and (first.shape[0] in (1, a.shape[0])))
    elif name == "index_select":  # a table's rows picked by tagged ids, as embedding does
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        ok = (isinstance(dim, int) and isinstance(first, torch.Tensor) and first.dim() >= 1
              and dim % first.dim() == 0 and _no_sample(first, tainted) and a.dim() == 1
              and result.shape[0] == a.shape[0])
    elif name == "scaled_dot_product_attention":  # learned queries carrying no sample
        # (DETR's, Perceiver's latents) attending to the batch's keys and values
        others = [args[2] if len(args) > 2 else kwargs.get("value"),
                  args[3] if len(args) > 3 else kwargs.get("attn_mask")]
        ok = (isinstance(first, torch.Tensor) and a.dim() >= 3 and first.dim() == a.dim()
              and _no_sample(first, tainted) and first.shape[0] in (1, a.shape[0])
              and result.shape[0] == a.shape[0]
              and all(_alike_or_none(t, a, tag_of, tainted) for t in others))
    elif name == "baddbmm":  # input + batch1 @ batch2 with an input carrying no sample
        # (BLOOM's alibi without padding, repeated to the batch)
        other = args[2] if len(args) > 2 else kwargs.get("batch2")
        ok = (a.dim() == 3 and result.shape[0] == a.shape[0] and _no_sample(first, tainted)
              and _alike_or_none(other, a, tag_of, tainted))
    elif name == "addmm":
        ok = a.dim() == 2 and result.shape[0] == a.shape[0] and all(
            _no_sample(t, tainted) for t in (first, *args[2:3]))
    elif name == "__getitem__":  # W[idx]: a table's rows gathered by a tagged index (MoE's
        # experts' weights per token), row r of the result W[idx[r]]
        ok = (not a.is_floating_point() and not a.is_complex() and a.dtype != torch.bool
              and a.dim() >= 1 and result.shape[0] == a.shape[0] and _no_sample(first, tainted)
              and isinstance(first, torch.Tensor))
    elif name in ("matmul", "__matmul__"):
        ok = (a.dim() >= 3 and result.shape[0] == a.shape[0] and _no_sample(first, tainted)
              and isinstance(first, torch.Tensor) and (first.dim() < a.dim() or (
                  first.dim() == a.dim() and first.shape[0] in (1, a.shape[0]))))  # (latent
        # queries expanded to the batch: Perceiver's)
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
        tag = tag_of(t)  # broadcast along dim 0: one row for every row, as elementwise ops
        # allow, but not the batch's rows with gradient (SDPA keys h[:, 0] of fewer dims, a
        # record's row h[[0]]: every record's output would read the others'; probe W)
        return tag is None or not (t.requires_grad or tag[2] is not None)
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
    basic = [i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index]
    if not all(basic):  # one advanced index (a list, a tensor carrying no sample) after a
        # whole dim 0 stays where it is: x[:, [-1, 0]] (BigBird), x[..., idx]
        at = [k for k, b in enumerate(basic) if not b]
        lead = next((k for k, i in enumerate(index) if i is not None), None)
        if len(at) != 1 or lead is None or at[0] <= lead:
            return False
        pick = index[at[0]]
        used = sum(i is not None and i is not Ellipsis for i in index)
        return (_whole(index[lead]) or (index[lead] is Ellipsis and used < x.dim())) and (
            (isinstance(pick, list) and all(type(k) is int for k in pick))
            or (isinstance(pick, torch.Tensor) and pick.dtype != torch.bool
                and _no_sample(pick, tainted)))
    first = next((i for i in index if i is not None), Ellipsis)
    if first is Ellipsis:
        return sum(i is not None and i is not Ellipsis for i in index) < x.dim()
    return _whole(first)


def _whole(i) -> bool:
    """``:`` or ``::1``: every row in place."""
    return isinstance(i, slice) and i.start is None and i.stop is None and i.step in (None, 1)


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


def _batched_product(x, args, kwargs, result, tag_of, tainted):
    """``baddbmm(c, a, b)``: c + a @ b per matrix of dim 0 (BLOOM's alibi plus q kᵀ), every
    operand with x's rows or no sample, broadcast."""
    others = [*args[1:3], kwargs.get("batch1"), kwargs.get("batch2")]
    return x.dim() == 3 and all(_alike_or_none(t, x, tag_of, tainted) for t in others)


def _added_product(x, args, kwargs, result, tag_of, tainted):
    """``addmm(c, a, W)`` on tagged c: c + a W row by row, a with c's rows or no sample
    (broadcast), W carrying no sample (a recurrence's gates: the input part plus h W)."""
    a = args[1] if len(args) > 1 else kwargs.get("mat1")
    w = args[2] if len(args) > 2 else kwargs.get("mat2")
    return x.dim() == 2 and isinstance(a, torch.Tensor) and _alike_or_none(
        a, x, tag_of, tainted) and _no_sample(w, tainted)


def _frozen_normalised(x, args, kwargs, result, tag_of, tainted):
    """``batch_norm`` with ``training=False`` (running statistics: timm's BatchNormAct2d in
    eval mode): an affine map per channel, row by row; in training mode a batch statistic."""
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    return training is False and x.dim() >= 2 and all(
        _no_sample(a, tainted) for a in (*args[1:5], *(kwargs.get(k) for k in (
            "running_mean", "running_var", "weight", "bias"))))


def _repeated_rows(x, args, kwargs, result, tag_of, tainted):  # x.repeat(1, ...)
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) \
        else args[1:] or kwargs.get("repeats", ())
    return len(sizes) == x.dim() and sizes[0] == 1


def _arg_along(x, args, kwargs, result, tag_of, tainted):  # argmax/argmin/argsort, dim ≠ 0
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1 if x.dim() > 1 and len(
        args) == 1 and "dim" not in kwargs and result.shape == x.shape else None)
    return _spares_dim0(dim, x.dim())


def _halved(x, args, kwargs, result, tag_of, tainted):  # glu along dim ≠ 0 (default -1)
    return _spares_dim0(args[1] if len(args) > 1 else kwargs.get("dim", -1), x.dim())


def _unfolded(x, args, kwargs, result, tag_of, tainted):
    """``F.unfold`` (im2col, each row's own patches) or ``Tensor.unfold(d, size, step)``: a
    result with x's dim 0 has row r from row r (along d = 0 only size 1, step 1 keeps n)."""
    return all(_no_sample(a, tainted) for a in (*args[1:], *kwargs.values()))


def _resampled(x, args, kwargs, result, tag_of, tainted):  # F.interpolate on (n, C, ...)
    return x.dim() >= 3 and all(_no_sample(a, tainted) for a in (*args[1:], *kwargs.values()))


def _flipped(x, args, kwargs, result, tag_of, tainted):  # flip(x, dims) or x.flip(1, 0)
    dims = args[1] if len(args) == 2 else (args[1:] or kwargs.get("dims"))
    return _spares_dim0(dims, x.dim())


def _looked_up(x, args, kwargs, result, tag_of, tainted):  # embedding(ids, table)
    """``F.embedding(ids, W)``: rows of the ids. ``torch.embedding(W, ids)`` shares the name
    with the table first: a tagged table's rows picked by ids are not its own rows."""
    return not (x.is_floating_point() or x.is_complex()) and _weighted(
        x, args, kwargs, result, tag_of, tainted)


def _selected(x, args, kwargs, result, tag_of, tainted):  # index_select(x, d ≠ 0, idx)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    index = args[2] if len(args) > 2 else kwargs.get("index")
    return _spares_dim0(dim, x.dim()) and _no_sample(index, tainted)


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
       "linear": _weighted, "embedding": _looked_up, "conv1d": _convolved(1),
       "conv2d": _convolved(2), "conv3d": _convolved(3), "layer_norm": _normalised,
       "rms_norm": _normalised, "group_norm": _group_normalised, "mean": _reduced,
       "sum": _reduced, "amax": _reduced, "amin": _reduced, "logsumexp": _reduced,
       "unsqueeze": _unsqueezed, "squeeze": _reduced, "__getitem__": _indexed, "pad": _padded,
       "scaled_dot_product_attention": _attended, "masked_fill": _filled,
       "gather": _picked(1, 2, "index"), "take_along_dim": _picked(2, 1, "indices"),
       "baddbmm": _batched_product, "batch_norm": _frozen_normalised, "repeat": _repeated_rows,
       "argmax": _arg_along, "argmin": _arg_along, "argsort": _arg_along, "glu": _halved,
       "unfold": _unfolded, "interpolate": _resampled, "flip": _flipped,
       "index_select": _selected, "addmm": _added_product}
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


def unproved(rows: FlatRows | None, tainted, layer, args, kwargs, outputs) -> str | None:
    """Which tensor a call's rule (or vmap) would read as the batch's rows, one row per record
    in the batch's order, without any op having proved it: computed from the batch (``tainted``)
    but carrying no tag, because an op the tracker does not follow made it (a custom
    ``autograd.Function``, an FFT, a write ``out[inv] = h``, a 2-d index ``h[p[:, None], j]``).
    Such rows may be the batch's in another order, or mixed: a rule would give record r
    another record's gradient. A layer with a rule reads its first input (its outputs carry
    that input's tag, ``passed_on``); one without, every Tensor argument and output, which
    vmap maps row by row (a layer that sorts its rows inside has untagged outputs). None where
    every such tensor is proved, or nothing is followed (no use tracker ran). Until 2026-11-30
    shapes alone stood for the proof: such a call's rows were read as the records', the
    clipped sum 17% off in every mode, the self-check passing when the probed record kept its
    place (``recording.batch_problem`` sends the call to the exact fallback)."""
    if rows is None or not rows.tags or tainted is None:
        return None
    from workbench.per_sample.leaves import call_leaves

    if find_grad_rule(layer) is not None:
        read = [("input", a) for a in args if isinstance(a, torch.Tensor)][:1]
    else:
        read = [("argument", t) for t in call_leaves(args, kwargs) if isinstance(t, torch.Tensor)]
        read += [("output", t) for t in outputs]
    for kind, t in read:
        if t.dim() >= 1 and rows.of(t) is None and tainted(t):  # untagged, or in another
            # order (a rule-less layer that sorts its rows and returns them so)
            return f"an {kind} of shape {tuple(t.shape)}"
    return None


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


__all__ = ["AUGMENTED", "ELEMENTWISE", "FOLLOWED", "FlatRows", "RESHAPES", "ROW_WISE",
           "ROW_WRITES", "SORTS", "as_batch", "in_place", "keeps_rows", "merged", "passed_on",
           "row_wise", "rule_less_rows", "unflattened", "unproved"]
