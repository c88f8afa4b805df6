"""Capturing what a grad sampler needs: each layer's inputs and the gradient of its output.

The Opacus paper (Yousefpour et al. 2021, arXiv 2109.12298, §2 and Appendix B, Eq. 4-5)
obtains per-sample gradients from two quantities per layer and call:

- the *activations* a (the layer's inputs), kept by a forward hook;
- the *backprops* b = ∂(Σ_i ℓ_i)/∂o, the gradient w.r.t. the layer's output o. Its row i
  equals ∂ℓ_i/∂o_i because samples do not mix ("highway gradients").

The forward hook also keeps o's autograd *edge* (``torch.autograd.graph.get_gradient_edge``):
the point of the graph where o's gradient arrives. ``ActivationRecorder.backward`` then asks
autograd for the gradients at all those edges in one pass (an in-place change of o after the
layer moves o to a new node, but the edge taken before it still names o's original value;
when o is a *view*, e.g. F.linear's output on (n, T, d), the write rebuilds the graph of o's
base without o's old node, so b is read at the base: ``views.py``).
When someone else runs the backward pass (the ordinary training loop's ``loss.backward()``,
used by ``dpsgd``), ``capture="hooks"`` registers a tensor hook on o instead.

A layer returning a tuple of Tensors (a registered sampler for an RNN-like layer) gets one
edge per Tensor, and its backprops are the tuple of their gradients (zeros for an output the
loss did not use). A module called several times in one forward pass (weight sharing) gets
one ``LayerCall`` per call; the caller sums the per-sample gradients of the calls.

Two more things are kept for the checks of ``recording.py``: ``stack``, the paths of the
layers whose forward is running (so a parameter use can be attributed to the layer that owns
it, or not), and, in ``capture="hooks"``, the *generation* of each call: the number of
backward passes that had finished when its gradient arrived, so that samples of two
backward passes before one optimizer step are never merged.

**Activation checkpointing** (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing_enable()``) runs a layer's forward a second time inside the backward
pass. That recomputation is not a call of the batch and is not recorded: with
``use_reentrant=False`` the original call's output still receives b (the recomputation only
refills its saved tensors); with ``use_reentrant=True`` the gradient flows through the
recomputed call in a nested backward pass, which the caller refuses (``recomputed``).

A call can also be recorded without a module hook (``add_call``): the use tracker records a
tied head's ``F.linear`` as a Linear call (``tied.py``), and ``redirect`` reads a batch-free
call's backprops where its output meets the batch (``broadcast.py``; in ``capture="hooks"`` by a
pre-hook on that add's autograd node).

In ``capture="hooks"``, ``on_complete(call)`` (when set) runs the moment every output's
gradient of a call has arrived, still inside the backward pass: the optimizer's book-keeping
materialises a call there and frees its a (``drop_inputs``: "meta" tensors keep the shapes)
and b (``dpsgd/streamed.py``), as the functional API's streamed pass does.

**A layer's state** (``state_of``, ``changed_state``): every route that re-runs a layer's forward
(per-layer vmap, per-layer micro-batching) assumes the re-run computes what the call computed.
A forward that reads an attribute which it, or anything after it, rebinds or writes in place
during the pass (RecurrentGemma's RG-LRU starts its scan from ``self.recurrent_states``, which
each call overwrites with its last state) would, re-run after the pass, read what the pass
left there, not what the call read. So the pre-hook of each layer's first call keeps its
attribute bindings and its buffers' versions (``before``), and ``changed()`` names, per layer,
what differs now; ``recording.new_recording`` sends such a layer, if it has no grad rule (the
re-run ones), to the exact whole-model fallback.

A position-wise layer called on batch-flattened rows (n·T, d) that the use tracker proved
sample-major (OPT's MLP on ``h.reshape(-1, d)``, ``flat_rows.py``) is recorded as the call on
(n, T, d): its input viewed so, its output's shape and backprops likewise (``rows``).

Nothing is left behind: ``ActivationRecorder`` is a context manager that removes every hook
on exit, also when the forward or backward pass raises.
"""

import collections
import functools
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.nn.modules import module as module_hooks
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.hooks import RemovableHandle

from workbench.errors import UnsupportedLayerError
from workbench.per_sample import precision
from workbench.per_sample.broadcast import BROADCASTABLE
from workbench.per_sample.flat_rows import (
    as_batch,
    passed_on,
    rule_less_rows,
    unflattened,
    unproved,
)
from workbench.per_sample.leaves import call_leaves
from workbench.per_sample.positional import as_positional
from workbench.per_sample.registry import called_with_more, find_grad_sampler
from workbench.per_sample.uses import advanced, generator_states
from workbench.per_sample.views import capture_edge, watched


@dataclass
class LayerCall:
    """One call of a layer: its inputs, its outputs' edges, and (after backward) b."""

    args: tuple
    kwargs: dict
    edges: list[GradientEdge]
    outputs: list  # the output Tensors' (shape, dtype, device), for zeros and shape checks
    is_tuple: bool = False
    backprops: object = None  # Tensor (n, ...) or tuple of them; None: output unused
    generation: int = 0
    grads: list = field(default_factory=list)  # capture="hooks": per-output gradient, or None
    handles: list = field(default_factory=list)  # capture="hooks": the gradient hooks' handles
    meet: object = None  # broadcast.Meeting: b comes from where a batch-free output meets n
    widen_to: object = None  # under autocast: the layer's parameter dtype (``precision.py``)
    path: str = ""  # the recorded layer's path
    sampled: object = None  # {id(param): (n, *shape)}: g_i materialised as b arrived, a dropped
    rows: tuple | None = None  # (n, T): called on flattened (n·T, ...) rows (flat_rows.py)
    views: list | None = None  # per edge, o's shape where b is read at o's base (views.py)
    watch: list = field(default_factory=list)  # [(o, version)]: partial views (views.py)
    stored_at: dict = field(default_factory=dict)  # k -> the backward pass b_k came in
    tainted: bool | None = None  # an input computed from the model's inputs (derived.Taint;
    # None: not known, no use tracker ran)
    reordered: bool = False  # called on the batch's rows in another order (flat_rows._reorder)
    unproved: str | None = None  # a tensor read as the batch's rows that no op proved so
    # (``flat_rows.unproved``): the exact fallback
    repeated: list | None = None  # per Tensor leaf: its rows one row repeated (drop_inputs)
    after: dict | None = None  # capture="edges": output k -> [b] read by a hook registered
    # after the user's own on that output (``ActivationRecorder.hooked``), else None

    @property
    def edge(self) -> GradientEdge:
        return self.edges[0]

    def capture_edges(self) -> list[GradientEdge]:
        """Where b is read: the outputs, or the adds where a batch-free output meets n."""
        return list(self.meet.edges) if self.meet is not None else self.edges

    def set_backprops(self, grads) -> None:
        """b from the gradients of each output (None -> zeros); None when none arrived."""
        if (len(grads) == 1 and grads[0] is not None and not self.is_tuple
                and self.meet is None and self.rows is None and self.widen_to is None
                and self.views is None):
            self.backprops = grads[0]  # one output, as it arrived: the steps below, skipped
            return
        if all(g is None for g in grads):
            self.backprops = None
            return
        if self.meet is not None:
            grads = [self.meet.reduce(grads)]  # (n, *o.shape), summed over the meetings
        elif self.views is not None:  # read at the base of a view: views.py Eq. (1)
            grads = [g if g is None or v is None or tuple(g.shape) == v else g.reshape(v)
                     for g, v in zip(grads, self.views)]  # the view's own b: as it is
        if self.rows is not None:  # (n·T, ...) -> (n, T, ...)
            grads = [None if g is None else as_batch(g, self.rows) for g in grads]
        full = [torch.zeros(s, dtype=d, device=v) if g is None else g
                for g, (s, d, v) in zip(grads, self.outputs)]
        self.backprops = tuple(full) if self.is_tuple else full[0]
        if self.widen_to is not None:  # autocast: a and b in the parameter's dtype
            up = self.widen_to
            self.backprops = precision.widen(self.backprops, up)
            self.args, self.kwargs = precision.widen(self.args, up), precision.widen(
                self.kwargs, up)


def drop_inputs(call: LayerCall) -> None:
    """Free a call's activations a once its per-sample gradients are materialised (streaming):
    each Tensor argument becomes a "meta" tensor of the same shape and dtype (no storage), so
    the shape checks and call signatures (``recording.checked_shapes``) still read them. A
    call on tensors computed without the batch first notes, per Tensor, whether its rows are
    one row repeated (``recording.rows_not_samples`` reads values the stand-ins lack)."""
    if call.tainted is False and call.repeated is None:
        with torch.no_grad():
            call.repeated = [bool((t == t[:1]).all()) if isinstance(t, torch.Tensor)
                             and t.dim() >= 1 else True
                             for t in call_leaves(call.args, call.kwargs)]

    def stand_in(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta") \
            if isinstance(t, torch.Tensor) else t

    call.args = tuple(stand_in(a) for a in call.args)
    call.kwargs = {k: stand_in(v) for k, v in call.kwargs.items()}


def tensor_outputs(output):
    """(the Tensors of ``output`` to read b at, is_tuple), or (None, False) if unsupported.

    A tuple or list is read element by element: each a Tensor or ``None`` (Hugging Face's
    attention blocks return ``(output, None)`` when no attention weights are asked for). Its
    b is the tuple of its Tensors' gradients; ``None`` elements and integer or boolean Tensors
    (a router's expert indices), which carry no gradient, are skipped (``output_tensors``: the
    per-layer vmap, micro-batching and the optimizer's dot loss skip them likewise).
    Unsupported (``odd_output`` says why): any other element, or a floating Tensor that does
    not require grad beside ones that do (a mask): no rule could tell which of the layer's
    outputs its b belongs to."""
    if isinstance(output, torch.Tensor):
        return ([output] if output.requires_grad else []), False
    if isinstance(output, (tuple, list)):
        tensors = output_tensors(output)
        if not all(isinstance(o, torch.Tensor) for o in tensors):
            return None, False
        grads = [o for o in tensors if o.requires_grad]
        if grads and len(grads) < len(tensors):
            return None, False
        return grads, True
    return None, False


def _no_gradient(o) -> bool:
    """None, or a Tensor whose dtype holds no gradient (integer, boolean)."""
    return o is None or (isinstance(o, torch.Tensor) and not (o.is_floating_point()
                                                               or o.is_complex()))


def output_tensors(output) -> list:
    """The elements a layer's (or the model's) output can carry gradients in, in order:
    ``None`` and integer or boolean Tensors of a tuple or list skipped. What its recorded b (a
    tuple when ``is_tuple``) lines up with."""
    if isinstance(output, (tuple, list)):
        return [o for o in output if not _no_gradient(o)]
    return [output]


def fed_outputs(output, args, kwargs, limit: int = 2000) -> set[int]:
    """Positions in a tuple ``output`` of the Tensors another of its Tensors was computed from
    inside the call (a cell's new state c, from which it computes its h; a router's logits,
    from which its top-k weights): the gradient arriving at such a Tensor (at its hook or its
    edge) holds the other's path through the layer as well as the gradient from outside, and a
    layer's rule (or its vmap) applied to every output's b would count that path twice; the
    same value returned twice (``return h, h``: both hooks read the sum of both uses) is such
    a pair too, every place it is returned at named. Found by walking each output's graph
    back to the call's inputs; a walk of more than ``limit`` nodes names every output
    (copying one that feeds nothing is harmless)."""
    outs = [(k, t) for k, t in enumerate(output)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if len(outs) < 2:
        return set()
    at, fed = {}, set()
    for k, t in outs:  # the same value twice (``return h, h``): each hook would read both
        first = at.setdefault((t.grad_fn, t.output_nr), k)
        if first != k:
            fed.update((first, k))  # a copy each: a hook on the value itself would read both
    stop = {a.grad_fn for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    walked = 0
    for k, t in outs:
        todo, seen = list(t.grad_fn.next_functions), set()
        while todo:
            node, nr = todo.pop()
            if node is None:
                continue
            hit = at.get((node, nr))
            if hit is not None and hit != k:
                fed.add(hit)
            if node in seen or node in stop:
                continue
            seen.add(node)
            walked += 1
            if walked > limit:
                return {k for k, _ in outs}
            todo.extend(node.next_functions)
    return fed


def leaf_outputs(output) -> set[int] | None:
    """Positions of the outputs a layer returned as they are, leaves that require grad (a
    relative-position table's ``forward`` returning ``self.table``): {0} for a Tensor. Its
    output then *is* the parameter, so the gradient its hook reads is the parameter's whole
    gradient, which the use tracker also counts where the parameter meets the batch (at n = 1
    the output's dim 0 of size 1 passes for the batch's: counted twice, 2x). A copy taken
    inside the layer (``copy_leaves``) is an output computed from the parameter, as
    ``self.table * 1`` is, which every route reads once."""
    if isinstance(output, torch.Tensor):  # an nn.Parameter too
        return {0} if output.requires_grad and output.grad_fn is None else None
    if isinstance(output, (tuple, list)):
        found = {k for k, t in enumerate(output) if isinstance(t, torch.Tensor)
                 and t.requires_grad and t.grad_fn is None}
        return found or None
    return None


def copy_leaves(output, leaves: set[int]):
    """``output`` with its leaves (``leaf_outputs``) copied; None for a tuple type that cannot
    be rebuilt."""
    if isinstance(output, torch.Tensor):
        return output.clone()  # a plain Tensor, computed from the parameter
    return apart(output, leaves)


def apart(output, fed: set[int]):
    """``output`` with a copy of each Tensor at the positions ``fed``: the layer's own ops
    read the original, everything after the call the copy, whose gradient is then the one
    from outside the layer alone (``fed_outputs``). None for a tuple type that cannot be
    rebuilt."""
    items = [t.clone() if k in fed else t for k, t in enumerate(output)]
    if type(output) in (tuple, list):
        return type(output)(items)
    if hasattr(output, "_make"):  # a namedtuple
        return output._make(items)
    return None


def odd_output(output) -> str:
    """What a layer returned that ``tensor_outputs`` cannot read, in words."""
    kind = type(output).__name__
    if isinstance(output, (tuple, list)) and all(
            o is None or isinstance(o, torch.Tensor) for o in output):
        return f"{kind} holding Tensors that do not require grad beside ones that do"
    return f"{kind} (not a Tensor, nor a tuple of Tensors and None)"


PAUSED: collections.Counter = collections.Counter()  # id(layer) -> recorders of it inside
# ``paused()``: their gradient passes are none of the user's, for any recorder of that layer

_MODULE_KEYS = frozenset(nn.Module().__dict__)  # torch's own slots: hook dicts, _parameters...


def state_of(module: nn.Module) -> list:
    """[(path, submodule, (bindings, buffer versions))] for ``module`` and every module inside
    it (a re-run of its forward runs theirs too: a state kept on a child is read as well):
    what a forward may read besides its arguments and parameters, as identities (``is``) and
    ``_version`` counters: cheap, no values read."""
    if not module._modules:  # the usual layer: no walk
        return [("", module, _own_state(module))]
    return [(path, m, _own_state(m)) for path, m in module.named_modules()]


def _own_state(m: nn.Module) -> tuple:
    d = m.__dict__
    bufs = d["_buffers"]
    return dict(d), [(b, b._version) for b in bufs.values() if b is not None] if bufs else ()


def changed_state(module: nn.Module, before: list) -> list[str]:
    """The attributes of ``module`` and of the modules inside it (``child.attr``) rebound,
    added, removed, or (buffers) written in place since ``state_of`` gave ``before``; []
    when none."""
    names = []
    for path, m, state in before:
        names += [f"{path}.{k}" if path else k for k in _own_changes(m, state)]
    return names


def _own_changes(m: nn.Module, before: tuple) -> list[str]:
    bound, versions = before
    d = m.__dict__
    names = [k for k in d.keys() | bound.keys()
             if k not in _MODULE_KEYS and d.get(k, bound) is not bound.get(k, d)]
    now = [(k, b) for k, b in d["_buffers"].items() if b is not None]  # as ``state_of`` reads
    if len(now) != len(versions) or any(b is not v for (_, b), (v, _) in zip(now, versions)):
        names.append("_buffers")  # a buffer rebound (register_buffer, self.buf = t)
    else:
        names += [k for (k, b), (_, version) in zip(now, versions) if b._version != version]
    return names


def _inert(*args, **kwargs) -> None:
    return None


def _make_inert():
    return _inert


class OwnHook:
    """A hook the workbench puts on a user's module or parameter. A copy of the module
    (``copy.deepcopy``: an EMA teacher, ``torch.optim.swa_utils.AveragedModel``, an
    evaluation copy; or a pickled model) gets an inert hook instead: deep-copied as it was,
    a bound method's copy took the DP optimizer with it (a bare ``KeyError: '_defaults'``)
    and a closure's copy was the recorder's own, recording the copy's passes into the
    original's step, until 2026-11-29."""

    __slots__ = ("fn",)
    workbench = True  # the workbench's own, not a user's hook (recorded._gradient_hooks)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return _inert

    def __reduce__(self):
        return _make_inert, ()


def attach(module: nn.Module, pre_hook, hook) -> tuple:
    """``module.register_forward_pre_hook(pre_hook, with_kwargs=True)`` and
    ``module.register_forward_hook(hook, with_kwargs=True, always_call=True, prepend=True)``
    in one, without the two ``RemovableHandle`` objects
    (a fixed cost of every ``record``: ~5 µs a layer): the same entries in the module's hook
    tables, under a key drawn from torch's own counter (so no user hook's key is taken).
    Returns ``(module, key)`` for ``detach``.

    The forward hook runs before the user's forward hooks (``prepend``): it records the
    output the layer's ``forward`` returned, whose gradient b its rule reads, not one a
    user's hook computed from it (``o * 2``, a fake quantisation): b is then taken where
    forward's own output is, upstream of the hook's op, and the rule's (a, b) are forward's.
    Recorded after them, the hook's op sat between the rule's output and its b (30-33% off
    with the check off, until 2026-11-29)."""
    key = RemovableHandle.next_id
    RemovableHandle.next_id += 1
    module._forward_pre_hooks[key] = OwnHook(pre_hook)
    module._forward_pre_hooks_with_kwargs[key] = True
    module._forward_hooks[key] = OwnHook(hook)
    module._forward_hooks.move_to_end(key, last=False)
    module._forward_hooks_with_kwargs[key] = True
    module._forward_hooks_always_called[key] = True
    return module, key


_WARNED_GLOBAL: list = []


def _warn_global_hooks() -> None:
    """A global module forward hook (``register_module_forward_hook``) runs before every
    module's own, the recording's included, so an output it replaces (``o * 2``) is read as
    the layer's: its rule's (a, b) no longer match (92% off with the check off, measured
    2026-11-29). Observers returning None are harmless; warned once per process."""
    if _WARNED_GLOBAL or all(getattr(h, "observer", False)
                             for h in module_hooks._global_forward_hooks.values()):
        return  # the loss window's own (an ``observer``): it returns None
    _WARNED_GLOBAL.append(True)
    warnings.warn(
        "a global module forward hook is registered (torch.nn.modules.module."
        "register_module_forward_hook): it runs before the recording's hook on every layer, "
        "so an output it replaces is read as the layer's own and the per-sample gradients "
        "are wrong (silently with the self-check off). A hook returning None (an observer) "
        "is harmless; one returning a new output must be a forward hook of the module "
        "(module.register_forward_hook) or part of its forward", stacklevel=2)


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_backward_hooks", "_backward_pre_hooks")


@contextmanager
def bare(layer: nn.Module):
    """``layer``'s own module hooks off inside (its submodules' stay): a re-run of one
    recorded call alone (per-layer vmap) runs ``forward`` on the inputs it was recorded with,
    which its pre-hooks already produced, and returns the output whose gradient b is (``attach``);
    called through ``__call__`` with its hooks, a user's pre-hook scaling the input ran twice
    (32% off with the check off, until 2026-11-29) and a forward hook's tensor hook scaled b a
    second time (16%)."""
    d = layer.__dict__  # not setattr: a module's own __setattr__ may intervene
    saved = {name: d[name] for name in _HOOK_TABLES if name in d}
    if not any(saved.values()):
        yield layer
        return
    for name, table in saved.items():
        d[name] = type(table)()
    try:
        yield layer
    finally:
        d.update(saved)


def detach(module: nn.Module, key: int) -> None:
    """Remove what ``attach`` put in ``module``'s hook tables (as ``RemovableHandle.remove``)."""
    for table in (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs,
                  module._forward_hooks, module._forward_hooks_with_kwargs,
                  module._forward_hooks_always_called):
        table.pop(key, None)


@dataclass
class ActivationRecorder:
    """Records a ``LayerCall`` per call of each of ``layers`` (``{path: module}``)."""

    layers: dict[str, nn.Module]
    capture: str = "edges"  # "edges": self.backward() fills b; "hooks": any backward pass does
    calls: dict[str, list[LayerCall]] = field(default_factory=dict)
    untracked: dict[str, str] = field(default_factory=dict)  # path -> type of an odd output
    recording: bool = True  # False inside ``paused()``: the samplers' own layer calls
    stack: list = field(default_factory=list)  # paths of the layers whose forward is running
    generation: int = 0  # capture="hooks": backward passes finished so far
    batch_free: object = None  # broadcast.BatchFree while a use tracker runs the forward pass
    flat_rows: object = None  # flat_rows.FlatRows while a use tracker runs the forward pass
    derived: object = None  # derived.Derived of the use tracker: meetings and their results
    on_complete: object = None  # capture="hooks": (call) -> None once all its b have arrived
    recomputed: dict[str, str] = field(default_factory=dict)  # path -> why: run in a backward
    outputs_of: object = None  # (output) -> (tensors, is_tuple); default ``tensor_outputs``
    before: dict[str, tuple] = field(default_factory=dict)  # path -> ``state_of`` the layer
    # before its first recorded call: what a re-run of its calls must find (``changed``)
    drew: set = field(default_factory=set)  # paths of layers without a rule whose call drew
    # random numbers (a default generator advanced during it: ``draws``)
    again: set = field(default_factory=set)  # paths of calls a second backward pass reached
    # (capture="hooks": ``loss.backward(retain_graph=True)`` twice; refused by the optimizer)
    _draw_from: dict = field(default_factory=dict)  # path -> generator states at the call
    _handles: list = field(default_factory=list)
    _pending: bool = False
    _by_edge: dict = field(default_factory=dict)  # capture="edges": (id(node), nr) -> (call
    # ref, output index), for ``hooked``

    def __enter__(self):
        for path, layer in self.layers.items():
            self.calls[path] = []
            self._handles.append(attach(layer, self._push(path), self._forward_hook(path)))
        return self

    def __exit__(self, *exc):
        for layer, key in self._handles:
            detach(layer, key)
        self._handles.clear()
        self.stack.clear()
        return False

    def _push(self, path):
        stack, before = self.stack, self.before

        def pre_hook(module, args, kwargs):  # no tensor call: needs no ``quiet``
            stack.append(path)
            if path not in before and self.recording:
                before[path] = state_of(module)
            if self.recording and path not in self.drew and find_grad_sampler(module) is None:
                with torch._C.DisableTorchFunction():  # the layer's draws: ``draws``
                    self._draw_from[path] = generator_states()
            if len(args) > 1 or kwargs:  # before its forward runs: the uses inside it
                # (tied.py's takeovers) see the rule the whole pass will use
                called_with_more(module, *as_positional(module, args, kwargs))
            return None

        return pre_hook

    def _forward_hook(self, path: str):
        stack = self.stack

        def hook(module, args, kwargs, output):
            if module_hooks._global_forward_hooks and self.recording:
                _warn_global_hooks()
            copied, leaves = False, None
            if self.recording and path:
                with torch._C.DisableTorchFunction():  # a mode's property reads cost ~80 µs
                    if torch._C._current_graph_task_id() == -1:
                        leaves = leaf_outputs(output)
            if leaves:
                output = copy_leaves(output, leaves)  # still inside the layer: the copy is
                # its own use of its parameter (``leaf_outputs``)
                if output is None:
                    self.untracked[path] = "tuple holding a parameter as it is"
                    if stack and stack[-1] == path:
                        stack.pop()
                    return None
                copied = True
            if stack and stack[-1] == path:
                stack.pop()
            if not self.recording:
                return None
            if path in self._draw_from:
                self.draws(path)
            fed = None
            with torch._C.DisableTorchFunction():  # uses.quiet: its calls are not uses
                if torch._C._current_graph_task_id() != -1 and self._recomputation(path):
                    return None
                if type(output) is not torch.Tensor and isinstance(output, (tuple, list)) \
                        and self.outputs_of is None:  # the model's own outputs: model_loss.py
                    fed = fed_outputs(output, args, kwargs)
            if fed:  # outside the block: the modes see the copies (their rows, their taint)
                output = apart(output, fed) if path else None  # the model itself as a layer
                # (its own parameters): its outputs as they are, for model_loss.py
                if output is None:
                    self.untracked[path] = "tuple whose Tensors are computed from each other"
                    return None
            with torch._C.DisableTorchFunction():
                self.add_call(path, module, args, kwargs, output)
            return output if fed or copied else None

        return hook

    def draws(self, path: str) -> None:
        """A layer without a rule: did a default generator advance during its call (F.dropout
        with a fixed rate, ``torch.rand``, a fused kernel's dropout: by any name)? The
        per-layer vmap would draw other numbers than the batch did, so its parameters take
        the whole-model fallback with the batch's random state replayed
        (``recording.new_recording``). ``fallback.redraws`` finds a Dropout module inside a
        layer by its type; this finds every draw by its effect: a layer drawing by a
        functional call was re-run with fresh masks, its clipped sums 109% off with the check
        off, until 2026-11-29."""
        with torch._C.DisableTorchFunction():
            if advanced(self._draw_from.pop(path)):
                self.drew.add(path)

    def _recomputation(self, path: str) -> bool:
        """A layer's forward run inside a backward pass: activation checkpointing recomputing
        it. Not a call of the batch: True, not recorded. Non-reentrant checkpointing (its
        saved-tensor hooks active) only refills the saved tensors of the original call, whose
        output receives b as usual; reentrant checkpointing (grad on, no such hooks) runs a
        nested backward pass through the recomputed call instead, noted in ``recomputed``
        for the caller to refuse (``dpsgd/recorded.py``)."""
        saving = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
        if not saving and torch.is_grad_enabled():
            self.recomputed.setdefault(path, "recomputed by a nested backward pass")
        return True

    def add_call(self, path: str, layer, args, kwargs, output) -> None:
        """Record one call of ``layer`` (a module's, or a functional use: ``uses.py``)."""
        if self.outputs_of is not None:  # the model's own call (dpsgd/model_loss.py)
            tensors, is_tuple = self.outputs_of(output)
        elif type(output) is torch.Tensor:  # the usual case, without tensor_outputs' tests
            tensors, is_tuple = ([output] if output.requires_grad else []), False
        else:
            tensors, is_tuple = tensor_outputs(output)
        tainted = None  # derived.Taint: the batch known while a use tracker runs the pass
        if self.derived is not None and self.derived.taint.refs:
            tainted = self.derived.taint.through(args, kwargs, output)  # a layer's forward
            # may run where no mode sees it (an autograd.Function's, a tapped layer's)
        if tensors is None:
            self.untracked[path] = odd_output(output)  # recording.odd_outputs: fallback
            return
        if not tensors:
            return  # not differentiable here: nothing to sample
        if kwargs:  # fc(input=x): the input where every rule reads it, args[0]
            args, kwargs = as_positional(layer, args, kwargs)
        rows = None
        if not is_tuple and args and self.flat_rows is not None and self.flat_rows.tags:
            rows = unflattened(self.flat_rows, layer, args[0], tensors[0])  # None: untagged
            passed_on(self.flat_rows, layer, args[0], tensors)
        if rows is not None:  # flat_rows.py: the call on (n, T, ...) rows, Eq. (2)
            self.flat_rows.tag(tensors[0], *rows)
            args = (as_batch(args[0], rows), *args[1:])
        elif self.flat_rows is not None and self.flat_rows.tags and \
                (rows := rule_less_rows(self.flat_rows, layer, args, kwargs, tensors)):
            args, kwargs = tree_map(  # vmap on the layer maps every Tensor: each (n, T, ...)
                lambda t: as_batch(t, rows) if isinstance(t, torch.Tensor) else t,
                (args, kwargs))
        device = tensors[0].device
        captured = [capture_edge(t) for t in tensors]  # a view's b at its base (views.py)
        views = [v for _, v in captured]
        call = LayerCall(args=args, kwargs=kwargs, path=path, rows=rows,
                         edges=[e for e, _ in captured],
                         views=views if any(v is not None for v in views) else None,
                         watch=watched(tensors),
                         outputs=[(t.shape if rows is None else (*rows, *t.shape[1:]),
                                   t.dtype, t.device) for t in tensors],
                         is_tuple=is_tuple, grads=[None] * len(tensors))
        call.tainted = tainted
        if self.flat_rows is not None and self.flat_rows.orders and args and \
                isinstance(args[0], torch.Tensor):
            call.reordered = self.flat_rows.order(args[0]) is not None
        if tainted and rows is None and not call.reordered:  # rows proved, not assumed
            call.unproved = unproved(self.flat_rows, self.derived.taint.has, layer, args,
                                     kwargs, tensors)
        if torch.is_autocast_enabled(device.type):  # precision.state(device) is not None
            call.widen_to = precision.layer_dtype(layer)
        self.calls.setdefault(path, []).append(call)
        if self.capture == "edges":
            for k, (e, v) in enumerate(captured):
                if v is None:
                    self._by_edge[(id(e.node), e.output_nr)] = (weakref.ref(call), k)
        if self.capture == "hooks":
            call.handles = [t.register_hook(self._grad_hook(call, k)) for k, t in
                            enumerate(tensors)]
            # a view's b also at its base's node (views.py Eq. 1), read only where the view's
            # own hook did not fire (an in-place write after the call took its node out of
            # the graph): the view's own b is a Tensor of its own, which the loss's factor
            # can rescale in place (owned.py); a reshaped base gradient is a view
            call.handles += [e.node.register_prehook(self._pre_hook(call, k, e.output_nr,
                                                                    unless_stored=True))
                             for k, (e, v) in enumerate(captured) if v is not None]
        if self.batch_free is not None and not is_tuple and type(layer) in BROADCASTABLE \
                and rows is None:  # a call on rows proved the batch's is no batch-free call:
            # at n = 1 its output's dim 0 of size 1 would broadcast like one (Swin's window
            # rows, n = 1). (Its input's taint is no test: a model input without the batch,
            # position ids of shape (1, T), is tainted and batch-free.)
            self.batch_free.watch(call, tensors[0])

    def add_layer(self, path: str, layer) -> nn.Module:
        """A layer met during the forward pass (``uses.py``); the one already there if any."""
        if path not in self.layers:
            self.layers[path] = layer
        self.calls.setdefault(path, [])
        return self.layers[path]

    def hooks_last(self) -> None:
        """Before a backward pass: each recorded output's gradient hook moved after the hooks
        registered on the same tensor since (a loop's ``out.register_hook(lambda g: 2 * g)``,
        a user's forward hook scaling the gradient there): b is read as it flows into the
        layer, after them. Before them, b missed their factor while the layers below
        received it (33% off with the check off, until 2026-11-29)."""
        for calls in self.calls.values():
            for call in calls:
                for handle in call.handles:
                    table = handle.hooks_dict_ref()
                    if table is not None and len(table) > 1 and handle.id in table \
                            and next(reversed(table)) != handle.id:
                        table[handle.id] = table.pop(handle.id)  # not move_to_end: autograd
                        # runs the hooks in the dict's own order, which only this changes

    def redirect(self, call: LayerCall, edges: list[GradientEdge]) -> None:
        """capture="hooks": read the call's b at ``edges``, one per meeting
        (``broadcast.convert``; ``Meeting.reduce`` sums them)."""
        if self.capture != "hooks":
            return
        for handle in call.handles:
            handle.remove()
        call.grads = [None] * len(edges)
        call.handles = [edge.node.register_prehook(self._pre_hook(call, k, edge.output_nr))
                        for k, edge in enumerate(edges)]

    def _pre_hook(self, call: LayerCall, k: int, nr: int, unless_stored=False):
        store = self._grad_hook(call, k)  # no edge in the closure: a reference from the
        # node's hook back to the node would be a cycle the GC cannot see
        if not unless_stored:
            def at_node(grad_outputs):
                store(grad_outputs[nr])

            at_node.workbench = True  # a recording's own (recorded._root_hooks)
            return at_node
        ref = weakref.ref(call)

        def fallback(grad_outputs):  # only when the output's own hook stored nothing in
            # this backward pass
            held = ref()
            if held is not None and held.stored_at.get(k) != self.generation:
                store(grad_outputs[nr])

        fallback.workbench = True
        return fallback

    def _grad_hook(self, call: LayerCall, k: int):
        ref = weakref.ref(call)  # a strong reference would make a cycle through the graph:
        # output -> hook -> call -> edge -> output's node, which Python's GC cannot see into,
        # and every step's activations would stay alive after zero_grad()

        def store(grad):
            call = ref()
            if call is None or not self.recording or (
                    PAUSED and id(self.layers.get(call.path)) in PAUSED):  # paused: a check's
                return  # own gradient pass (of this recorder, or another of the same layer)
            if any(g != self.generation for g in call.stored_at.values()):  # an output of
                self.again.add(call.path)  # this call had its b in an earlier backward pass
                # (the same output: overwritten; another: two towers' losses backwarded one
                # by one, the first pass's calls left out, silently): refused
            call.grads[k] = grad
            call.generation = call.stored_at[k] = self.generation
            if not self._pending:  # count this backward pass once it has finished
                self._pending = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finished)
            if self.on_complete is not None and all(g is not None for g in call.grads):
                self.on_complete(call)  # every output's b is in: the call may be streamed

        store.workbench = True  # a recording's own, any recorder's (recorded._root_hooks)
        return store

    def _finished(self) -> None:
        self._pending = False
        self.generation += 1

    @contextmanager
    def paused(self):
        """Record nothing inside (a sampler may call the layer itself, e.g. under vmap). No
        recorder of these layers stores a gradient meanwhile (``PAUSED``): a check's own
        backward pass (the loss window's coupling test, a self-check's twin) is no backward
        pass of any recording, also another optimizer's on the same model (whose hooks took
        one for a second backward pass of the user's). Other models' recorders, in another
        thread, record on."""
        self.recording = False
        ids = [id(m) for m in self.layers.values()]
        PAUSED.update(ids)
        try:
            yield self
        finally:
            self.recording = True
            for i in ids:
                PAUSED[i] -= 1
                if PAUSED[i] <= 0:
                    del PAUSED[i]

    def clear(self) -> None:
        """Forget the recorded calls (their activations and backprops), keep the hooks."""
        self._by_edge = {}
        for calls in self.calls.values():
            for call in calls:  # drop the activations, the graph edges and the gradients now
                call.args, call.kwargs, call.edges, call.grads = (), {}, [], []
                call.backprops, call.meet, call.handles, call.sampled = None, None, [], None
                call.rows, call.views, call.watch, call.stored_at = None, None, [], {}
            calls.clear()
        self.untracked.clear()
        self.recomputed.clear()
        self.before.clear()
        self.drew.clear()
        self.again.clear()
        self._draw_from.clear()

    def changed(self, among=None) -> dict[str, list[str]]:
        """{path: what changed}: the layers (those ``among(layer)`` holds for, if given)
        whose attributes or buffers differ now from before their first recorded call
        (``changed_state``)."""
        out = {}
        for path, state in self.before.items():
            layer = self.layers.get(path)
            if layer is not None and (among is None or among(layer)) \
                    and (names := changed_state(layer, state)):
                out[path] = names
        return out

    def all_calls(self) -> list[LayerCall]:
        return [call for calls in self.calls.values() for call in calls]

    def collect(self) -> None:
        """capture="hooks": turn the gradients the tensor hooks caught into backprops."""
        for call in self.all_calls():
            call.set_backprops(call.grads)
            call.grads = [None] * len(call.grads)

    def backward(self, total_loss: torch.Tensor, retain_graph: bool = False, params=()):
        """Fill in ``backprops`` of every recorded call: ∂ total_loss / ∂o, one autograd pass.

        ``params``: also return ∂ total_loss / ∂p for these (the self-check's batch gradient).
        """
        calls = self.all_calls()
        edges = [e for c in calls for e in c.capture_edges()]
        extra = self.derived.edges() if self.derived is not None else []  # derived.py
        if not edges and not params and not extra:
            return []
        grads = torch.autograd.grad(total_loss, [*edges, *params, *extra], allow_unused=True,
                                    retain_graph=retain_graph)
        grads = grads[:len(grads) - len(extra)]
        k = 0
        for call in calls:
            m = len(call.capture_edges())
            got = grads[k:k + m]
            if call.after:  # read after the user's own hooks on those outputs (``hooked``)
                got = [call.after[i][0] if i in call.after else g for i, g in enumerate(got)]
            call.set_backprops(got)
            k += m
        return list(grads[k:])

    def hooked(self, t: torch.Tensor) -> None:
        """capture="edges": the forward pass or the loss registered a tensor hook of its own on
        ``t``. If t is a recorded output, b is read by one more hook registered after it (each
        time, so it stays last): autograd captures an edge's gradient before the node's
        tensor hooks when the pass continues below the node (PyTorch's rule), so b missed
        their factor while the layers below received it (a forward hook's
        ``o.register_hook(lambda g: 0.5 * g)``: 100% off, until 2026-11-29)."""
        node = t.grad_fn
        found = self._by_edge.get((id(node), t.output_nr)) if node is not None else None
        call = found[0]() if found is not None else None
        if call is None or call.meet is not None or call.edges[found[1]].node is not node:
            return  # not an output read at its own node (a meeting's b is read elsewhere)
        k = found[1]
        call.after = call.after or {}
        if k in call.after:
            call.after[k][1].remove()  # registered again below: after the new hook
        box = [None, None]

        def read(g):
            box[0] = g

        read.workbench = True
        box[1] = t.register_hook(read)
        call.after[k] = box


REENTRANT_FIX = ("Use use_reentrant=False: torch.utils.checkpoint.checkpoint(..., "
                 "use_reentrant=False), or model.gradient_checkpointing_enable("
                 "gradient_checkpointing_kwargs={'use_reentrant': False}) (Hugging Face's "
                 "default)")


def reentrant_refused(layers) -> UnsupportedLayerError:
    """The error for activation checkpointing with ``use_reentrant=True`` (``layers``: the
    recomputed calls' paths, or empty when only PyTorch's own refusal names it)."""
    if layers:
        return UnsupportedLayerError(
            f"{', '.join(sorted(layers)[:3])} ran their forward again inside the backward pass "
            f"and received their gradient through that recomputation's own nested backward "
            f"pass, which the optimizer cannot record as the batch's: activation checkpointing "
            f"with use_reentrant=True, or a layer whose backward recomputes its inputs from "
            f"its outputs (reversible residual layers: Reformer, RevNet). {REENTRANT_FIX}; "
            f"a reversible model has no such switch: the functional API "
            f"(wb.clipped_grad_sum, wb.per_sample_gradients) runs it exactly where the "
            f"layer's backward returns its parameters' gradients through its inputs, and "
            f"refuses by name one that writes them into .grad itself (Reformer's "
            f"_ReversibleFunction); the optimizer does not run it")
    return UnsupportedLayerError(
        f"the model runs activation checkpointing with use_reentrant=True. Its nested "
        f"backward pass cannot be recorded as the batch's, and the per-sample passes and "
        f"checks (torch.autograd.grad) are refused by it. {REENTRANT_FIX}")


def grad_written(names: list[str]) -> UnsupportedLayerError:
    """The error for parameters whose ``.grad`` was written during the per-sample passes
    (``refusing_reentrant``): their gradient reached them outside the graph's edges."""
    shown = ", ".join(repr(k) for k in names[:4]) + (
        f" and {len(names) - 4} more" if len(names) > 4 else "")
    return UnsupportedLayerError(
        f"parameter{'s' if len(names) > 1 else ''} {shown} received gradient by a write into "
        f".grad inside the backward pass (a custom torch.autograd.Function whose backward "
        f"calls torch.autograd.backward itself: Reformer's _ReversibleFunction, a reversible "
        f"or recomputing layer), not through the graph's edges that the per-sample passes "
        f"read: their per-sample gradients would come out zero, and every record's norm and "
        f"clipped sum wrong. Use a layer whose backward returns the parameters' gradients "
        f"through its inputs (pass them to the Function's forward), activation "
        f"checkpointing with use_reentrant=False, or freeze these parameters "
        f"(requires_grad_(False))")


def _model_of(args, kwargs):
    model = kwargs.get("model", args[0] if args else None)
    return model if isinstance(model, nn.Module) else None


def refusing_reentrant(fn):
    """``fn`` (a public per-sample entry point: ``per_sample_gradients``,
    ``per_sample_grad_norms``, ``clipped_grad_sum``, every method) with two refusals:

    - PyTorch's refusal of reentrant checkpointing inside ``torch.autograd.grad`` raised as
      ``reentrant_refused``: the same words as the optimizer's (``dpsgd/recorded.py``), not
      a bare RuntimeError;
    - invariant: a parameter whose gradient reaches it other than through the graph edges
      the passes read is refused by name (``grad_written``). Every method reads gradients
      through the graph (``torch.autograd.grad``, the recorder's edges); a layer whose
      backward writes ``.grad`` itself (a nested ``torch.autograd.backward``) left those
      parameters' rows exactly zero (HF Reformer in train mode: the clipped sum 2% off, no
      error, until 2026-11-30). The model's trainable parameters' ``.grad`` are set aside
      (None) for the call: one set after it was written by a backward pass of the call; the
      ``.grad`` fields are then put back as they were, whatever the outcome.
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        model = _model_of(args, kwargs)
        params = [] if model is None else [
            (k, p) for k, p in model.named_parameters() if p.requires_grad]
        kept = [p.grad for _, p in params]
        try:
            for _, p in params:
                p.grad = None
            try:
                out = fn(*args, **kwargs)
            except Exception as error:  # a check it failed (a self-check's norms): the
                written = [k for k, p in params if p.grad is not None]  # cause named first
                if written:
                    raise grad_written(written) from error
                if isinstance(error, RuntimeError) and "use_reentrant=True" in str(error):
                    raise reentrant_refused(()) from error
                raise
            written = [k for k, p in params if p.grad is not None]
        finally:
            for (_, p), g in zip(params, kept):
                p.grad = g
        if written:
            raise grad_written(written)
        return out

    return run


__all__ = [
    "PAUSED", "ActivationRecorder", "LayerCall", "OwnHook", "attach", "changed_state",
    "copy_leaves", "detach", "drop_inputs", "grad_written", "leaf_outputs", "odd_output",
    "output_tensors", "reentrant_refused", "refusing_reentrant", "state_of", "tensor_outputs",
]
