"""A tensor computed from parameters alone that meets the batch: its per-sample gradient.

Real models compute tensors from their parameters before any sample touches them: DeBERTa
projects its relative-position embeddings, ``K_r = E_r W_r`` (He et al. 2021, arXiv
2006.03654, Eq. 4), and multiplies them into every record's queries; Mamba's state matrix is
``A = -exp(A_log)`` (Gu & Dao 2023, arXiv 2312.00752, Alg. 2); a LoHa adapter's weight is a
Hadamard product of low-rank factors. Such a tensor D = F(θ) has no batch dim, so no per-layer
rule sees it, and its parameters used to take the whole-model fallback (a second pass over
the entire model per step, micro-batching where vmap cannot run it).

The chain rule splits where D meets the batch. If D enters the loss only through ops
h_m = f_m(a_m, D_m) whose row i depends on sample i's row a_{m,i} alone (a *meeting*:
``F.linear(x, D)``, ``x @ D``, ``x * D`` with D broadcast along the batch dim 0),

    ∂ℓ_i/∂D_m = vjp_D[ f_m(a_{m,i}, ·) ](∂ℓ_i/∂h_{m,i})            (n, *D_m.shape)     (1)
    g_i^θ     = Σ_m J_{F_m}(θ)ᵀ ∂ℓ_i/∂D_m                          (n, *θ.shape)       (2)

Eq. (1) is one op re-run on one row at a time (``torch.func.vmap`` of its ``vjp``), from the
row of h's gradient that the backward pass delivers (sample i's own, because samples do not
mix: the self-check verifies it). Eq. (2) is a backward pass through F alone, batched over the
n rows (``is_grads_batched``), taken while F's graph is still alive: in the user's backward
pass, h_m's node is reached before any node of F, so a hook on h_m's node runs Eq. (1) and
Eq. (2) there (``retain_graph``: the user's pass then goes on through F as usual); in the
functional API's pass (gradients at edges only), F's nodes are never run, and Eqs. (1)-(2)
follow it.

**When is this exact?** (a) D carries no sample: it is computed from tensors that do not
depend on the model's inputs. The tracker marks every tensor computed from the inputs
(*tainted*; an op of a tainted tensor is tainted); D must be untainted and the meeting's
other operand a, tainted. (b) θ reaches the loss through the meetings only: each D_m is
handed to its op as a view D'_m made for it (no other op holds D'_m), and the graph walked
from the model's outputs (or the losses) without entering any D'_m must not reach θ
(``settle``); else θ keeps the whole-model fallback. (c) The op is row-wise along a's dim 0:
only the ops listed (``MEETS``), D in a weight position or broadcast along that dim. The
self-check compares the result with micro-batching on every new call signature, as for every
route. A parameter for which any of this fails (a meeting's operand written in place after
it, an op without a batching rule, a meeting whose h left the graph) keeps the whole-model
fallback; a rule-less layer's own parameters served this way leave its per-layer vmap
(``recording.derived_of_ruleless``: Mamba's mixer). The taint crosses every recorded layer
call (``through``): a forward no mode sees (an autograd.Function's, a layer tapped by
``skip_weights.py``) still passes it on. A tapped layer hands its weight no graph edge, so the
walk cannot see its uses: the direct parameters of every layer with a rule called on the batch
are never the meetings' alone (``ruled``), and book-keeping does not tap a call without the
batch (DeBERTa's ``pos_proj`` inside F), so the walk below D still reaches its weight.

Notation: n batch size, θ a parameter, F the computation of D from the parameters, a the
batch operand, h the meeting op's result, ℓ_i sample i's loss.
"""

import weakref

import torch
from torch.autograd.graph import get_gradient_edge

from workbench.per_sample.flat_rows import AUGMENTED, IdentityRef
from workbench.per_sample.leaves import leaves
from workbench.per_sample.registry import find_grad_sampler
from workbench.per_sample.views import capture_edge, stale, watched

# ops whose result's row i depends on the batch operand's row i and on D, for D broadcast
# along that dim 0 (elementwise, matmul) or in a weight position (linear, conv)
ELEMENTWISE = {"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__",
               "__rmul__", "div", "__truediv__"}
WEIGHTED = {"linear", "conv1d", "conv2d", "conv3d"}  # D as args[1] (weight) or args[2] (bias)
PRODUCTS = {"matmul", "__matmul__", "__rmatmul__"}
ATTENTION = {"scaled_dot_product_attention"}  # D as attn_mask, args[3] (BEiT's, Data2Vec's
# relative position bias on the SDPA path); without dropout, which Eq. (1) would draw again
MEETS = frozenset(ELEMENTWISE | WEIGHTED | PRODUCTS | ATTENTION)
MAX_NODES = 512  # a D whose graph is larger is not a parameter-only computation worth it
WRITES = {"__setitem__", "__set__"}  # in-place by another name than ``x.op_`` / ``x.__iop__``
# (``__set__``: ``t.data = v``, which puts v's storage under t, tainted when v is)
RUNNING_STATS = {"batch_norm", "instance_norm"}  # write their running_mean / running_var
RUNNING_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training")  # the
# sixth is instance_norm's use_input_stats: both mean "statistics of this batch, written back"


def writes_first(name: str) -> bool:
    """The op named ``name`` writes its first argument in place: ``x.op_``, ``x += a``
    (``__iop__``), ``x[k] = a``, ``t.data = v`` (the taint here, ``state_replay``'s copy on
    write)."""
    return name in WRITES or name in AUGMENTED or (name.endswith("_")
                                                    and not name.endswith("__"))


class TaintRef(IdentityRef):
    """The taint's weak reference: identity only (``owned.py`` does not count it as a reader)."""

    __slots__ = ()


class Taint:
    """ids of the tensors computed from the model's inputs during one forward pass (weakly:
    an id may be reused once its tensor is freed)."""

    def __init__(self):
        self.refs: dict[int, weakref.ref] = {}
        self.storages: set[int] = set()  # data pointers of storages written in place from the
        # batch: a write through an alias (``buffer.data.mul_(...)``) reaches the buffer there

    def wrote(self, t) -> bool:
        """t's storage was written in place from the batch during the pass (through t itself
        or through any tensor sharing it: ``.data``, a view)."""
        return bool(self.storages) and _storage(t) in self.storages  # None is never added

    def _written(self, t: torch.Tensor) -> None:
        self.refs[id(t)] = TaintRef(t)
        ptr = _storage(t)
        if ptr:  # not an empty or storage-less tensor (0, None): those share no data
            self.storages.add(ptr)

    def seed(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.refs[id(t)] = TaintRef(t)

    def has(self, t) -> bool:
        ref = self.refs.get(id(t))
        return ref is not None and ref() is t

    def spread(self, name: str, ids, args, kwargs, result) -> None:
        """After an op: its result is tainted when an argument is; an in-place op (``x.add_``,
        ``x += a``, ``x[k] = a``) taints its first argument, which it wrote. A result that is
        an argument itself, not written (``buffer.to(x)`` when x's dtype and device are the
        buffer's already: peft's BOFT permutation), keeps its own state: nothing of x went
        into it."""
        refs = self.refs
        if refs.keys().isdisjoint(ids) or not self._holds(args, kwargs):
            return  # none, or only a freed tensor's id reused
        if type(result) is torch.Tensor:
            if not any(result is a for a in args):
                refs[id(result)] = TaintRef(result)
        elif type(result) in (list, tuple):
            for t in result:
                if isinstance(t, torch.Tensor):
                    refs[id(t)] = TaintRef(t)
        elif isinstance(result, torch.Tensor):
            refs[id(result)] = TaintRef(result)
        first = args[0] if args else None
        if (isinstance(first, torch.Tensor)  # written: tainted, its storage noted (also when
                and writes_first(name)  # the op returns it, x.add_(a))
                and (name != "__set__" or (isinstance(args[-1], torch.Tensor) and _storage(
                    first) == _storage(args[-1])))):  # .data = v; not ``x.requires_grad =
                # True`` (Wav2Vec2's feature encoder in training: an AttributeError until
                # 2026-12-01)
            self._written(first)  # (not .grad =, whose storage is not the tensor's)
        out = kwargs.get("out") if kwargs else None  # torch.add(a, b, out=buffer): written
        for t in (out if type(out) in (list, tuple) else (out,)):
            if isinstance(t, torch.Tensor):
                self._written(t)
        if name in RUNNING_STATS:  # F.batch_norm / F.instance_norm updating running statistics
            values = dict(zip(RUNNING_ARGS, args), **kwargs)  # from the batch, in C++
            if values.get("training", values.get("use_input_stats")):
                for key in ("running_mean", "running_var"):
                    if isinstance(values.get(key), torch.Tensor):
                        self._written(values[key])

    def _holds(self, args, kwargs) -> bool:
        """A tainted tensor is among the arguments (one level into lists), checked by
        identity, not by id alone."""
        refs = self.refs
        for a in (*args, *kwargs.values()) if kwargs else args:
            if type(a) in (list, tuple):
                for b in a:
                    r = refs.get(id(b))
                    if r is not None and r() is b:
                        return True
            else:
                r = refs.get(id(a))
                if r is not None and r() is a:
                    return True
        return False

    def none_of(self, args) -> bool:
        """The batch is known (a forward pass runs), none of ``args`` carries it, and they are
        not one constant row repeated along dim 0 (an RNN's zero initial state, a constant
        expanded to the batch: calls on the batch's rows as much as any)."""
        if not self.refs or any(map(self.has, _flat(args))):
            return False
        tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor) and a.dim() >= 1]
        with torch.no_grad():
            return bool(tensors) and any(t.shape[0] == 1 or not bool((t == t[:1]).all())
                                         for t in tensors)

    def through(self, args, kwargs, output) -> bool:
        """A layer call: its outputs are tainted when an input is; returns whether one is."""
        if not self._holds(args, kwargs) and not (
                any(isinstance(a, dict) for a in (*args, *kwargs.values()))
                and any(map(self.has, leaves((args, kwargs))))):  # a dict of inputs
            return False
        if type(output) is torch.Tensor:  # the usual case, without a pytree walk
            self.refs[id(output)] = TaintRef(output)
        else:
            self.seed(leaves(output))
        return True


_PARAMETER_NEW = torch.nn.Parameter.__new__
_PARAMETER_NEW_ENTRY = torch.nn.Parameter.__dict__["__new__"]  # the staticmethod, restored as is
_FOLLOWING: list = []  # the Derived of each tracked forward pass running (nested: the probe's)


def _parameter_new(cls, data=None, requires_grad=True):
    """``nn.Parameter(t)`` while a forward pass is tracked: the new parameter (another tensor
    object on t's storage, made in C++ where no mode sees it) is tainted when t is, so a
    parameter rebound to a statistic of the batch (``self.shift = nn.Parameter(x.mean(0))``)
    is found by the state check (``checks.state_written_from_batch``)."""
    p = _PARAMETER_NEW(cls, data, requires_grad)
    if data is not None:
        for derived in _FOLLOWING:
            if derived.taint.has(data):
                derived.taint.refs[id(p)] = TaintRef(p)
    return p


def follow_parameters(derived, on: bool) -> None:
    """Taint parameters made from tainted tensors during ``derived``'s forward passes (``on``)
    or stop; ``nn.Parameter.__new__`` is the original whenever no pass is followed."""
    if on:
        _FOLLOWING.append(derived)
        if len(_FOLLOWING) == 1:  # nested passes (the probe's) share the one patch
            torch.nn.Parameter.__new__ = staticmethod(_parameter_new)
        return
    if derived in _FOLLOWING:
        _FOLLOWING.remove(derived)
    if not _FOLLOWING:
        torch.nn.Parameter.__new__ = _PARAMETER_NEW_ENTRY


def _storage(t: torch.Tensor) -> int | None:
    """The data pointer of t's storage: None for a tensor without one (meta, sparse) or with
    an empty one (0 for every empty storage, so no tensor is matched by it)."""
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def _flat(args):
    for a in args:
        if type(a) in (list, tuple):
            yield from a
        else:
            yield a


class Meeting:
    """One op h = f(a, D') seen in the forward pass (module docstring)."""

    def __init__(self, func, args, kwargs, d_at, rows_at, h, per: int = 1):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.d_at, self.rows_at = d_at, rows_at  # positions in args of D' and of the a's
        self.versions = [args[k]._version for k in (*d_at, *rows_at)]
        self.per = per  # rows per sample: h's dim 0 is n·per, flattened sample-major
        self.n = h.shape[0] // per
        self.edge, self.view = capture_edge(h)  # h's gradient read at its base (views.py)
        self.watch = watched([h])  # h, a partial view: written in place later, it is lost
        self.params: list = []  # θ below D' reaching the loss through meetings only
        self.failed = False
        self.handle = None
        self.generation = 0  # the recorder's generation of the forward pass it was in
        self.d_edges: list = []  # D' edges (``Derived.edges``), kept after ``release``

    def nodes(self):
        return [self.args[k].grad_fn for k in self.d_at]

    def release(self) -> None:
        """After Eqs. (1)-(2): its operands are no longer held (autograd frees its own copies
        as the pass goes on; holding them to the step would raise the step's peak memory)."""
        self.args = self.kwargs = None

    def usable(self) -> bool:
        """Its operands unchanged since the op (an in-place op after it would make Eq. (1)
        read other values) and its result still in the graph (``views.stale``)."""
        return not self.failed and self.args is not None and not stale(self.watch) and all(
            self.args[k]._version == v
            for k, v in zip((*self.d_at, *self.rows_at), self.versions))

    def gradients(self, grad_h: torch.Tensor) -> dict:
        """{id(θ): (n, *θ.shape)}: Eqs. (1)-(2) from h's gradient (n, *h.shape[1:])."""
        if not self.params:
            return {}
        if self.view is not None:
            grad_h = grad_h.reshape(self.view)
        ds = [self.args[k] for k in self.d_at]
        fixed = [a.detach() if isinstance(a, torch.Tensor) else a for a in self.args]
        rows = [fixed[k] for k in self.rows_at]
        func, kwargs, d_at, rows_at = self.func, self.kwargs, self.d_at, self.rows_at

        def one(row_list, g):  # Eq. (1) for one sample: the op on a batch of one
            def op(*d):
                full = list(fixed)
                for k, r in zip(rows_at, row_list):
                    full[k] = r.unsqueeze(0)
                for k, v in zip(d_at, d):
                    full[k] = v
                return func(*full, **kwargs)

            _, back = torch.func.vjp(op, *[fixed[k] for k in d_at])
            return back(g.unsqueeze(0))

        grad_d = torch.func.vmap(one)(rows, grad_h)  # tuple of (n·per, *D.shape)
        if self.per > 1:  # each sample's rows summed: Eq. (1) for the sample
            grad_d = tuple(g.view(self.n, self.per, *g.shape[1:]).sum(1) for g in grad_d)
        try:
            grads = torch.autograd.grad(ds, self.params, grad_outputs=list(grad_d),
                                        is_grads_batched=True, retain_graph=True,
                                        allow_unused=True)
        except (RuntimeError, NotImplementedError):  # F has an op without a batching rule
            rows_g = [torch.autograd.grad(ds, self.params, [g[i] for g in grad_d],
                                          retain_graph=True, allow_unused=True)
                      for i in range(self.n)]
            grads = [torch.stack([torch.zeros_like(p) if r[k] is None else r[k]
                                  for r in rows_g]) for k, p in enumerate(self.params)]
        return {id(p): torch.zeros(self.n, *p.shape, dtype=p.dtype, device=p.device)
                if g is None else g for p, g in zip(self.params, grads)}


def positional(name, args, kwargs) -> tuple:
    """``F.linear`` / ``F.convNd`` with ``weight=`` / ``bias=`` given by keyword (Mamba's
    ``F.conv1d(x, weight=w, bias=b, ...)``): the same call, them in args[1], args[2]."""
    if name in ATTENTION and len(args) == 3 and "attn_mask" in kwargs:
        kwargs = dict(kwargs)
        return (*args, kwargs.pop("attn_mask")), kwargs
    if name not in WEIGHTED or not kwargs or ("weight" not in kwargs and "bias" not in kwargs):
        return args, kwargs
    kwargs = dict(kwargs)
    if len(args) == 1 and "weight" in kwargs:
        args = (*args, kwargs.pop("weight"))
    if len(args) == 2 and "bias" in kwargs:
        args = (*args, kwargs.pop("bias"))
    return args, kwargs


def meeting_operands(name, args, kwargs, taint: Taint, params: dict, skip,
                     own=lambda p: False) -> tuple | None:
    """(positions of D, positions of the batch operands a) for ``func(*args)`` when it is a
    meeting of an untainted, differentiable D with a tainted a (module docstring (a), (c));
    else None. D is a tensor computed from parameters, or a parameter for which ``own(p)``
    (a use the tracker would otherwise leave to the whole-model fallback)."""
    if kwargs.get("out") is not None or not args:
        return None
    tensors = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
    rows = [k for k in tensors if taint.has(args[k])]
    if not rows:
        return None
    ds = [k for k in tensors if k not in rows and args[k].requires_grad
          and (args[k].grad_fn is not None and id(args[k]) not in params
               and not skip(args[k], name, args) or id(args[k]) in params and own(args[k]))]
    if not ds:
        return None
    a = args[rows[0]]
    if a.dim() < 1 or a.shape[0] < 1 or any(args[k].dim() < 1 or args[k].shape[0] != a.shape[0]
                                           for k in rows):
        return None
    if name in WEIGHTED:
        if rows != [0] or any(k not in (1, 2) for k in ds):
            return None
    elif name in ATTENTION:
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if ds != [3] or not set(rows) <= {0, 1, 2} or 0 not in rows or p:
            return None
        d = args[3]
        if not (d.dim() < a.dim() or d.shape[0] == 1):
            return None
    elif name in PRODUCTS:
        if len(rows) != 1 or len(ds) != 1 or len(tensors) != 2:
            return None
        d = args[ds[0]]
        if rows[0] == 0:  # a @ D: rows of a (a 2-d a included: its rows are the batch)
            if not (d.dim() < a.dim() or d.shape[0] == 1) and a.dim() > 2:
                return None
            if d.dim() > a.dim():
                return None
        elif a.dim() < 3 or not (d.dim() < a.dim() or d.shape[0] == 1):
            return None  # D @ a: a's dim 0 must be a batch dim of the product
    else:  # elementwise: D broadcast along a's dim 0
        if len(tensors) != 2 or kwargs:
            return None
        d = args[ds[0]]
        if not (d.dim() < a.dim() or d.shape[0] == 1):
            return None
    return ds, rows


def parameters_below(node, params: dict) -> list | None:
    """The tracked parameters whose leaves the graph below ``node`` reaches; None when it is
    larger than ``MAX_NODES`` or reaches a leaf that is not one of them."""
    seen, stack, found = {}, [node], {}  # id -> node: held, so no id is reused (graph_nodes)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if len(seen) > MAX_NODES:
            return None
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if var is not None:
            if id(var) not in params:
                return None
            found[id(var)] = var
            continue
        stack.extend(f for f, _ in node.next_functions)
    return list(found.values())


def graph_nodes(starts, stops=frozenset()):
    """Each autograd node the graph from ``starts`` (tensors, via their ``grad_fn``, or nodes)
    reaches, once, without entering a node whose id is in ``stops``.

    Every node met is held until the walk ends: ``next_functions`` hands out a node's Python
    object anew once the last one died, and a dead object's id is reused, so a set of bare
    ids took an unvisited node for a visited one and cut the walk short (torch 2.11: a
    Swin-v2 attention call's output "did not reach the loss", its layer was not sent to the
    fallback, and einsum crashed; the same code walked the whole graph under torch 2.13)."""
    seen, stack = {}, [getattr(t, "grad_fn", t) for t in starts]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stops:
            continue
        seen[id(node)] = node
        yield node
        stack.extend(f for f, _ in node.next_functions)


def reached(roots, stops: set[int]) -> set[int]:
    """ids of the leaves the graph from ``roots`` reaches without entering a node in
    ``stops``."""
    tensors = [t for t in roots if isinstance(t, torch.Tensor)]
    return {id(var) for node in graph_nodes(tensors, stops)
            if (var := getattr(node, "variable", None)) is not None}


def ruled(recorder) -> set[int]:
    """ids of the direct parameters of layers with a rule that were called on the batch (a
    tainted input): their rule computes those uses, which the graph walk may not even see
    (a layer tapped by ``skip_weights.py`` hands its weight no gradient edge)."""
    out = set()
    for path, calls in recorder.calls.items():
        layer = recorder.layers.get(path)
        if layer is not None and any(c.tainted for c in calls) and \
                find_grad_sampler(layer) is not None:
            out.update(id(p) for p in layer.parameters(recurse=False))
    return out


class Derived:
    """The meetings of the forward passes since the last ``clear`` and the per-sample
    gradients they gave, per backward pass (the recorder's generation)."""

    def __init__(self, params: dict):
        self.params = params  # {id(θ): ...}: the tracked parameters
        self.taint = Taint()
        self.pending: list[Meeting] = []  # the forward pass running
        self.meetings: list[Meeting] = []  # settled, with their hooks
        self.results: dict[int, dict] = {}  # generation -> {id(θ): (n, *θ.shape)}
        self.clock = None  # () -> the backward pass's number, where the recorder's is not the
        # caller's (the optimizer counts passes at the model's output: a model whose layers
        # have no trainable parameter, VB-LoRA's frozen base, records no layer call)
        self.tasks: dict[int, int] = {}  # generation -> the autograd pass that gave them

    def start(self, inputs=()) -> None:
        """A forward pass begins: ``inputs``, the model's tensors, taint what they touch."""
        self.taint, self.pending = Taint(), []
        self.taint.seed(inputs)

    def rewrite(self, func, args, kwargs, skip, own):
        """(args, kwargs, pending): each D replaced by a view D' of it made here, and what
        ``met`` needs after the op (pending[2]: the parameters among the D); pending None when
        the op is not a meeting (args and kwargs then as given)."""
        name = getattr(func, "__name__", "")
        if name not in MEETS:
            return args, kwargs, None
        moved, kw = positional(name, args, kwargs)
        found = meeting_operands(name, moved, kw, self.taint, self.params, skip, own)
        if found is None:
            return args, kwargs, None
        ds, rows = found
        if torch.is_autocast_enabled(moved[rows[0]].device.type):
            return args, kwargs, None  # Eq. (1) would re-run the op outside autocast
        args, params = list(moved), [moved[k] for k in ds if id(moved[k]) in self.params]
        with torch._C.DisableTorchFunction():  # the workbench's view, not the model's use
            for k in ds:
                args[k] = args[k].view_as(args[k])
        return tuple(args), kw, (ds, rows, params)

    def met(self, func, args, kwargs, pending, result, tag_of) -> None:
        """After the op: a meeting when h has a's rows and a's rows are proved to be the batch's
        (``tag_of(a)`` = (m, T): m samples flattened sample-major, T rows each, ``flat_rows.py``;
        T = 1 for the batch on dim 0, Swin's windows T > 1). A batch operand whose dim 0 only
        has the batch's size (time-major rows at T = n) is no meeting: the fallback."""
        ds, rows, _ = pending
        if not (isinstance(result, torch.Tensor) and result.requires_grad and result.dim() >= 1
                and result.shape[0] == args[rows[0]].shape[0]):
            return
        tags = {tag_of(args[k]) for k in rows}
        if len(tags) != 1 or None in tags:
            return
        m, per = tags.pop()
        if m * per != result.shape[0]:
            return
        self.pending.append(Meeting(func, args, kwargs, ds, rows, result, per))

    def settle(self, roots, n, recorder) -> None:
        """After the forward pass (module docstring (b)): each meeting's parameters, and a
        hook at each h's node that runs Eqs. (1)-(2) when the backward pass reaches it."""
        meetings, self.pending = [m for m in self.pending if m.n == n], []
        self.taint = Taint()
        if not meetings:
            return
        held = [node for m in meetings for node in m.nodes()]  # alive while their ids are
        stops = {id(node) for node in held}  # compared (graph_nodes: a dead node's id is reused)
        elsewhere = reached(roots, stops) | ruled(recorder)
        del held
        for m in meetings:
            found = []
            for node in m.nodes():
                below = parameters_below(node, self.params)
                if below is None:
                    found = []
                    break
                found += below
            m.params = list({id(p): p for p in found if id(p) not in elsewhere}.values())
            if m.params:
                m.generation = self.generation(recorder)
                m.d_edges = [get_gradient_edge(m.args[k]) for k in m.d_at]
                m.handle = m.edge.node.register_prehook(_prehook(m, self, recorder))
                self.meetings.append(m)

    def generation(self, recorder) -> int:
        return self.clock() if self.clock is not None else recorder.generation

    def store(self, generation: int, grads: dict) -> None:
        """Add one meeting's g_i to its backward pass's; a second pass through the same graph
        (a check's, retain_graph) in the same generation is not added again."""
        task = torch._C._current_graph_task_id()
        if self.tasks.setdefault(generation, task) != task:
            return
        mine = self.results.setdefault(generation, {})
        for key, g in grads.items():
            mine[key] = g if key not in mine else mine[key] + g

    def edges(self) -> list:
        """The D' of every meeting: a backward pass asked for gradients at them runs each
        h's node, and with it the hook (the functional API's passes, which stop at edges)."""
        return [e for m in self.meetings for e in m.d_edges]

    def served(self, generation: int, wanted) -> dict:
        """{id(θ): g_i} for the parameters among ``wanted`` whose every meeting of this
        backward pass ran (or never reached the loss, a zero): the others keep the fallback."""
        mine = [m for m in self.meetings if m.generation == generation]
        bad = {id(p) for m in mine if m.failed or stale(m.watch) for p in m.params}
        results = self.results.get(generation, {})
        out = {}
        for m in mine:
            for p in m.params:
                if id(p) in wanted and id(p) not in bad and id(p) not in out:
                    g = results.get(id(p))
                    out[id(p)] = g if g is not None else torch.zeros(
                        m.n, *p.shape, dtype=p.dtype, device=p.device)
        return out

    def clear(self) -> None:
        for m in self.meetings:
            if m.handle is not None:
                m.handle.remove()
        self.meetings, self.results, self.pending, self.tasks = [], {}, [], {}


def served_gradients(rec) -> dict:
    """{id(θ): g_i} of the recording's fallback parameters that meetings served."""
    derived = getattr(rec.recorder, "derived", None)
    if derived is None or not derived.meetings:
        return {}
    gen = rec.generation if rec.generation is not None else 0
    return derived.served(gen, rec.fallback)


def _prehook(m: Meeting, derived: Derived, recorder):
    ref, nr = weakref.ref(m), m.edge.output_nr  # weakly: the node's hook must not hold the
    # meeting, which holds the node (a cycle the GC cannot see through the graph)

    def run(grad_outputs):
        meeting = ref()
        if (meeting is None or not recorder.recording or grad_outputs[nr] is None
                or meeting.args is None):
            return None  # paused: a check's own gradient pass; or computed and released
        if not meeting.usable():
            meeting.failed = True
            return None
        try:
            with recorder.paused():  # Eq. (2)'s pass reaches recorded calls below D: not
                grads = meeting.gradients(grad_outputs[nr])  # their b, nor a new generation
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            meeting.failed = True  # its parameters keep the whole-model fallback
            return None
        derived.store(derived.generation(recorder), grads)
        meeting.release()
        return None

    return run


__all__ = ["MEETS", "Derived", "Meeting", "Taint", "TaintRef", "follow_parameters", "graph_nodes",
           "meeting_operands", "parameters_below", "positional", "reached", "ruled",
           "served_gradients"]
