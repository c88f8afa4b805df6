"""A proof that the loss is a sum of per-record terms: the coupling test's double backward spared.

``loss_watch.coupling`` differentiates the loss's part of the graph twice before the first
backward pass of each signature, while the model's activations are still held. On a causal
LM that part is the logits': the test held about six logit-sized tensors beside the
activations (OPT at the real table's base size: the first step peaked at 1.45x a plain
step, 1.18x with the test patched out). Most losses show what the test measures in the ops
that compute them: ``F.cross_entropy`` over the rows of the logits, a mean over positions, a
weighted sum of such terms. ``LossRows`` follows the loss window's ops with the model's own
row proof (``per_sample/flat_rows.py``), seeded with the tags the forward pass proved for
the outputs, and proves

    L = Σ_k c_k Σ_r φ_k(o's rows of record(r))                                          (1)

with no c_k carrying gradient. Then ∂²L/∂o_j ∂o_i = 0 for records i ≠ j exactly: the second
derivative the test measures vanishes, and the test need not run.

What keeps a proof (each rule conservative: anything else leaves the loss unproved, and the
test runs as before):

- a tensor is *row-wise* if it is an output the forward pass tagged with its records in the
  batch's order, or an op of ``FOLLOWED`` (views, casts, elementwise ops, softmaxes,
  reductions and picks along other dims than 0: what losses are made of; no write in place)
  made it from row-wise operands by ``FlatRows``' rule, every other operand carrying no
  gradient (an operand with gradient and no tag, even one broadcast
  along dim 0 as ``o.mean(0, keepdim=True)`` is, ends the proof: logits centred over the
  batch);
- a loss function (``LOSSES``) keeps rows with ``reduction="none"`` where its output has its
  input's shape, and makes a *separable scalar* with ``"mean"`` or ``"sum"``, its targets and
  weights carrying no gradient; a class loss needs classes on dim 1 (a 1-d input is one
  sample's classes: ``F.cross_entropy(o, y)`` on o of shape (n,) is a softmax over records);
- ``sum`` or ``mean`` to a 0-d result of a row-wise tensor is a separable scalar (every
  element belongs to one record); so is a sum or difference of separable scalars and
  constants, a separable scalar times or over a constant, its negation or cast;
- the op is one of torch's own functions or methods (``torch_functions``: a user's function
  dispatching through ``handle_torch_function``, or a ``torch.library`` custom op, reaches the
  mode under a torch op's name while its body runs unseen), every operand of an op is a plain
  tensor (a subclass's ``__torch_function__`` decides what
  its op computes) and no saved-tensor hooks are set (an unpack hook decides what the backward
  reads); two or more operands with gradient are row-wise alike (``LossRows._aligned``);
- the proof is used only where the graph from the loss down to the outputs holds no custom
  ``autograd.Function`` node (its backward may combine rows whatever its forward did; a
  module's full backward hook is one) and no gradient hook was registered, in the forward
  pass or the window (``loss_watch.coupling``), and no tensor of the proof carries one but the
  workbench's own (``foreign_hooks``: one registered where the window could not see it).

Notation: n batch size, o the model's outputs, (m, T) a tag: row r is record r // T's.
"""

import torch
from torch.utils._pytree import tree_flatten

from workbench.per_sample.flat_rows import ELEMENTWISE, RESHAPES, FlatRows, IdentityRef, in_place

CLASS_LOSSES = frozenset({"cross_entropy", "nll_loss", "multi_margin_loss",  # classes on
                          "multilabel_margin_loss", "multilabel_soft_margin_loss"})  # dim 1
TIME_MAJOR_LOSSES = frozenset({"ctc_loss"})  # (T, N, C): the records on dim 1
LOSSES = CLASS_LOSSES | TIME_MAJOR_LOSSES | frozenset({  # elementwise over input and target
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "soft_margin_loss"})
FOLLOWED = RESHAPES | ELEMENTWISE | frozenset({  # what a loss is made of; FlatRows' rules for
    # the model's layers (matmul, attention, convolution, embedding, cat, sort, ...) are not
    # taken here: a loss using them is left to the test (probe W found holes in four of them)
    "transpose", "permute", "squeeze", "unsqueeze", "__getitem__", "softmax", "log_softmax",
    "normalize", "sum", "mean", "amax", "amin", "logsumexp", "masked_fill", "gather",
    "take_along_dim", "expand"})
REDUCTIONS = frozenset({"sum", "mean"})  # to a 0-d result: over every element
SUMS = frozenset({"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "subtract"})
PRODUCTS = frozenset({"mul", "__mul__", "__rmul__", "multiply"})
QUOTIENTS = frozenset({"div", "__truediv__", "true_divide", "divide"})
SAME = frozenset({"neg", "__neg__", "negative", "float", "double", "half", "bfloat16", "to",
                  "type_as", "clone", "contiguous", "squeeze", "reshape", "view"})
SWAPS = frozenset({"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis"})
"""Ops that can move the records from dim 0 to dim 1 (a CTC loss's (T, N, C) input)."""
ALONG = frozenset({"log_softmax", "softmax", "float", "double", "half", "bfloat16", "to",
                   "type_as", "clone", "contiguous"})
"""Ops that keep a time-major tensor's records on dim 1 (a softmax along another dim)."""


PLAIN = (torch.Tensor, torch.nn.Parameter)  # types whose ops are what their names say


def _grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


class LossRows:
    """The loss window's row proof (module docstring): ``after`` each op of the window,
    ``proves(loss)`` at its backward."""

    def __init__(self, seeds):
        """``seeds``: (output, its forward tag (m, T, order) or None)."""
        self.rows = FlatRows(_grad)  # an operand with gradient "carries a sample"
        self.sums: dict[int, tuple] = {}  # separable scalars: id -> (ref, version)
        self.second: dict[int, tuple] = {}  # records on dim 1: id -> (ref, version, tag)
        for t, tag in seeds:
            if tag is not None and tag[2] is None and t.dim() >= 1:
                self.rows.tag(t, tag[0], tag[1])
        self.on = bool(self.rows.tags)

    def _row_wise(self, t):
        return self.rows.full(t) if isinstance(t, torch.Tensor) and t.dim() >= 1 else None

    def _separable(self, t) -> bool:
        entry = self.sums.get(id(t))
        return entry is not None and entry[0]() is t and entry[1] == t._version

    def after(self, name: str, args, kwargs, out, func=None) -> None:
        if not self.on:
            return
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(type(t) not in PLAIN for t in tensors) or \
                torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            self.on = False  # a subclass decides what its op computes; a saved tensor's
            return  # unpack hook decides what the backward reads: no proof from the ops
        operands = [t for t in tensors if t.requires_grad]
        if not operands:  # constants of o: an op's result carries nothing of o
            return
        if func is not None and func not in torch_functions():  # a user's function or a
            self.on = False  # custom op reaching the mode under a torch op's name (probe X):
            return  # its body runs unseen, so its name says nothing of what it computes
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name == "cdist" and not in_place(name) and self._distances(args, kwargs, operands,
                                                                        out):
            return
        if (name in SWAPS or name in ALONG) and self._time_major(name, args, kwargs,
                                                                 operands, out):
            return
        if name in LOSSES:
            self._loss(name, args, kwargs, operands, out)
        elif isinstance(out, torch.Tensor) and out.dim() == 0:
            if self._scalar(name, args, operands):
                self.sums[id(out)] = (IdentityRef(out), out._version)
        elif name in FOLLOWED and not in_place(name) and self._aligned(operands):
            self.rows.after(name, args, kwargs, out)
            return
        for t in results:  # an operand with gradient unproved: nothing made here is proved
            if t.dim() >= 1 and not (name in LOSSES and self._row_wise(t) is not None):
                self.rows.tags.pop(id(t), None)
        if in_place(name) and args and isinstance(args[0], torch.Tensor):
            self.rows.tags.pop(id(args[0]), None)
            self.sums.pop(id(args[0]), None)

    def _aligned(self, operands) -> bool:
        """Every operand with gradient row-wise, and two or more alike: one tag (records in
        one order), one number of dims, one dim 0. Then no rule below sees a row of o
        broadcast against the others (``o - o[[0]]``, SDPA with keys ``o[:, 0]`` of fewer
        dims: every record's term reading record 0's or all records' rows)."""
        tags = [self._row_wise(t) for t in operands]
        if any(tag is None for tag in tags):
            return False
        first = operands[0]
        return all(tag == tags[0] and t.dim() == first.dim() and t.shape[0] == first.shape[0]
                   for t, tag in zip(operands, tags))

    def _distances(self, args, kwargs, operands, out) -> bool:
        """``torch.cdist(x1, x2)`` (no second derivative: the coupling test cannot run on
        it): row r of the result is x1's row r's distances to x2's rows, so it is row-wise
        where x2 carries no gradient (distances to fixed prototypes), or where both are
        row-wise alike with a batch dim first (each record's points to its own)."""
        x1 = args[0] if args else kwargs.get("x1")
        x2 = args[1] if len(args) > 1 else kwargs.get("x2")
        if not isinstance(out, torch.Tensor) or not isinstance(x1, torch.Tensor) or \
                not isinstance(x2, torch.Tensor) or not operands or operands[0] is not x1:
            return False
        tag = self._row_wise(x1)
        if tag is None or out.dim() < 2 or out.shape[0] != x1.shape[0]:
            return False
        if len(operands) == 1 or (x1.dim() >= 3 and x2.dim() == x1.dim()
                                  and self._aligned(operands)):
            self.rows.tag(out, *tag)
            return True
        return False

    def _moved(self, t):
        entry = self.second.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[2] if entry is not None and entry[0]() is t and \
            entry[1] == t._version else None

    def _time_major(self, name, args, kwargs, operands, out) -> bool:
        """A row-wise tensor's records moved to dim 1 (``o.transpose(0, 1)``, a permute
        putting dim 0 second), and ops keeping them there (a softmax along another dim, a
        cast): a CTC loss's (T, N, C) input. Returns whether ``out`` was tagged so."""
        x = args[0] if args else kwargs.get("input")
        if len(operands) != 1 or operands[0] is not x or not isinstance(out, torch.Tensor) \
                or out.dim() < 2 or in_place(name):
            return False
        tag = None
        if name in SWAPS and self._row_wise(x) is not None and x.dim() >= 2:
            if out.shape[1] == x.shape[0] and _dim0_to_1(name, args, kwargs, x.dim()):
                tag = self._row_wise(x)
        elif name in ALONG and (tag := self._moved(x)) is not None:
            dim = args[1] if len(args) > 1 and name in ("log_softmax", "softmax") else \
                kwargs.get("dim")
            if name in ("log_softmax", "softmax") and not (
                    isinstance(dim, int) and dim % x.dim() != 1):
                tag = None
            if out.shape != x.shape:
                tag = None
        if tag is None or tag[2] is not None:
            return False
        self.second[id(out)] = (IdentityRef(out), out._version, tag)
        return True

    def _loss(self, name, args, kwargs, operands, out) -> None:
        x = args[0] if args else kwargs.get("input")
        if len(operands) != 1 or operands[0] is not x or not isinstance(out, torch.Tensor):
            return  # a target or weight with gradient (distillation from o itself)
        if name in TIME_MAJOR_LOSSES:  # log_probs (T, N, C): record r's row is dim 1's r
            tag = self._moved(x)
            if tag is not None and x.dim() == 3:
                if out.dim() == 0:
                    self.sums[id(out)] = (IdentityRef(out), out._version)
                elif out.shape == x.shape[1:2]:
                    self.rows.tag(out, *tag)
            return
        tag = self._row_wise(x)
        if tag is None or (name in CLASS_LOSSES and x.dim() < 2):
            return
        if out.dim() == 0:
            self.sums[id(out)] = (IdentityRef(out), out._version)
        elif out.shape == x.shape or (name in CLASS_LOSSES and out.shape[0] == x.shape[0]
                                       and out.shape[1:] == x.shape[2:]):
            self.rows.tag(out, *tag)

    def _scalar(self, name, args, operands) -> bool:
        if name in REDUCTIONS:  # a 0-d sum or mean: over every element
            x = args[0] if args else None
            return len(operands) == 1 and operands[0] is x and (
                self._row_wise(x) is not None or self._separable(x))
        if not all(self._separable(t) for t in operands):
            return False
        if name in SUMS:
            return True
        if name in PRODUCTS or name in SAME:
            return len(operands) == 1
        if name in QUOTIENTS:
            return len(operands) == 1 and bool(args) and operands[0] is args[0]
        return False

    def proves(self, loss) -> bool:
        """Is ``loss`` a separable scalar of the window (1), with no gradient hook but the
        workbench's own on any tensor of the proof (one registered where the window cannot
        see it: under ``DisableTorchFunction``, from another thread)?"""
        if not (self.on and self._separable(loss)):
            return False
        chain = (entry[0]() for entry in (*self.rows.tags.values(), *self.sums.values()))
        return not any(foreign_hooks(t) for t in chain if t is not None)


def _dim0_to_1(name, args, kwargs, ndim: int) -> bool:
    """Does ``name(x, ...)`` put x's dim 0 at dim 1 (and x's dim 1 at dim 0, for a
    transpose)? Read from the op's own arguments, never from the shapes (T = n by chance)."""
    rest = list(args[1:])
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = rest[:2] if len(rest) >= 2 else [kwargs.get("dim0"), kwargs.get("dim1")]
        if not all(isinstance(d, int) for d in dims):
            return False
        return sorted(d % ndim for d in dims) == [0, 1]
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else \
            (rest or kwargs.get("dims", ()))
        return len(dims) == ndim and all(isinstance(d, int) for d in dims) and \
            dims[1] % ndim == 0
    if name in ("movedim", "moveaxis"):
        src = rest[0] if rest else kwargs.get("source")
        dst = rest[1] if len(rest) > 1 else kwargs.get("destination")
        return isinstance(src, int) and isinstance(dst, int) and src % ndim == 0 and \
            dst % ndim == 1
    return False


def foreign_hooks(t: torch.Tensor) -> bool:
    """Does ``t`` carry a gradient hook other than the workbench's own (the recorder's)?"""
    return any(not getattr(h, "__module__", "").startswith("workbench.")
               for h in (t._backward_hooks or {}).values())


_TORCH: list = []


def torch_functions() -> frozenset:
    """torch's own overridable functions and methods (``torch.overrides``), built once: the
    only callables whose ``__name__`` the rules may trust."""
    if not _TORCH:
        _TORCH.append(frozenset(f for fs in torch.overrides.get_overridable_functions().values()
                                for f in fs))
    return _TORCH[0]


def opaque(nodes) -> bool:
    """Does the loss's part of the graph hold a node whose backward the proof cannot see (a
    custom ``autograd.Function``, a module's full backward hook)?"""
    return any(isinstance(node, torch.autograd.function.BackwardCFunction) for node in nodes)



__all__ = ["CLASS_LOSSES", "FOLLOWED", "LOSSES", "LossRows", "foreign_hooks", "opaque",
           "torch_functions"]
