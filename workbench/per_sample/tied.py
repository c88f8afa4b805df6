"""A parameter used by an op that has a rule (``F.linear``, ``F.embedding``, a pick of its rows, a
broadcast into the batch) outside a layer that owns it, or inside one without a rule.

GPT-2 and nanoGPT tie the output head to the token embedding (Press & Wolf 2017, arXiv
1608.05859) and write it as ``F.linear(h, self.wte.weight)``, outside any module call: no
module hook sees it. The use tracker (``uses.py``) sees the call with its arguments, and the
call *is* a Linear layer's:

    o = x Wᵀ (+ c)        ∂ℓ_i/∂W = Σ_t b_{i,t} x_{i,t}ᵀ       (n, p, d)   Linear rule, Eq. (5)
                                                              of Yousefpour et al. 2021

so it is recorded as a call of a *functional layer*: an ``nn.Linear`` built around the same
Parameter objects (no copy; its path names them, e.g. ``F.linear(wte.weight)``), with the
activations x and the backprops of o captured like any module call's. Every Linear rule
(grad sampler, ghost norm, book-keeping) then applies unchanged, and its dim 0 is checked like
any call's (``recording.batch_problem``, ``selfcheck.probe``).

The parameter is now used in two calls (the Embedding and the head), so its per-sample
gradient is the *sum* of the two rules' results, and its norm has cross terms:
``Recording.shared_ids`` lists it, and ghost clipping and book-keeping materialise it
(n, V, d) and sum before taking the norm (``clipping/ghost.py``).

Only ``F.linear(x, W)`` and ``F.linear(x, W, c)`` with W (and c) trainable parameters used
outside the layers that own them, and x not a parameter, are recorded this way. Anything else
(``h @ W.T``, ``torch.matmul(h, W.t())``, a weight computed from W) stays an uncovered use:
its parameter gets the exact whole-model fallback (``fallback.py``).

**The lookup op of an Embedding subclass.** OPT's and BART's learned positional embeddings
are ``nn.Embedding`` subclasses whose ``forward(attention_mask)`` builds its own indices
(``cumsum(mask) - 1``, or ``arange(T)``, then ``+ 2``) and ends in ``F.embedding(ids, W)``;
the module's input is not the indices, so the Embedding rule cannot be applied to its call
(and must not be inherited: ``registry.find_rule``). The op itself *is* an Embedding's:

    o = F.embedding(x, W)        ∂ℓ_i/∂W = Σ_t e_{x_{i,t}} b_{i,t}ᵀ     (n, V, d)  embedding.py

with x the indices actually passed. So an ``nn.Embedding`` subclass without a rule of its own
is *not* hooked as a layer (``delegates``): every use of its parameter is a use outside a
layer, each ``F.embedding(x, W)`` is recorded as a call of a functional ``nn.Embedding`` with
the same options, and any other use of W is uncovered (exact fallback). Whatever the forward
computes around the lookup (its indices, a scale after it) is then the model's business, and
the rule is exact without knowing how the indices were built. Options whose rule differs
(``max_norm``, ``sparse``, ``scale_grad_by_freq``) are not recorded: exact fallback.

**A parameter broadcast into the batch** (``cls_token.expand(n, -1, -1)``, ``x + pos_embed``:
timm's ViT, Hugging Face's ``ViTEmbeddings``) is recorded as a call of a ``BroadcastParameter``
layer (``rules/broadcast.py``: ∂ℓ_i/∂p = the op's backprop summed over the broadcast dims),
where p is used outside its owners or inside an owner without a rule (which would otherwise
run vmap on the whole owner, for timm's ViT the whole model). The owner then hands p over
(``Recording.taken``), unless p is also used otherwise inside it (``settle_broadcast``: the
owner's vmap keeps it, the broadcast calls are dropped).

**A parameter multiplied into the batch** (a layer scale: timm's ConvNeXt block
``x.mul(gamma.reshape(1, -1, 1, 1))``, Hugging Face's ``hidden * lambda1``): h_i = x_i ⊙ p,
∂ℓ_i/∂p = Σ_{broadcast dims} ∂ℓ_i/∂h_i ⊙ x_i, recorded as a call of a ``BroadcastProduct``
layer on x (``rules/broadcast.py``), under the same conditions. A reshape or view of p
(``VIEWS``) is not itself a use: it is remembered (``record_view``) and its first real use
decides (``use_views``): a product with the batch is recorded as above, anything else counts
as a use of p where the view was made, exactly as before.

**Ops of a layer without a rule.** A layer without a rule takes per-layer vmap, but the ops
its forward applies to its parameters may have rules of their own. Mixtral's router is
``F.linear(tokens, W)`` on the flattened (n·T, d) tokens, then a softmax and a top-k; its
experts pick each token's weights from a 3-D parameter, ``W[expert_ids]`` (Hugging Face's
batched experts). Where the op's batch operand has rows proved to be the batch's
(``flat_rows.py``: the batch on dim 0, or flattened sample-major), ``F.linear`` and
``F.embedding`` inside such an owner are recorded as functional Linear and Embedding calls,
and a pick of a parameter's rows by such
integer indices (``W[ids]``, ``index_select(W, 0, ids)``; outside its owners too) as a call of
a ``ParameterRows`` layer (``rules/gather.py``: an embedding lookup in a table whose rows are
tensors). The owner hands those parameters over, as it does a broadcast one, unless it also
uses them otherwise (``settle_broadcast``: its vmap then covers every use). Indices whose rows
are not proved the batch's (a position table picked by ``arange``) are no such call.

Notation: n batch, x activations (n, ..., d) or indices (n, T), b backprops (n, ..., p),
W (p, d), c bias (p,), V vocabulary, d width.
"""

import weakref

import torch
from torch import nn
from torch.nn import functional as F

from workbench.per_sample.broadcast import meets_batch
from workbench.per_sample.registry import find_grad_sampler

LINEAR = F.linear  # the builtins the use tracker receives as ``func``
EMBEDDING = F.embedding


def linear_arguments(args, kwargs):
    """(x, W, c) of an ``F.linear`` call."""
    names = ("input", "weight", "bias")
    values = dict(zip(names, args), **kwargs)
    return values.get("input"), values.get("weight"), values.get("bias")


def functional_linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """An ``nn.Linear`` whose weight (and bias) *are* the given Parameter objects."""
    layer = nn.Linear(1, 1, bias=False, device="meta")  # allocates nothing
    del layer.weight
    layer.weight = weight  # registered, not copied
    layer.bias = bias
    layer.out_features, layer.in_features = weight.shape
    return layer


class BroadcastParameter(nn.Module):
    """The functional layer of one parameter used broadcast into the batch (``weight`` *is*
    that Parameter; its rule: ``rules/broadcast.py``)."""

    def __init__(self, weight: nn.Parameter, takes_over: bool = False, owner: str = None):
        super().__init__()
        self.weight = weight
        self.takes_over = takes_over  # used inside its rule-less owner, which hands p over
        self.owner = owner  # that owner's path: its calls hold this layer's calls

    def forward(self, anchor: torch.Tensor) -> torch.Tensor:
        """p expanded to the op's output shape (``anchor``: a stride-0 tensor of that shape,
        batch on dim 0): its Jacobian in p is the op's (e = p.expand, h = x + p), so the
        methods that re-run a layer (micro-batching, vmap on the layer) run this."""
        return self.weight.expand(anchor.shape)


class BroadcastProduct(nn.Module):
    """The functional layer of one parameter multiplied into the batch,
    ``x * p.reshape(shape)`` (``weight`` *is* that Parameter, ``shape`` the operand's shape;
    rule: ``rules/broadcast.py``)."""

    def __init__(self, weight: nn.Parameter, shape: tuple, takes_over: bool = False,
                 owner: str = None):
        super().__init__()
        self.weight, self.shape = weight, tuple(shape)
        self.takes_over, self.owner = takes_over, owner  # as BroadcastParameter's

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, ...) -> (n, ...)
        return x * self.weight.reshape(self.shape)


class ParameterRows(nn.Module):
    """The functional layer of one parameter whose rows are picked by an index carrying the
    batch, ``W[ids]`` (``weight`` *is* that Parameter; rule: ``rules/gather.py``)."""

    def __init__(self, weight: nn.Parameter, takes_over: bool = False, owner: str = None):
        super().__init__()
        self.weight = weight
        self.takes_over, self.owner = takes_over, owner  # as BroadcastParameter's

    def forward(self, index: torch.Tensor) -> torch.Tensor:  # (n·R,) -> (n·R, *W.shape[1:])
        return self.weight[index]


def outside(tracker, where: str, *params) -> bool:
    """Are ``params`` (None skipped) tracked parameters used outside their owners here?"""
    owners = tracker.owners
    return all(id(p) in owners and where not in owners[id(p)] for p in params if p is not None)


def record_call(tracker, path: str, make, params: dict, args: tuple, result) -> bool:
    """Record ``result = layer(*args)`` of the functional layer at ``path`` (``make()`` builds
    it the first time); False when that layer holds other Parameter objects than ``params``."""
    recorder = tracker.recorder
    layer = recorder.layers[path] if path in recorder.layers else recorder.add_layer(path, make())
    if any(getattr(layer, name) is not p for name, p in params.items()):
        return False  # two parameters with one name (should not happen): stay uncovered
    recorder.add_call(path, layer, args, {}, result)
    return True


def record_linear(tracker, args, kwargs, result, where: str, func=None) -> bool:
    """Record a functional ``F.linear`` call of tracked parameters as a Linear call.

    Returns False (nothing recorded: the uses stay uncovered) unless W is a tracked parameter
    used outside its owners, c is None or such a parameter too, and x is a plain tensor.
    """
    x, W, c = linear_arguments(args, kwargs)
    if (id(W) not in tracker.owners or W.dim() != 2 or not isinstance(x, torch.Tensor)
            or id(x) in tracker.owners or (c is not None and id(c) not in tracker.owners)):
        return False
    inside = not outside(tracker, where, W, c)
    if inside and not rule_less_owner(tracker, where, x, W, c):
        return False
    names = [tracker.names.get(id(p), "a parameter") for p in (W, c) if p is not None]
    path = f"F.linear({', '.join(names)}){' in its owner' if inside else ''}"

    return record_inside(tracker, path, lambda: handed_over(functional_linear(W, c), inside,
                                                            where),
                         {"weight": W, "bias": c}, (x,), result, inside)


def handed_over(layer: nn.Module, inside: bool, where: str) -> nn.Module:
    """A functional layer whose parameters its rule-less owner at ``where`` hands over
    (Mixtral's router), marked as ``BroadcastParameter`` marks itself; as it is otherwise."""
    if inside:
        layer.takes_over, layer.owner = True, where
    return layer


def rule_less_owner(tracker, where: str, x, *params) -> bool:
    """The op runs inside a layer without a rule that owns every one of ``params`` (None
    skipped), on rows ``x`` proved to be the batch's (``flat_rows.py``: the batch on dim 0,
    or flattened sample-major): the op can be recorded as a call of its own rule's functional
    layer, and the owner, run by vmap for its other parameters, hands these over."""
    if tracker.stack and where == tracker.stack[-1] and tracker._inside_rule():
        return False  # the usual case, every nn.Linear's own F.linear: cached per layer
    owner = tracker.recorder.layers.get(where)
    return (owner is not None and not has_rule(owner)
            and all(where in tracker.owners[id(p)] for p in params if p is not None)
            and tracker.flat_rows.of(x) is not None)


def record_inside(tracker, path: str, make, params: dict, args: tuple, result,
                  inside: bool) -> bool:
    """``record_call``; a call inside the owner is also remembered for ``settle_broadcast``
    (dropped if the owner uses the parameter otherwise too)."""
    if not record_call(tracker, path, make, params, args, result):
        return False
    if inside:
        for p in params.values():
            if p is not None:
                tracker.broadcast.append((id(p), path, tracker.recorder.calls[path][-1]))
    return True


def gather_arguments(func, args, kwargs):
    """(W, ids) of ``W[ids]`` or ``index_select(W, 0, ids)``; None for any other pick."""
    if func in SELECTS:
        values = dict(zip(("input", "dim", "index"), args), **kwargs)
        W, dim = values.get("input"), values.get("dim")
        if (set(values) != {"input", "dim", "index"} or not isinstance(W, torch.Tensor)
                or not isinstance(dim, int) or W.dim() == 0 or dim % W.dim() != 0):
            return None
        return W, values["index"]
    return None if len(args) != 2 or kwargs else args


def record_gather(tracker, args, kwargs, result, where: str, func=None) -> bool:
    """Record ``W[ids]`` or ``index_select(W, 0, ids)`` (a tracked parameter W, an integer
    tensor ids whose rows are proved the batch's: Mixtral's experts gathered per token,
    ``W[expert_ids]``) as a ``ParameterRows`` call on ids; outside W's owners, or inside an
    owner without a rule."""
    found = gather_arguments(func, args, kwargs)
    if found is None:
        return False
    W, ids = found
    if (id(W) not in tracker.owners or W.dim() == 0 or not isinstance(ids, torch.Tensor)
            or ids.dim() == 0 or ids.dtype not in INDEX_DTYPES or id(ids) in tracker.owners
            or tracker.flat_rows.of(ids) is None):
        return False
    inside = not outside(tracker, where, W)
    if inside and not rule_less_owner(tracker, where, ids, W):
        return False
    name = tracker.names.get(id(W), "a parameter")
    path = f"gather({name}{' in its owner' if inside else ''})"
    return record_inside(tracker, path, lambda: ParameterRows(W, inside, where if inside
                                                              else None),
                         {"weight": W}, (ids,), result, inside)


SELECTS = (torch.index_select, torch.Tensor.index_select)
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)  # not uint8: a mask


EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def embedding_arguments(args, kwargs) -> dict:
    """{input, weight, padding_idx, ...} of an ``F.embedding`` call."""
    return dict(zip(("input", "weight", *EMBEDDING_OPTIONS), args), **kwargs)


def functional_embedding(weight: nn.Parameter, padding_idx=None) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight *is* the given Parameter object."""
    layer = nn.Embedding(1, 1, device="meta")  # allocates nothing
    del layer.weight
    layer.weight = weight
    layer.num_embeddings, layer.embedding_dim = weight.shape
    layer.padding_idx = padding_idx  # F.embedding's, already made non-negative
    return layer


def record_embedding(tracker, args, kwargs, result, where: str, func=None) -> bool:
    """Record a functional ``F.embedding(x, W)`` of a tracked parameter W used outside its
    owners (an Embedding subclass's lookup: module docstring), or inside an owner without a
    rule on indices proved the batch's, as an Embedding call."""
    values = embedding_arguments(args, kwargs)
    x, W = values.get("input"), values.get("weight")
    if (id(W) not in tracker.owners or W.dim() != 2 or not isinstance(x, torch.Tensor)
            or x.is_floating_point() or values.get("max_norm") is not None
            or values.get("sparse") or values.get("scale_grad_by_freq")):
        return False  # an option whose gradient differs: uncovered, the exact fallback
    inside = not outside(tracker, where, W)
    if inside and not rule_less_owner(tracker, where, x, W):
        return False
    pad = values.get("padding_idx")
    path = (f"F.embedding({tracker.names.get(id(W), 'a parameter')}, padding_idx={pad})"
            f"{' in its owner' if inside else ''}")
    return record_inside(tracker, path,
                         lambda: handed_over(functional_embedding(W, pad), inside, where),
                         {"weight": W}, (x,), result, inside)


def broadcast_into_batch(func, args, kwargs, p, result) -> bool:
    """Is ``result = func(*args)`` p broadcast into the batch (``rules/broadcast.py``)?
    ``p.expand(n, ...)`` / ``broadcast_to`` of p (1, ...) or lower-dim, or an add of p and a
    tensor carrying the result's dim 0 (``broadcast.meets_batch``)."""
    if not isinstance(result, torch.Tensor) or result.dim() == 0 or not result.requires_grad:
        return False
    if func in EXPANDS:
        return args[0] is p and p.dim() <= result.dim() and (
            p.dim() < result.dim() or p.shape[0] == 1)
    return meets_batch(func, args, kwargs, p, result)


def record_broadcast(tracker, args, kwargs, result, where: str, func=None) -> bool:
    """Record p broadcast into the batch as a ``BroadcastParameter`` call, where p is used
    outside its owners or inside an owner without a rule (which would run vmap for it)."""
    used = [a for a in args if id(a) in tracker.owners]
    if len(used) != 1 or not broadcast_into_batch(func, args, kwargs, used[0], result):
        return False
    p, inside = used[0], not outside(tracker, where, used[0])
    if inside:
        owner = tracker.recorder.layers.get(where)
        if owner is None or has_rule(owner):
            return False  # the owner's rule covers the use
    name = tracker.names.get(id(p), "a parameter")
    path = f"broadcast({name}{' in its owner' if inside else ''})"
    anchor = result.new_zeros(()).expand(result.shape)  # (n, ...) of stride 0: no memory
    owner = where if inside else None  # its calls sit inside the owner's (skip_weights.py)
    if not record_call(tracker, path, lambda: BroadcastParameter(p, inside, owner),
                       {"weight": p}, (anchor,), result):
        return False
    if inside:
        tracker.broadcast.append((id(p), path, tracker.recorder.calls[path][-1]))
    return True


def multiplies_batch(func, args, kwargs, v, result) -> torch.Tensor | None:
    """The other operand x if ``result = func(*args)`` is ``x * v`` (not in place) with x
    carrying the result's batch dim 0 and v broadcast along it; else None."""
    if (getattr(func, "__name__", "") not in MULS or len(args) != 2 or kwargs
            or not isinstance(result, torch.Tensor) or result.dim() == 0
            or not result.requires_grad):
        return None
    x = args[1] if args[0] is v else args[0]
    if (not isinstance(x, torch.Tensor) or x is v or x.dim() != result.dim()
            or x.shape[0] != result.shape[0]):
        return None
    broadcast = v.dim() < result.dim() or (v.dim() == result.dim() and v.shape[0] == 1)
    return x if broadcast else None


def record_product(tracker, p, v, x, result, where: str) -> bool:
    """Record ``result = x * v`` (v: p or a view of p) as a ``BroadcastProduct`` call."""
    inside = not outside(tracker, where, p)
    if inside:
        owner = tracker.recorder.layers.get(where)
        if owner is None or has_rule(owner):
            return False  # the owner's rule covers the use
    shape = tuple(v.shape)
    name = tracker.names.get(id(p), "a parameter")
    view = "" if shape == tuple(p.shape) else f".reshape{shape}"
    path = f"scale({name}{view}{' in its owner' if inside else ''})"
    owner = where if inside else None
    if not record_call(tracker, path, lambda: BroadcastProduct(p, shape, inside, owner),
                       {"weight": p}, (x,), result):
        return False
    if inside:
        tracker.broadcast.append((id(p), path, tracker.recorder.calls[path][-1]))
    return True


def record_scale(tracker, args, kwargs, result, where: str, func=None) -> bool:
    """``x * p`` with p a tracked parameter broadcast into the batch: a product call."""
    used = [a for a in args if id(a) in tracker.owners]
    if len(used) != 1:
        return False
    x = multiplies_batch(func, args, kwargs, used[0], result)
    return x is not None and record_product(tracker, used[0], used[0], x, result, where)


def record_view(tracker, args, kwargs, result, where: str, func=None) -> bool:
    """``v = p.reshape(...)`` (``VIEWS``): not a use yet; remembered until v's first use."""
    p = args[0] if args else None
    if (id(p) not in tracker.owners or not isinstance(result, torch.Tensor)
            or result.numel() != p.numel() or any(id(a) in tracker.owners for a in args[1:])):
        return False
    tracker.views[id(result)] = [weakref.ref(result), p, where, False]  # used yet?
    return True


def use_views(tracker, func, args, kwargs, result, counted) -> bool:
    """An op on remembered views of parameters: a product with the batch is recorded
    (``record_product``; True), anything else a use of p where the view was made (``counted``:
    the tracker's accounting, ``counted(p, where)``). Every use of a view decides on its own
    (``h * g * g``: two product calls of one layer, their gradients summed)."""
    views = tracker.views
    entries = [views[id(a)] for a in args if id(a) in views]
    found = []
    for entry in entries:
        ref, p, where, _ = entry
        if ref() is not None and any(a is ref() for a in args):
            entry[3] = True  # used: settled here, not at the end
            found.append((ref(), p, where))
    if len(found) == 1 and tracker.recorder.recording and not tracker.in_loss:
        v, p, where = found[0]
        x = multiplies_batch(func, args, kwargs, v, result)
        if x is not None and record_product(tracker, p, v, x, result, where):
            return True
    for _, p, where in found:
        counted(p, where)
    return False


def settle_broadcast(tracker) -> None:
    """After the forward pass: a parameter broadcast inside its rule-less owner and also used
    there otherwise stays the owner's (vmap on the owner covers every use in it); its
    broadcast calls are dropped. Otherwise the owner hands it over (``Recording.own``).
    A view of p still alive and not used during the forward pass (returned by the model, its
    use unseen) counts as a use of p where it was made."""
    for ref, p, where, used in tracker.views.values():
        if ref() is not None and not used:
            tracker._count(p, where)
    tracker.views = {}
    dropped = {id(call): (path, call) for key, path, call in tracker.broadcast
               if key in tracker.covered}
    for path, call in dropped.values():
        for handle in call.handles:
            handle.remove()
        calls = tracker.recorder.calls[path]
        calls[:] = [c for c in calls if c is not call]
        tracker.covered.update(map(id, tracker.recorder.layers[path].parameters()))  # a
        # dropped linear's bias too: the owner's vmap covers it with its weight
    tracker.broadcast = []


EXPANDS = {torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to}
ADD_FUNCTIONS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
MULS = {"mul", "__mul__", "__rmul__"}  # not mul_: x is overwritten, its value lost
MUL_FUNCTIONS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
VIEWS = {torch.Tensor.reshape, torch.Tensor.view, torch.reshape, torch.Tensor.unsqueeze,
         torch.unsqueeze}
FUNCTIONAL = {LINEAR: record_linear, EMBEDDING: record_embedding,
              **dict.fromkeys((torch.Tensor.__getitem__, *SELECTS), record_gather),
              **dict.fromkeys(EXPANDS | ADD_FUNCTIONS, record_broadcast),
              **dict.fromkeys(MUL_FUNCTIONS, record_scale),
              **dict.fromkeys(VIEWS, record_view)}
"""torch function -> how its call on parameters outside their owners becomes a layer call."""


def has_rule(layer: nn.Module) -> bool:
    """A grad or a norm rule covers ``layer``'s calls (else: vmap on the layer)."""
    from workbench.clipping.registry import find_norm_sampler  # clipping imports per_sample

    return find_grad_sampler(layer) is not None or find_norm_sampler(layer) is not None


def delegates(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass without a rule of its own (its forward builds indices):
    not hooked as a layer, its lookups are recorded as functional Embedding calls instead."""
    return isinstance(module, nn.Embedding) and not has_rule(module)


__all__ = [
    "ADD_FUNCTIONS", "EMBEDDING", "EMBEDDING_OPTIONS", "EXPANDS", "FUNCTIONAL", "LINEAR",
    "MULS", "MUL_FUNCTIONS", "VIEWS", "BroadcastParameter", "BroadcastProduct",
    "multiplies_batch", "record_product", "record_scale", "record_view", "use_views",
    "broadcast_into_batch", "delegates", "has_rule", "embedding_arguments",
    "functional_embedding", "functional_linear", "linear_arguments", "outside",
    "record_broadcast", "record_call", "record_embedding", "record_linear", "settle_broadcast",
    "INDEX_DTYPES", "SELECTS", "ParameterRows", "gather_arguments", "handed_over", "record_gather",
    "record_inside", "rule_less_owner",
]
