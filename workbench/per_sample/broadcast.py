"""A layer called without the batch and broadcast into it: ``tok + wpe(arange(T))``.

nanoGPT's positional embedding ``o = P[arange(T)]`` (T, C) has no batch dim; it meets the
batch once, in ``h = a + o`` with a (n, T, C). The gradient of the loss at o is Σ_i ∂ℓ_i/∂o,
the per-sample parts already summed, so o's own backprop cannot give per-sample gradients.
They are where o meets the batch: h_i = a_i + o, so if o is used nowhere else

    ∂ℓ_i/∂o = Σ_{broadcast dims} ∂ℓ_i/∂h_i                 (n, *o.shape) from (n, *h.shape[1:])

(``Tensor.sum_to_size``), and row i of ∂(Σ_j ℓ_j)/∂h is ∂ℓ_i/∂h_i because samples do not mix,
the assumption of every hook rule (``hooks.py``). A *position-wise* layer (its leading dims
are batch-like: Embedding, Linear, LayerNorm) called on the input x expanded to n copies
returns o expanded to n copies, so the call is recorded as if it had been that one,

    activations  x.expand(n, *x.shape)      backprops  ∂ℓ_i/∂o  (n, *o.shape)

and the layer's ordinary rule (grad sampler, norm sampler, book-keeping's weight gradient
from c ⊙ b) applies to it unchanged.

When is this done? The use tracker (``uses.py``) follows every differentiable use of the
output o of such a call during the forward pass and the loss, and of every tensor derived from
o by shape-only ops (``shape_ops.py``: T5's ``o.permute(2, 0, 1).unsqueeze(0)``). Each use
must be one of

- a shape-only op of the tensor, or an add of a constant keeping its shape (an older T5's
  causal mask merged into the bias): its result D is followed too, with π, the position in o
  of each of D's elements;
- a *meeting*: an ``add`` (``+``, ``torch.add``, ``+=`` into the other operand) with a tensor
  that carries dim 0 of the result, the followed tensor broadcast along that dim 0 (fewer dims
  than h, or size 1 in dim 0). T5 adds its bias to every layer's scores: one meeting a layer.
  Also ``where(cond, D, c)`` with cond carrying the batch (a padding mask on the bias: h_i
  takes D where cond_i chooses it, the gradient elsewhere is dropped), and SDPA's
  ``attn_mask`` (Hugging Face's SDPA path): the use tracker passes D expanded to q's batch
  dim instead (``BatchFree.rewrite``: the same values), and that expand is the meeting.
  Also an add of D' = D.expand(m, ...), which widens D's dim 0 of size 1 to m (or a copy
  of it: ``contiguous``, ``clone``), with a tensor of m samples of the same dims (MPNet's
  bias, expanded to the batch size before it meets the scores): D' has m equal rows and
  row i meets sample i alone, which is D broadcast along dim 0: D's meeting (``widened``).
  And a ``cat`` along a dim ≥ 1 with a tensor carrying the batch, D repeated to it (prompt
  tuning's virtual tokens: ``concat.py``).

With no other use (``poison``: an op that is neither, a product, an in-place op, two tensors
followed from one o in one op, a tensor the model returns) and at least one meeting, the call
is converted, and the per-sample gradient at o is the sum over meetings m of h_m's gradient
summed over the broadcast dims and scattered back through π_m (``Meeting``):

    ∂ℓ_i/∂o = Σ_m scatter_{π_m}( Σ_{broadcast dims} ∂ℓ_i/∂h_{m,i} )           (n, *o.shape)

Correct because o reaches the loss only through the h_m (every other use was refused) and
row i of each h_m's gradient is sample i's. A no-op that returns o itself (``o.to(o.device)``,
as Hugging Face's GPT-2 writes it) is not a use. Otherwise the call stays as it was; its dim 0
is then not the batch and ``recording.py`` sends its parameters to the exact fallback. The
self-check (``selfcheck.py``) runs the same conversion at n = 1 and compares the result with
micro-batching, which verifies the assumption numerically; a call converted at n = 1 but
not at n (a dim 0 of size 1 broadcasts at n = 1 only) is sent to the fallback
(``selfcheck.treatment``).

Notation: n batch size, T sequence length, C width, o the batch-free output, D a tensor
derived from o by shape-only ops (o itself included), h = a + D, π D's positions in o.
"""

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from workbench.per_sample.concat import CATS, concat_part, row_positions
from workbench.per_sample.shape_ops import (
    SHAPE_OPS,
    chosen_by_batch,
    constant_add,
    in_place,
    op_of,
    replay,
)
from workbench.per_sample.views import capture_edge, stale, watched

# position-wise layers: layer(x.expand(n, *x.shape)) == layer(x).expand(n, *o.shape), exact type
BROADCASTABLE = (nn.Embedding, nn.Linear, nn.LayerNorm)
ADDS = {"add", "add_", "__add__", "__radd__", "__iadd__"}
#: names some test of ``BatchFree._use`` can accept (an add, ``where``, a shape-only op); any
#: other op on a followed tensor poisons it (the model's usual op: one set test, not five)
FOLLOWED_NAMES = frozenset(ADDS | SHAPE_OPS | CATS | {"where"})


@dataclass
class Meeting:
    """Where a batch-free call's output o (or D, derived from it) meets the batch: one h_m
    per meeting, with the size its gradient is summed to and D's positions π_m in o."""

    edges: list  # [GradientEdge of h_m = a_m + D_m]
    targets: list  # per meeting: (n, 1, ..., *D_rest), h_m's gradient summed to this size
    indices: list  # per meeting: π_m flattened (D_m.numel(),) (-1 -> o.numel()), or None: o
    shape: tuple  # (n, *o_rest): the per-sample backprop of the expanded call
    keeps: list = field(default_factory=list)  # per meeting: where D_m was chosen, or None
    new_dim: bool = False  # the call's inputs got a batch dim (else its dim 0 of 1 expanded)
    views: list = field(default_factory=list)  # per meeting: h_m's shape, b read at its base
    parts: list = field(default_factory=list)  # per meeting: (dim, start, length) of D_m in
    # h_m = cat([..., D_m, ...], dim) (concat.py), or None

    @property
    def edge(self) -> GradientEdge:
        return self.edges[0]

    def reduce(self, grads) -> torch.Tensor:
        """∂ℓ_i/∂o (n, *o_rest) from each ∂(Σ ℓ)/∂h_m (n, *h_m.shape[1:]); None: h_m unused."""
        n, size, total = self.shape[0], 1, None
        for s in self.shape[1:]:
            size *= s
        keeps = self.keeps or [None] * len(self.edges)
        keeps = self.keeps or [None] * len(self.edges)
        views = self.views or [None] * len(self.edges)
        parts = self.parts or [None] * len(self.edges)
        for g, target, index, keep, view, part in zip(grads, self.targets, self.indices, keeps,
                                                      views, parts):
            if g is None:
                continue
            if view is not None:  # h_m is a view, its gradient read at its base (views.py)
                g = g.reshape(view)
            if part is not None:  # h_m = cat(..., D_m, ...): D_m's positions (concat.py Eq. 1)
                g = g.narrow(*part)
            if keep is not None:  # h_m = where(cond_i, D_m, c): no gradient where c chosen
                g = torch.where(keep, g, g.new_zeros(()))
            g = g.sum_to_size(target).reshape(n, -1)  # (n, D_m.numel())
            if index is not None:  # scatter back through π_m (shape_ops.py); π = -1 (no
                # position in o, a masked element) goes to a spare column, dropped
                g = g.new_zeros(n, size + 1).index_add_(1, index, g)[:, :size]
            total = g if total is None else total + g
        return total.reshape(self.shape)


@dataclass(eq=False)  # compared by identity
class _Watched:
    """One batch-free call's output o, followed through its shape-only ops to its meetings."""

    call: object  # hooks.LayerCall
    shape: tuple  # o's shape
    device: torch.device
    poisoned: bool = False  # a use that is neither a shape-only op nor a meeting
    meetings: list = field(default_factory=list)  # [(edge, target, node, n, new_dim, keep,
    # view, watch)] (``meeting``)

    def positions(self, node) -> torch.Tensor | None:
        """π of a node's tensor flattened, -1 (masked) -> o.numel(), a spare column; None
        for o itself; False when a replay fails (``shape_ops.replay``)."""
        chain = []
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        if not chain:
            return None
        index = torch.arange(math.prod(self.shape), device=self.device).view(self.shape)
        for node in reversed(chain):
            index = replay(node.op, index, node.shape)
            if index is None:
                return False
        index = index.flatten()
        return torch.where(index < 0, math.prod(self.shape), index)


@dataclass(eq=False)
class _Node:
    ref: weakref.ref  # o or a tensor derived from it (weakly: an id may be reused once freed)
    entry: _Watched
    parent: object = None  # the node of the op's input; None for o itself
    op: tuple = None  # shape_ops.op_of: how this tensor was made from its parent's
    shape: tuple = ()
    expanded: object = None  # D' = D.expand(m, ...) (then copied): D's node (``widened``)


def meets_batch(func, args, kwargs, o: torch.Tensor, h, expanded: bool = False) -> bool:
    """Is ``h = func(*args)`` an add in which o is broadcast along h's batch dim 0?
    ``expanded``: o is D' = D.expand(m, ...) (``widened``), whose m equal rows then meet
    h's m samples one to one, as D broadcast would."""
    if getattr(func, "__name__", "") not in ADDS or len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return False
    if args[0] is o and func.__name__ in ("add_", "__iadd__"):
        return False  # o += a: o itself is overwritten
    a = args[1] if args[0] is o else args[0]
    if not (isinstance(a, torch.Tensor) and isinstance(h, torch.Tensor) and h.dim() >= 1):
        return False
    carries = a.dim() == h.dim() and a.shape[0] == h.shape[0]
    if expanded:
        broadcast = o.dim() == h.dim() and o.shape[0] == h.shape[0]
    else:
        broadcast = 1 <= o.dim() < h.dim() or (o.dim() == h.dim() and o.shape[0] == 1)
    return carries and broadcast and h.requires_grad


EXPANDS = {"expand", "expand_as", "broadcast_to"}
COPIES = {"contiguous", "clone"}  # D' copied row for row: still m equal rows


def widened(func, node: _Node, t: torch.Tensor, result: torch.Tensor):
    """The node of D when ``result`` is D' = D.expand(m, ...) with D's dim 0 of 1 widened to
    m > 1 (MPNet's bias: ``values.expand((bsz, -1, q, k)).contiguous()``), or a copy of such
    a D'; else None. D' has m equal rows; where it meets a tensor of m samples (an add of
    the same dims), row i goes to sample i alone, which is D broadcast along dim 0: the
    meeting is D's (``meets_batch(expanded=True)``)."""
    name = getattr(func, "__name__", "")
    if name in COPIES and result.shape == t.shape:
        return node.expanded
    if (name in EXPANDS and t.dim() == result.dim() >= 1 and t.shape[0] == 1
            and result.shape[0] > 1 and tuple(result.shape[1:]) == tuple(t.shape[1:])):
        return node
    return None


def meeting(node: _Node, d_shape: tuple, h: torch.Tensor, keep=None, part=None) -> tuple:
    """(edge, target, node, n, new_dim, keep, view, watch, part) of the meeting h = a + d (or
    h = where(cond, d, c): ``keep``, where d was chosen; or h = cat(..., d, ...): ``part``,
    d's place in h, concat.py), d (of shape ``d_shape``) followed by ``node``; h's edge
    where a later in-place op cannot take it out of the graph (``views.capture_edge``: at
    the base of ``h += o``'s view, ``view`` h's shape), ``watch``: h as a partial view."""
    d_shape, h_shape = tuple(d_shape), tuple(h.shape)
    n, new_dim = h_shape[0], len(d_shape) < len(h_shape)
    target = (n, *[1] * (len(h_shape) - 1 - len(d_shape)), *d_shape) if new_dim else (
        n, *d_shape[1:])
    edge, view = capture_edge(h)
    return edge, target, node, n, new_dim, keep, view, watched([h]), part


class BatchFree:
    """The outputs of position-wise layer calls during one forward pass, and their uses."""

    def __init__(self):
        self.watched: dict[int, _Node] = {}  # id(t) -> the node of the live o or D
        self.entries: list[_Watched] = []  # all, also of outputs freed (their ids reused)

    def watch(self, call, output: torch.Tensor) -> None:
        entry = _Watched(call, tuple(output.shape), output.device)
        self.watched[id(output)] = _Node(weakref.ref(output), entry, shape=tuple(output.shape))
        self.entries.append(entry)

    def saw(self, func, args, kwargs, result, differentiable) -> None:
        """Follow one torch function's uses of watched tensors (module docstring)."""
        if not differentiable(result):
            return
        nodes = []
        for a in (*args, *kwargs.values()):
            for b in (a if type(a) in (list, tuple) else (a,)):
                node = self.watched.get(id(b))
                if node is not None and node.ref() is b and not node.entry.poisoned:
                    nodes.append((node, b))  # a poisoned output is not followed further
        entries = [node.entry for node, _ in nodes]
        for node, t in nodes:
            if entries.count(node.entry) > 1:  # two of its tensors in one op (D + D): no
                node.entry.poisoned = True  # single meeting says how they combine
            else:
                self._use(node, t, func, args, kwargs, result)

    def _use(self, node: _Node, t: torch.Tensor, func, args, kwargs, result) -> None:
        entry = node.entry
        if in_place(func, args, t):  # t changed under its π (o.mul_(2), D.unsqueeze_(0))
            entry.poisoned = True
        elif result is t:  # a no-op returning t itself (Hugging Face's ``o.to(device)``)
            return
        elif getattr(func, "__name__", "") not in FOLLOWED_NAMES:
            entry.poisoned = True  # what the tests below end in for any other op, by name
        elif (op := constant_add(func, args, kwargs, t, result)) is not None:
            self.watched[id(result)] = _Node(weakref.ref(result), entry, node, op,
                                             tuple(result.shape))
        elif meets_batch(func, args, kwargs, t, result):
            entry.meetings.append(meeting(node, t.shape, result))
        elif node.expanded is not None and meets_batch(func, args, kwargs, t, result,
                                                       expanded=True):
            entry.meetings.append(meeting(node.expanded, node.expanded.shape, result))
        elif (keep := chosen_by_batch(func, args, kwargs, t, result)) is not None:
            entry.meetings.append(meeting(node, t.shape, result, keep))
        elif (part := concat_part(func, args, kwargs, t, result)) is not None:
            entry.meetings.append(meeting(node, t.shape, result, part=part))  # prompt tuning
        else:
            op = op_of(func, args, kwargs, t, result)
            if op is None:
                entry.poisoned = True  # any other use: o stays batch-free (exact fallback)
            else:
                self.watched[id(result)] = _Node(weakref.ref(result), entry, node, op,
                                                 tuple(result.shape),
                                                 widened(func, node, t, result))

    def rewrite(self, func, args, kwargs) -> tuple:
        """(args, kwargs) of ``scaled_dot_product_attention(q, k, v, attn_mask=D)`` with a
        followed D broadcast along q's batch dim 0 (T5's bias on Hugging Face's SDPA path):
        D expanded to that dim, e = D.expand(n, ...), a meeting whose gradient (n, ...) is
        per sample (SDPA adds its mask to the scores); the same values, the same op."""
        position = 3 if len(args) > 3 else None
        d = args[3] if position else kwargs.get("attn_mask")
        node = self.watched.get(id(d))
        q = args[0] if args else kwargs.get("query")
        if (node is None or node.ref() is not d or node.entry.poisoned or not d.requires_grad
                or not isinstance(q, torch.Tensor) or d.dim() > q.dim() or d.dim() < 1
                or (d.dim() == q.dim() and d.shape[0] != 1)):
            return args, kwargs
        with torch._C.DisableTorchFunction():  # the workbench's op, not the model's use
            m = d.reshape(*[1] * (q.dim() - d.dim()), *d.shape)  # q's dims, dim 0 of size 1
            e = m.expand(q.shape[0], *m.shape[1:])  # (n, ...): a view, no memory
        node.entry.meetings.append(meeting(node, d.shape, e))
        if position:
            return (*args[:3], e, *args[4:]), kwargs
        return args, {**kwargs, "attn_mask": e}

    def exclude(self, tensors) -> None:
        """Outputs the model returns: their uses in the loss are not seen (optimizer)."""
        for t in tensors:
            node = self.watched.get(id(t))
            if node is not None and node.ref() is t:
                node.entry.poisoned = True  # never converted

    def finish(self, recorder) -> None:
        """After the forward pass (and loss): convert each call whose output met the batch
        and was used in no other way."""
        for entry in self.entries:  # o itself may be freed by now
            if not entry.poisoned and entry.meetings:
                convert(recorder, entry, entry.meetings)
        self.watched.clear()
        self.entries.clear()


def expanded(t: torch.Tensor, n: int, new_dim: bool) -> torch.Tensor | None:
    if new_dim:
        return t.unsqueeze(0).expand(n, *t.shape)  # (n, *x.shape)
    return t.expand(n, *t.shape[1:]) if t.dim() >= 1 and t.shape[0] == 1 else None


def convert(recorder, entry: _Watched, meetings: list) -> None:
    """Record the entry's call as the call on the inputs expanded to the batch (module
    docstring)."""
    call = entry.call
    if call.is_tuple or len(call.outputs) != 1 or any(isinstance(v, torch.Tensor)
                                                      for v in call.kwargs.values()):
        return
    edges, targets, nodes, sizes, new_dims, keeps, views, watches, parts = zip(*meetings)
    n = sizes[0]
    if any(s != n for s in sizes):
        return  # h's dim 0 differs between meetings: not one batch
    if any(stale(w) for w in watches):
        return  # h, a partial view, written in place later: its edge left the graph
    known = {id(node): entry.positions(node) for node in nodes}  # π (shape_ops.py), once
    indices = [known[id(node)] if part is None else row_positions(known[id(node)], n)
               for node, part in zip(nodes, parts)]  # per meeting: T5 meets once a layer;
    # a cat: D's rows must be copies of one (concat.py), π of that row
    if any(i is False for i in indices):
        return  # an op that did not replay on π: stays batch-free (exact fallback)
    o_shape, dtype, device = call.outputs[0]
    # o (1, ...) added directly with as many dims as h: o's dim 0 was the broadcast one
    new_dim = any(new_dims) or any(i is not None for i in indices)
    args = [expanded(a, n, new_dim) if isinstance(a, torch.Tensor) else a for a in call.args]
    if any(e is None for e in args):
        return
    rest = tuple(o_shape) if new_dim else tuple(o_shape[1:])
    call.args = tuple(args)
    call.meet = Meeting(list(edges), list(targets), list(indices), (n, *rest), list(keeps),
                        new_dim, list(views), list(parts))
    call.outputs = [(torch.Size((n, *rest)), dtype, device)]
    recorder.redirect(call, call.meet.edges)


REWRITES = {torch.nn.functional.scaled_dot_product_attention}
"""torch functions whose followed arguments ``BatchFree.rewrite`` expands to the batch."""

__all__ = ["ADDS", "BROADCASTABLE", "REWRITES", "BatchFree", "Meeting", "convert", "expanded",
           "meets_batch"]
