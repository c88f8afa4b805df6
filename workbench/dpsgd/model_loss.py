"""The model's own outputs, and the loss a model computes inside its forward pass.

A Hugging Face model returns a ``ModelOutput`` (a dict subclass), and, called with
``labels=``, computes its loss inside ``forward``:

    out = model(input_ids=ids, attention_mask=mask, labels=labels)      out.loss.backward()

``out.loss`` is ``F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)``,
the mean over every non-ignored position of the whole batch (causal models shift the labels
first): L = Σ_t ℓ_t / D, D = #{t : y_t ≠ -100}, a normalisation by a statistic of the
batch's labels. The optimizer records the model's call; two things follow here.

**The model's outputs** (``model_outputs``): the tensors of a Tensor, a tuple or list, or a
mapping (``ModelOutput``, dict), in order, that require grad; of these, the per-record ones
(dim 0 = the batch) first, then the scalars that are *not* computed from them. A scalar
computed from the per-record outputs (``out.loss``) is a loss over them: its gradient
reaches the parameters through those outputs, whose recorded gradient b_out already holds
it, so it is no output of its own (⟨o_i, b_out,i⟩ is record i's whole part of the model's
gradient, ``recorded.dot_loss``). Every pass that reads the model's outputs (the recording,
the probes, the exact fallback) flattens them this one way.

**The loss inside the model** (``InnerLosses``): while the model's forward pass runs, every
call of a functional loss (``loss_watch.FUNCTIONAL``: ``F.cross_entropy``, also inside
``nn.CrossEntropyLoss`` and Hugging Face's ``ForCausalLMLoss``) is noted with its arguments.
At ``loss.backward()``, each such scalar the loss is computed from must be one of those calls'
own outputs; then it is the window's loss call for this backward pass, exactly as if the loop
had called it after the model (``per_sample/loss.py``: ℓ_i = Σ_{t∈i} ℓ_t / N_i, the factors
f_i = D / N_i, its reduction checked against ``loss_reduction``, its separability probed).
Any other scalar computed inside the model from its outputs (a loss divided by
``num_items_in_batch``, an auxiliary load-balancing term added to it) cannot be attributed
to records: ``LossCouplingError`` names it, before the backward pass runs.

Notation: n records, t a position, ℓ_t a position's loss, D the mean's denominator, N_i the
positions of record i that count, f_i per-record factors.
"""

import inspect
import weakref
from collections.abc import Mapping

import torch
from torch.compiler import is_compiling
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import keystr, tree_flatten_with_path

from workbench.dpsgd.lifetime import LIMIT, reaches, weak_attribute
from workbench.per_sample.hooks import output_tensors


def _leaves(output):
    """[(key, tensor)] of every tensor in a mapping, tuple or list (nested, a ``ModelOutput``
    too: ``torch.utils._pytree``); None for an output of another type."""
    if not isinstance(output, (Mapping, tuple, list)):
        return None
    found = tree_flatten_with_path(output)[0]
    return [(keystr(path), v) for path, v in found if isinstance(v, torch.Tensor)]


#: nodes walked to tell which outputs are computed from which: a whole model's graph (a walk
#: past it finds nothing more; a kept upstream output is then refused by the self-check)
GRAPH_LIMIT = 200_000


def _walk(start, targets: dict, stop: set, limit: int = LIMIT):
    """The keys of ``targets`` ({grad_fn node: [keys]}) met walking the autograd graph down
    from ``start`` (its inputs, not the node itself), not descending below a node of
    ``stop``; None when the walk passes ``limit`` nodes."""
    found, seen = [], set()
    todo = [f for f, _ in start.next_functions] if start is not None else []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if len(seen) > limit:
            return None
        if fn in targets:
            found.extend(targets[fn])
        if fn not in stop:
            todo.extend(f for f, _ in fn.next_functions)
    return found


def split_outputs(output):
    """The model's output tensors requiring grad, each (key, tensor), in four lists:
    per-record outputs no other output is computed from, scalars not computed from them,
    scalars computed from them (a loss), and per-record outputs another one is computed
    from (a seq2seq model's ``encoder_last_hidden_state``, ``hidden_states``: upstream).
    None for an output of another type."""
    if isinstance(output, torch.Tensor):
        return ([(None, output)] if output.requires_grad else []), [], [], []
    found = _leaves(output)
    if found is None:
        return None
    grads, ids = [], set()
    for k, t in found:
        if t.requires_grad and id(t) not in ids:  # one tensor under two keys: once
            ids.add(id(t))
            grads.append((k, t))
    per_record = [(k, t) for k, t in grads if t.dim()]
    upstream = set()
    if len(per_record) > 1:  # which outputs are computed from another one
        nodes: dict = {}
        for k, t in per_record:
            if t.grad_fn is not None:
                nodes.setdefault(t.grad_fn, []).append(k)
        for k, t in per_record:  # each walk stops at the next output: O(graph) in all
            below = _walk(t.grad_fn, nodes, set(nodes), limit=GRAPH_LIMIT)
            upstream.update(below if below is not None else [])
    kept = [(k, t) for k, t in per_record if k not in upstream]
    outs = [t for _, t in kept]
    own, computed = [], []
    for k, t in grads:
        if not t.dim():
            (computed if outs and reaches(t, outs) else own).append((k, t))
    return kept, own, computed, [(k, t) for k, t in per_record if k in upstream]


def output_keys(output):
    """The keys of ``model_outputs``' tensors, in order (None for a Tensor output)."""
    split = split_outputs(output)
    if split is None or isinstance(output, torch.Tensor):
        return None
    per_record, own = split[:2]
    return [k for k, _ in per_record + own]


def select(output, keys):
    """The tensors of ``output`` under ``keys`` (``output_keys`` of the recorded call), in
    that order; without keys, the output itself (a Tensor, or the Tensors of a tuple or list
    that can carry gradients: ``hooks.output_tensors``, None skipped).
    Read by key, not by ``requires_grad``: inside ``torch.func`` transforms the flag is
    not the one the recorded call had."""
    if keys is None:
        return tuple(output_tensors(output))
    found = dict(_leaves(output) or ())
    return tuple(found[k] for k in keys)


def model_outputs(output):
    """(tensors, is_tuple): the model's outputs as the recording keeps them (module
    docstring); (None, False) for an output of another type."""
    split = split_outputs(output)
    if split is None:
        return None, False
    per_record, own = split[:2]
    if isinstance(output, torch.Tensor):
        return [t for _, t in per_record], False
    return [t for _, t in per_record + own], True


class InnerLosses(TorchFunctionMode):
    """The functional loss calls of one forward pass of the model (module docstring)."""

    def __init__(self, functional: dict):
        super().__init__()
        self.functional = functional
        self.calls: list = []  # (weakref to the output, cls, options, z, y)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_compiling():  # Dynamo traces the modes on the stack: the op alone (the
            return func(*args, **kwargs)  # private model's pass is refused: recorded.py)
        out = func(*args, **kwargs)
        if func in self.functional and isinstance(out, torch.Tensor) and not out.dim() \
                and out.requires_grad:
            cls, names = self.functional[func]
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            options = {k: bound.arguments[k] for k in names if k in bound.arguments}
            positional = [v for k, v in bound.arguments.items() if k not in names]
            self.calls.append((weakref.ref(out), cls, options, positional[0],
                               positional[1] if len(positional) > 1 else None))
        return out

    def call_of(self, t):
        """(cls, options, z, y) of the call that returned ``t``, or None."""
        for ref, cls, options, z, y in self.calls:
            if ref() is t:
                return cls, options, z, y
        return None


class ModelLosses:
    """What one forward pass's output holds besides its recorded outputs: the scalars computed
    from them, with the calls that may have returned them (``attribute``), and the upstream
    outputs (``upstream_use``)."""

    inner = weak_attribute("inner")

    def __init__(self, split, inner: InnerLosses | None):
        kept, _, computed, upstream = split
        self.computed = [(k, weakref.ref(t)) for k, t in computed]
        self.upstream = {t.grad_fn: k for k, t in upstream if t.grad_fn is not None}
        self.kept = {t.grad_fn for _, t in kept if t.grad_fn is not None}
        self.inner = inner
        self._keep = inner  # the calls live as long as this pass's window

    def used_by(self, loss):
        """[(key, tensor)] of the scalars ``loss`` is computed from."""
        out = []
        for key, ref in self.computed:
            t = ref()
            if t is not None and (loss is t or reaches(loss, [t])):
                out.append((key, t))
        return out

    def upstream_use(self, loss):
        """The key of an upstream output ``loss`` reads directly (not through the recorded
        outputs), or None. Its recorded gradient would hold what flows through the outputs
        computed from it too, so ⟨o, b⟩ would count that part twice: refused by the caller."""
        if not self.upstream or loss.grad_fn is None:
            return None
        if loss.grad_fn in self.upstream:
            return self.upstream[loss.grad_fn]
        found = _walk(loss.grad_fn, {n: [k] for n, k in self.upstream.items()}, self.kept)
        if found is None:
            return next(iter(self.upstream.values()))  # too deep to tell: say so
        return found[0] if found else None


def name_of(key) -> str:
    """How the loop reads the output: ``out['loss']``, ``out[1]``."""
    return f"out{key}" if key else "the output"


__all__ = [
    "GRAPH_LIMIT", "InnerLosses", "ModelLosses", "model_outputs", "name_of", "output_keys",
    "select", "split_outputs",
]
