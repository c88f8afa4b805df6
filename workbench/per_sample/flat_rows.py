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
op of the forward pass): a reshape / view / flatten that merges dim 0 with the next dims
tags its result (m, T); a tag is kept through a position-wise layer's recorded output, an
elementwise op (``ELEMENTWISE``: activations, dropout, arithmetic) whose other operands are
tagged alike or carry no rows, and a further reshape that keeps dim 0 whole. Nothing else
keeps a tag: rows reordered (``x[perm]``, ``flip``, ``roll``), concatenated, or mixed with a
tensor of another layout give an untagged tensor, and an in-place write into a tagged tensor's
storage that is not such an elementwise op (``copy_``, ``x[i] = y``) drops every tag there;
a layer called on an untagged tensor keeps the batch-on-dim-0 check and its exact fallback
(``recording.batch_problem``).

Whether dim 0 of the tensor that was flattened is the batch is checked like any call's: the
converted call's shapes are (m, T, ...), and m must be n (``batch_problem``), and 1 when one
sample runs alone (``selfcheck.probe``, on every new call signature): rows flattened
time-major, ``x.transpose(0, 1).reshape(-1, d)``, give m = T and are refused, at T = n by the
probe (the signature with n symbolic differs from T ≠ n's, so it is probed again).

Notation: n batch, T rows per sample, m the flattened tensor's dim 0 (n when right),
a activations, b backprops, ℓ_i per-sample loss.
"""

import math
import weakref

import torch

RESHAPES = frozenset({"reshape", "view", "flatten", "reshape_as", "view_as"})
ELEMENTWISE = frozenset({
    "relu", "relu_", "gelu", "silu", "tanh", "sigmoid", "elu", "selu", "celu", "leaky_relu",
    "hardtanh", "relu6", "mish", "hardswish", "hardsigmoid", "softplus", "erf", "exp", "neg",
    "abs", "pow", "sqrt", "rsqrt", "square", "dropout", "contiguous", "clone", "to", "float",
    "double", "half", "bfloat16", "type_as", "add", "sub", "mul", "div", "__add__", "__radd__",
    "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__neg__", "__pow__", "__rpow__",
})
ROW_WISE = frozenset({"transpose", "permute", "softmax", "log_softmax", "normalize", "matmul",
                      "__matmul__", "bmm"})  # row r of the result from rows r of the inputs
FOLLOWED = RESHAPES | ELEMENTWISE | ROW_WISE


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
    """Tensors whose rows are a batch flattened sample-major: {id: (weakref, m, T)}."""

    def __init__(self, tainted=None):
        self.tags: dict[int, tuple] = {}
        self.tainted = tainted  # (t) -> whether t was computed from the batch (derived.Taint)

    def of(self, t) -> tuple[int, int] | None:
        """(m, T) of a tagged tensor, or None."""
        entry = self.tags.get(id(t))
        return entry[1:] if entry is not None and entry[0]() is t else None

    def tag(self, t: torch.Tensor, m: int, T: int) -> None:
        self.tags[id(t)] = (weakref.ref(t), m, T)

    def after(self, name: str, args, kwargs, result) -> None:
        """Follow ``result = name(*args, **kwargs)`` (module docstring)."""
        src = args[0] if args else None
        if self.tags and in_place(name) and isinstance(src, torch.Tensor):
            before = self.of(src)
            if name in ELEMENTWISE:
                self._elementwise(args, kwargs, src)
            if name not in ELEMENTWISE or before is None or self.of(src) != before:
                self._written(src)  # rows may have moved: no tag on this storage stays
            return
        if not isinstance(result, torch.Tensor) or result.dim() == 0 or src is None:
            return
        if name in RESHAPES and isinstance(src, torch.Tensor) and src.dim() >= 1:
            self._reshaped(src, result)
        elif name in ROW_WISE and self.tags and isinstance(src, torch.Tensor):
            tag = self.of(src)
            if tag is not None and keeps_rows(name, args, kwargs, result, self.of, self.tainted):
                self.tag(result, *tag)
        elif name in ELEMENTWISE and self.tags and any(
                id(t) in self.tags for t in (*args, *kwargs.values())):
            self._elementwise(args, kwargs, result)

    def _written(self, t: torch.Tensor) -> None:
        """An in-place write into t's storage that keeps no proof: drop every tag there."""
        ptr = t.untyped_storage().data_ptr()
        for key, (ref, *_) in list(self.tags.items()):
            u = ref()
            if u is None or u.untyped_storage().data_ptr() == ptr:
                del self.tags[key]

    def _reshaped(self, src: torch.Tensor, out: torch.Tensor) -> None:
        k, tag = merged(src.shape, out.shape), self.of(src)
        if k is None or (tag is None and k < 2):
            return  # dim 0 split (or kept, untagged): not rows of a batch
        m, T = tag if tag is not None else (src.shape[0], 1)
        self.tag(out, m, T * math.prod(src.shape[1:k]))

    def _elementwise(self, args, kwargs, result: torch.Tensor) -> None:
        tag = None
        for t in (*args, *kwargs.values()):
            if not isinstance(t, torch.Tensor):
                continue
            mine = self.of(t)
            if mine is None:
                if t.dim() >= result.dim() and t.shape[0] != 1:
                    tag = None  # rows of unknown order meet these: no proof
                    break
                continue
            if t.shape != result.shape or (tag is not None and mine != tag):
                tag = None
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
    if name == "transpose":
        dims = [*args[1:3], *(kwargs.get(k) for k in ("dim0", "dim1") if k in kwargs)]
        return len(dims) == 2 and all(isinstance(d, int) and d % x.dim() != 0 for d in dims)
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        dims = dims or kwargs.get("dims", ())
        return len(dims) == x.dim() and isinstance(dims[0], int) and dims[0] % x.dim() == 0
    if name in ("softmax", "log_softmax", "normalize"):
        dim = args[1] if len(args) > 1 and name != "normalize" else (
            args[2] if len(args) > 2 else kwargs.get("dim", DEFAULT_DIM.get(name)))
        return isinstance(dim, int) and dim % x.dim() != 0
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


def unflattened(rows: FlatRows | None, layer, x, output) -> tuple[int, int] | None:
    """(m, T) when ``output = layer(x)`` is a position-wise layer on tagged rows (Eq. 2)."""
    if rows is None or not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    tag = rows.of(x)
    if tag is None or x.shape[0] != tag[0] * tag[1] or output.dim() == 0 \
            or output.shape[0] != x.shape[0] or not row_wise(layer):
        return None
    return tag


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


def as_batch(t: torch.Tensor, tag: tuple[int, int]) -> torch.Tensor:
    """(m·T, ...) -> (m, T, ...), a view where the strides allow."""
    return t.reshape(*tag, *t.shape[1:])


__all__ = ["ELEMENTWISE", "FOLLOWED", "FlatRows", "RESHAPES", "ROW_WISE", "as_batch", "in_place",
           "keeps_rows", "merged", "row_wise", "unflattened"]
