"""The optimizer's side of the one recording: the user's loop runs, the hooks listen.

``DPOptimizer`` never sees the loss, only what the user's ``loss.backward()`` leaves behind.
``ModelRecorder`` keeps, per backward pass (a *generation*, ``per_sample.hooks``):

- every layer call's activations and backprops (the per-layer rules' input);
- the model's own call: its inputs and the gradient of its output b_out. For one sample,
  ⟨f(x_i; θ), b_out,i⟩ has gradient g_i (the loss depends on θ only through the output), so
  ``dot_loss`` turns the exact machinery of the functional API (whole-model fallback, probe)
  into the optimizer's;
- the uses of parameters outside their layer (``per_sample.uses``), seen while the model's
  forward runs.

- the loss calls between the forward and the backward pass (``loss_watch.py``): their
  per-record factors f_i replace the mean's n, so record i's recorded backprops become the
  gradient of its own loss (``per_sample.loss``, class weights and ``ignore_index``);
- the random state at the start of the model's forward pass, for the record probe.

Two backward passes before one ``step()`` (gradient accumulation) are two batches of distinct
samples: each is clipped on its own. Every batch whose call signature (n symbolic,
``selfcheck.signature``) is new is verified: the engine's ||g_i|| against micro-batching on
one sample, or, with randomness (dropout), against the record probe that replays the batch's
random state with the other records substituted (``per_sample.selfcheck``). A loss term
reaching the parameters outside the model's output (an L2 penalty) is found by
``path_gradients``: the user's ``.grad`` must equal Σ_i g_i (the optimizer compares).

Notation: n batch size, b_out gradient of the loss w.r.t. the model's output, g_i per-sample
gradient.
"""

import collections
import warnings
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from workbench.clipping.engine import reweighted_weight_grads
from workbench.dpsgd.collate_check import padding_probe, plan_for
from workbench.dpsgd.lifetime import push_bottom
from workbench.dpsgd.loss_watch import FUNCTIONAL, LossWatch, _leave
from workbench.dpsgd.model_loss import (
    InnerLosses,
    ModelLosses,
    model_outputs,
    name_of,
    output_keys,
    select,
    split_outputs,
)
from workbench.dpsgd.path_check import grad_mark
from workbench.dpsgd.skip_weights import AUTO, WeightGradSkipper
from workbench.dpsgd.streamed import stream_call, streamed_gradients
from workbench.errors import (
    LoopError,
    LossCouplingError,
    LossShapeError,
    RecordCountError,
    UnsupportedLayerError,
)
from workbench.per_sample import precision, selfcheck, state_replay
from workbench.per_sample.checks import (
    SCALAR_OUTPUT,
    ModelCall,
    buffer_ids,
    norms_mixing,
    state_written_from_batch,
    statistics_layers,
    trainable_parameters,
)
from workbench.per_sample.derived import served_gradients
from workbench.per_sample.fallback import exact_per_sample_gradients
from workbench.per_sample.hooks import ActivationRecorder, OwnHook, reentrant_refused
from workbench.per_sample.leaves import call_leaves
from workbench.per_sample.owned import sole_holders
from workbench.per_sample.recording import (
    Recording,
    batch_problem,
    check_layers,
    check_recorded,
    layers_with_parameters,
    loss_reach,
    new_recording,
    owners_of,
    parameter_names,
    rng_state,
)
from workbench.per_sample.state_replay import PassLog
from workbench.per_sample.unseen import unseen
from workbench.per_sample.uses import UseTracker, quiet

ROOT = "<model>"


def dot_loss(outputs, backprops, keys=None, read=None) -> torch.Tensor:
    """(n,): ⟨o_i, b_i⟩ per sample, whose gradient w.r.t. θ is the per-sample gradient;
    ``keys``: the recorded call's outputs (``model_loss.output_keys``: a ``ModelOutput``'s
    per-record tensors, not the loss it computed from them); ``read``: per output, whether
    the loss read it (``dot_loss_of``), an output it did not adding nothing."""
    outs = select(outputs, keys)  # None elements skipped, as the recorded b (hooks.py)
    bs = backprops if isinstance(backprops, (tuple, list)) else (backprops,)
    pairs = [(o, b) for j, (o, b) in enumerate(zip(outs, bs)) if read is None or read[j]]
    return sum((o * b).reshape(len(o), -1).sum(1) for o, b in pairs)  # (n,) o too


def dot_loss_of(call):
    """``dot_loss`` for the outputs of the recorded model call ``call``, leaving out those
    the loss did not read (a recorded gradient of zeros): Mixtral's returned router logits,
    (n·T, E) rows, not one per record, made a record alone's sum T long, and a loss on the
    logits alone was refused as "loss_fn must return one loss per sample" (until
    2026-11-30). Decided here, on the recorded tensors, not inside ``dot_loss``: it runs
    under ``torch.func.vmap``, where a test of the data is refused."""
    keys = getattr(call, "keys", None)
    b = getattr(call, "backprops", None)
    bs = b if isinstance(b, (tuple, list)) else (b,)
    read = None
    if len(bs) > 1 and all(isinstance(t, torch.Tensor) for t in bs):
        flags = tuple(bool(t.any()) for t in bs)
        if any(flags) and not all(flags):
            read = flags
    if keys is None and read is None:
        return dot_loss
    return partial(dot_loss, keys=keys, read=read)


def _frozen_or_refused(norms, module, args) -> None:
    """A BatchNorm's pre-hook: refuse the call unless every BatchNorm of the model has its
    statistics frozen (``checks.norms_mixing``): checked at the root's pass only until
    2026-11-30, so ``model.backbone(x)`` without gradient, in training mode, wrote the
    running statistics from private data, silently."""
    mixing = norms_mixing([(path, m) for path, m in norms if m is module])
    if mixing is not None:
        raise mixing



COMPILED = (
    "the private model runs under torch.compile (a compiled wrapper of the module make_private "
    "returned, or a compiled function that calls it): the DP optimizer records each layer's "
    "inputs and proves every row is one record's with Python hooks and torch-function modes "
    "that run op by op, which torch.compile's graph capture traces into, replays and "
    "recompiles (a bare TypeError at the second step until 2026-12-01), so no clipped step "
    "could be trusted. Train the private model uncompiled; compiling is for evaluation "
    "under torch.no_grad() or for the non-private model")


def compiled_call() -> bool:
    """Whether this call runs under torch.compile: traced by Dynamo (``is_compiling``) or run
    eagerly after a graph break inside a compiled call (Dynamo's frame callback is set;
    ``torch._dynamo.disable``, which torch's optimizers wrap ``step`` in, clears it)."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:  # a build without Dynamo: nothing can be compiled
        return False
    return eval_frame.get_eval_frame_callback() not in (None, False)

class ModelRecorder:
    """Hooks on ``model`` for the parameters of ``param_groups``; removed by ``close``."""

    def __init__(self, model, param_groups, loss_reduction="mean", criterion=None):
        # DistributedDataParallel / DataParallel: record and probe the wrapped module itself,
        # so the checks' extra passes never start a collective the other ranks do not join
        self.wrapped = model
        self._inference = None  # an inference_mode pass's pause (``_enter``)
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        self.model = model
        self.layers = layers_with_parameters(model)
        self.norms = statistics_layers(model)  # frozen statistics: checked every pass
        check_layers(self.layers, strict=False)
        trainable = trainable_parameters(model)  # a complex parameter refused by name
        in_optimizer = {id(p) for g in param_groups for p in g["params"]}
        frozen = {id(p) for p in model.parameters() if not p.requires_grad}  # the torch
        # optimizer skips them (no .grad ever), so does the noise: SGD(model.parameters())
        # over a frozen backbone is a usual loop (refused, advising that very call, until
        # 2026-11-30); one unfrozen later is refused by the structure check at step
        unknown = in_optimizer - {id(p) for p in trainable.values()} - frozen
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} parameter(s) that are not "
                             f"parameters of the model (of another model, or of a copy of "
                             f"it made after the optimizer was built): build the optimizer "
                             f"from model.parameters() of the model you make private")
        self.params = {k: p for k, p in trainable.items() if id(p) in in_optimizer}
        self.outside = [p for p in trainable.values() if id(p) not in in_optimizer]
        if self.outside:
            names = [k for k, p in trainable.items() if id(p) not in in_optimizer]
            warnings.warn(f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''} require "
                          f"grad but are not in the optimizer: they are not clipped or "
                          f"updated, and their (non-private) .grad is dropped as soon as "
                          f"backward computes it; "
                          f"set requires_grad=False to silence this", stacklevel=4)
        self.snapshot = self._structure()
        self._slots = [(m._parameters, k, p, f"{path}.{k}" if path else k)  # where each
                       for path, m in self.model.named_modules()  # parameter sits
                       for k, p in m._parameters.items() if p is not None]
        self._swapped: list[str] = []  # parameters a pass ran without (``_enter``)
        self.layer_rec = ActivationRecorder(self.layers, capture="hooks").__enter__()
        self.root_rec = ActivationRecorder({ROOT: model}, capture="hooks",
                                           outputs_of=model_outputs).__enter__()
        self._inner = None  # model_loss.InnerLosses of the forward pass running
        self.tracker = UseTracker(owners_of(self.layers, model), self.layer_rec,
                                  parameter_names(model))
        self.tracker.derived.clock = lambda: self.root_rec.generation  # as rec.generation
        self.uncovered: dict[int, set[str]] = {}
        self.comparing = False  # batches(): some backward pass of the step is checked
        self.passes = 0  # batches(): the step's backward passes
        self.watch = LossWatch(loss_reduction, criterion)
        self.dropped_backward = False  # the last zero_grad() dropped a backward pass's
        # gradients before any step() (``backward_ran``; named when a step finds none)
        self.watch.paused = self.paused  # its coupling test must not reach the recording hooks
        self.watch.before_backward = self._hooks_last
        self.grad_marks: dict = {}  # id(param) -> (id, version) of its .grad after the last
        self.watch.after_backward = self._mark_grads  # backward pass (path_check.py)
        self.watch.inside = self._awaiting
        self._depth, self._tracking, self._rng, self._roots = 0, False, None, 0
        self._nested: list[int] = []  # depths of the model's calls of itself (``_enter``)
        self._buffers_before: set[int] = set()  # buffer ids at the forward pass's start
        self._warned_after: set[str] = set()  # state written after a pass: warned once
        self._warned_hooks: set[str] = set()  # parameters with a gradient hook: warned once
        self._fallback_seen = False  # a step re-ran the whole model (``_exact``)
        self._amp = None  # the autocast dtype of the forward pass running (precision.py)
        self._handles = [model.register_forward_pre_hook(OwnHook(quiet(self._enter)),  # uses.quiet
                                                          with_kwargs=True, prepend=True),
                         model.register_forward_hook(OwnHook(quiet(self._exit)),
                                                     always_call=True)]
        for _, norm in self.norms:  # a BatchNorm put back in training mode, by any call of
            # it (the model, a submodule: model.backbone(x), with or without gradient),
            # refused before its running statistics are written from the batch
            self._handles.append(norm.register_forward_pre_hook(
                OwnHook(partial(_frozen_or_refused, self.norms))))
        # skip_weights.py: True, False or AUTO (the default: from the first step, one layer
        # kept at the first, ``warm``, until a GradScaler is seen); armed by zero_grad() until
        # the step (clear)
        self.skip_weight_grads, self.armed, self._fast = AUTO, False, False
        self.warm, self.scaler_seen = False, False
        self.skipper = WeightGradSkipper(self.layers, {id(p) for p in self.params.values()},
                                         lambda: self._fast and self.layer_rec.recording,
                                         lambda args: self.tracker.derived.taint.none_of(args),
                                         self._off_rows)
        self.skipper.attach(True)
        # book-keeping's streaming in the user's backward pass (streamed.py): the last
        # forward pass's n, {path: own parameters}, {id(param): paths of its streamed g_i}
        self._n, self._own, self._ids = None, {}, {id(p) for p in self.params.values()}
        self._rows: set[int] = set()  # dim 0 of the forward pass's inputs (_off_rows)
        self.watch.parameter_ids = self._ids
        self.watch.parameter_names = {id(p): name for name, p in model.named_parameters()}
        self._stream_paths: dict[int, set[str]] = {}
        self.layer_rec.on_complete = lambda call: stream_call(self, call)

    def _mark_grads(self) -> None:
        """Each parameter's ``.grad`` as the backward pass left it (identity and version): an
        edit between the backward pass and the step (``clip_grad_value_``, ``p.grad.add_``)
        is named where the ``.grad`` check fails (``path_check.py``)."""
        with torch._C.DisableTorchFunction():
            self.grad_marks = {id(p): grad_mark(p) for p in self.params.values()}

    def _structure(self):
        """(ids of the modules, ids of the trainable parameters), in ``modules()`` order;
        read with torch-function dispatch off (``uses.quiet``): each ``p.requires_grad``
        would otherwise reach every mode on the stack (the loss window's, at ``step()``)."""
        with torch._C.DisableTorchFunction():
            return structure(self.model)

    def _enter(self, module, args, kwargs):
        if self._depth == 0 and torch.is_inference_mode_enabled() and self._inference is None:
            # an evaluation under torch.inference_mode(): its tensors carry no version counter
            # and no graph, so nothing of it can reach a loss; the pass is not the batch's
            # (recorded, its tags crashed: "Inference tensors do not track version counter",
            # probe AL). Unrecorded, as the recorder's own passes are
            self._inference = ExitStack()
            self._inference.enter_context(self.paused())
        if self._depth == 0:  # before anything changes: may raise
            if self.layer_rec.recording and torch.is_grad_enabled() and compiled_call():
                raise LoopError(COMPILED)
            try:
                if self.layer_rec.recording:  # statistics of the batch before it: loss_watch
                    self.watch.forward_begins((args, kwargs))  # (keyword inputs too:
                    # model(x=x) was no pass's input to Earlier until 2026-11-30)
            except BaseException:  # _exit (always_call) runs after a pre-hook that raised:
                self._depth += 1  # the depth was left at -1, every later pass nested, until
                raise  # 2026-11-30
        if self._depth >= 1 and self.root_rec.recording:  # the forward calls the model itself
            # (self(h, depth - 1)): part of this pass, as self.forward(...) would be, not a
            # pass of its own (its input computed from the model's parameters was refused as
            # an encoder outside the model until 2026-11-29); its layers are recorded as ever
            self.root_rec.recording = False
            self._nested.append(self._depth)
        self._depth += 1
        if self._depth == 1 and self.layer_rec.recording:
            if torch.is_grad_enabled():  # a new forward pass: the loss window of the last
                self.watch.close()  # one ends; not at a pass without gradient (an
                # evaluation before the loss), which left a loss centring the logits over the
                # batch unchecked until 2026-12-01 (probe X's P1)
            device = next(iter(self.params.values())).device
            self._rng, self._amp = rng_state(device), precision.state(device)
            skip = self.skip_weight_grads is True or (self.skip_weight_grads is AUTO
                                                      and not self.scaler_seen)
            # the default's first step keeps one layer's .grad: a GradScaler's inf check
            # needs one to run on (skip_weights.py)
            self.skipper.kept = (self.skipper.smallest() if self.skip_weight_grads is AUTO
                                 and not self.warm else None)
            self._fast = (skip and self.armed and torch.is_grad_enabled()
                          and self._amp is None and not distributed_run(self.wrapped))
            if self._fast:
                self.skipper.keep_last()  # after any pre-hook a user added since
            self._roots = len(self.root_rec.calls[ROOT])
            if torch.is_grad_enabled():  # a loss computed inside the model (model_loss.py)
                self._inner = InnerLosses(FUNCTIONAL)
                push_bottom(self._inner)
            self._buffers_before = buffer_ids(self.model)  # state_written_from_batch
            self.tracker.state = PassLog(self.model)  # what the pass reads: re-runs replay it
            self.tracker.__enter__()
            leaves = call_leaves(args, kwargs)
            self.tracker.start(leaves)  # the batch: its taint and rows
            self._swapped = [name for d, k, p, name in self._slots if d.get(k) is not p]  # e.g.
            # torch.func.functional_call(model, {name: p * 2}): the re-runs use p itself
            self._rows = {t.shape[0] for t in leaves  # dim 0 of the model's inputs
                          if isinstance(t, torch.Tensor) and t.dim() >= 1}
            self._tracking = True

    def _exit(self, module, args, output):
        self._depth -= 1
        if self._depth == 0 and self._inference is not None:
            self._inference, stack = None, self._inference
            stack.close()
        if self._nested and self._nested[-1] == self._depth:  # the nested call ends (the
            self._nested.pop()  # root recorder's own hook, which runs first, skipped it)
            self.root_rec.recording = True
        if self._depth == 0:
            self._fast = False
            self.watch.forward_ends()  # an evaluation pass paused the batch follower
        inner = None
        if self._depth == 0 and self._inner is not None:
            inner, self._inner = self._inner, None
            _leave(inner)
        if self._depth == 0 and self._tracking:
            self._tracking = False
            # the loss is not seen here: an output the model returns may be used there
            self.tracker.batch_free.exclude(tree_flatten(output)[0])
            self.tracker.__exit__(None, None, None)
            log, self.tracker.state = self.tracker.state, None
            log.close()
            if not self.warm or self._fallback_seen:  # a re-run likely at this step:
                log.fingerprint()  # a write after the pass through .data must show
            taint = self.tracker.derived.taint
            written = state_written_from_batch(self.model, taint.has, taint.wrote,
                                               self._buffers_before)
            missed = unseen(self.tracker, tree_flatten(output)[0])  # Function.apply's uses
            for key, where in (*self.tracker.uncovered.items(), *missed.items()):
                self.uncovered.setdefault(key, set()).update(where)
            roots = self.root_rec.calls[ROOT]
            recorded = len(roots) > self._roots
            self.tracker.derived.settle(tree_flatten(output)[0], roots[-1].outputs[0][0][0]
                                        if recorded and len(roots[-1].outputs[0][0]) else None,
                                        self.layer_rec)
            if recorded:  # this forward pass's call: its random state
                roots[-1].rng, roots[-1].amp = self._rng, self._amp  # replayed by the checks
                roots[-1].state = log  # and the model's state as the pass read it
                roots[-1].keys = output_keys(output)  # which outputs (model_loss.py)
                roots[-1].trace = self.tracker.trace  # its ops: the self-check's signature
                roots[-1].hooks = self.tracker.hooks  # its gradient hooks: named in a refusal
                roots[-1].swapped = self._swapped  # parameters the pass ran without
                shape = roots[-1].outputs[0][0]
                self._n = shape[0] if len(shape) else None  # streaming: dim 0 must be n
                self.watch.open(shape[0] if len(shape) else 1, self.root_rec.generation,
                                tree_flatten(output)[0], self.tracker.flat_rows.full,
                                bool(self.tracker.hooks))
                split = split_outputs(output)
                if split is not None and (split[2] or split[3]):  # a loss, upstream outputs
                    self.watch.model_losses = ModelLosses(split, inner)
            if written is not None:  # raised last: the recorder is consistent
                raise written
            self.tracker.refuse_mixing(tree_flatten(output)[0], self.paused)  # a statistic
            # over the records the outputs' gradient flows through (batch_reductions.py)

    def _off_rows(self, args) -> bool:
        """A call (its first tensor argument) whose dim 0 is neither the batch's rows (dim 0
        of one of the model's inputs) nor batch-flattened rows proved from them
        (``flat_rows.py``): ``b(x[:k])``. Not tapped (``skip_weights.py``)."""
        a = next((t for t in args if isinstance(t, torch.Tensor)), None)
        if a is None or a.dim() == 0 or a.shape[0] in self._rows:
            return False
        tag = self.tracker.flat_rows.of(a)
        return tag is None or tag[0] not in self._rows

    def _hooks_last(self) -> None:
        """Before the loop's backward pass: every layer output's gradient hook after the hooks
        the loop or a user's forward hook put on the same tensor (``hooks_last``), and the
        model output's where the twins that re-run the model need it (``_root_hooks``)."""
        self._root_hooks()
        self.layer_rec.hooks_last()

    def _root_hooks(self) -> None:
        """The model's output's b (``f_i b_i``) seeds the exact twins, which run the model
        again (whole-model fallback, record probe): hooks the forward pass put on that output
        (a head's forward hook's ``o.register_hook``) run again there, the loop's (``out.
        register_hook`` after the pass) do not. So b is read before the former (first in the
        chain) and after the latter (last); both on one output: refused, no seed serves."""
        for calls in self.root_rec.calls.values():
            for call in calls:
                for handle in call.handles:
                    table = handle.hooks_dict_ref()
                    if table is None or handle.id not in table or len(table) < 2:
                        continue
                    keys = list(table)
                    at = keys.index(handle.id)
                    ours = {k for k, hook in table.items()  # any recording's (two optimizers
                            if getattr(hook, "workbench", False)}  # on one model's parts)
                    inside = [k for k in keys[:at] if k not in ours]
                    loop = [k for k in keys[at + 1:] if k not in ours]
                    if inside and loop:
                        raise LoopError(
                            "the model's output carries tensor hooks registered inside its "
                            "forward pass (a forward hook's o.register_hook) and by the loop "
                            "after it (out.register_hook): the optimizer's exact twins run the "
                            "model again, which registers the former anew but not the latter, "
                            "so no recorded gradient of the output can seed them. Register "
                            "the loop's hook inside the model (a forward hook), or remove one")
                    if inside:  # first: the raw ∂L/∂o, the twin's forward re-applies them
                        hooks = dict(table)
                        table.clear()
                        table[handle.id] = hooks.pop(handle.id)
                        table.update(hooks)
                    elif loop:  # last: after the loop's hooks, which no twin re-applies
                        table[handle.id] = table.pop(handle.id)

    def close(self) -> None:
        self.watch.close()
        self.watch.batch_ends(report=False)
        self.skipper.close()
        for handle in self._handles:
            handle.remove()
        self.layer_rec.__exit__(None, None, None)
        self.root_rec.__exit__(None, None, None)

    @contextmanager
    def paused(self):
        with ExitStack() as stack:
            stack.enter_context(self.layer_rec.paused())
            stack.enter_context(self.root_rec.paused())
            yield

    def clear(self, keep_pending: bool = False) -> None:
        """Forget the recorded calls; ``keep_pending``: the loss probes still to run."""
        pending = self.watch.pending
        self.layer_rec.clear()
        self.root_rec.clear()
        self.tracker.derived.clear()
        self.skipper.clear()
        self._stream_paths = {}
        self.armed = False
        self.watch.close()
        self.watch.clear()
        if keep_pending:
            self.watch.pending = pending

    def step_hooks(self) -> list[str]:
        """The gradient hooks this step's forward passes and loss windows registered
        (``uses.UseTracker._hooked``, ``LossWatch.traced``), for a refused check's message."""
        found = [h for c in self.root_rec.calls[ROOT] for h in getattr(c, "hooks", ())]
        return found + [h for _, hooks in self.watch.windows.values() for h in hooks]

    def backward_ran(self) -> bool:
        """A backward pass ran through a forward pass recorded since the last step."""
        return any(any(g is not None for g in c.grads) for c in self.root_rec.all_calls())

    def forward_awaits_backward(self) -> bool:
        """A training forward pass was recorded since the last step and no backward pass has
        run through any (``zero_grad()`` between them clears ``.grad`` only)."""
        roots = self.root_rec.all_calls()
        return bool(roots) and not any(any(g is not None for g in c.grads) for c in roots) \
            and bool(self._awaiting()[1])

    def _awaiting(self) -> tuple[dict, dict]:
        """({id(node): (node, path)}, {id(node): node}): where the recorded layer calls, and
        the model's own calls, still awaiting their backward pass read their backprops
        (``LossWatch.internal``: a loss reaching a layer's other than through the model's
        outputs, of this forward pass or an earlier one of the step, is refused)."""
        layers = {id(e.node): (e.node, path) for path, calls in self.layer_rec.calls.items()
                  for c in calls if c.backprops is None and c.sampled is None
                  for e in c.capture_edges() if e.node is not None}
        roots = {id(e.node): e.node for c in self.root_rec.calls[ROOT]
                 if c.backprops is None for e in c.capture_edges() if e.node is not None}
        return layers, roots

    def _gradient_hooks(self) -> None:
        """Warn, once per parameter, of a gradient hook on a trainable parameter
        (``p.register_hook``, ``register_post_accumulate_grad_hook``): the optimizer computes
        each record's gradient from the layers' activations and backprops and writes
        ``.grad`` at ``step()``, so no such hook acts on what is released. A pruning mask
        applied there was dropped silently with the check off (the masked weights moved);
        with it on, the self-check's twin, which runs the hook, disagreed with no word of
        why. Legitimate for an observer, so a warning."""
        with torch._C.DisableTorchFunction():  # attribute reads: no mode on the stack sees
            found = [(name, [*(p._backward_hooks or {}).values(),  # them (the loss window's
                             *(p._post_accumulate_grad_hooks or {}).values()])  # is still on)
                     for name, p in self.params.items() if name not in self._warned_hooks]
        for name, hooks in found:
            if any(not getattr(h, "workbench", False) for h in hooks):
                self._warned_hooks.add(name)
                warnings.warn(
                    f"parameter {name} has a gradient hook (register_hook or "
                    f"register_post_accumulate_grad_hook): DP-SGD computes each record's "
                    f"gradient from the layers' activations and backprops and writes .grad "
                    f"at step(), so the hook acts on nothing the optimizer releases. A hook "
                    f"changing the gradient (a pruning mask, a clamp) has no effect on the "
                    f"update, and the self-check, whose twin runs it, then fails. Mask the "
                    f"weights after step(), or prune with torch.nn.utils.prune (a "
                    f"reparametrisation the optimizer follows); an observer sees only the "
                    f"non-private gradient, if any", stacklevel=6)  # the loop's step()

    def check_step(self) -> None:
        """A fresh backward pass since the last step, into the model made private; or an
        empty batch of the engine's loader (n = 0, announced by ``loss_watch.watched``) that
        the loop did not run through the model (many models, Hugging Face's among them,
        cannot take n = 0): its step adds the noise to a zero sum, as DP-SGD must."""
        self._gradient_hooks()
        now = self._structure()
        if now != self.snapshot:
            raise LoopError(f"the model's layers or trainable parameters changed after "
                            f"make_private ({changes(self.model, self.snapshot, now)}): the "
                            f"optimizer records, clips and noises the parameters it was made "
                            f"over, so an added or unfrozen one would get no private gradient "
                            f"and a frozen or resized one a wrong one. Call make_private again "
                            f"on the changed model (with a new optimizer over its trainable "
                            f"parameters; the accountant's ledger is the engine's and goes on); to "
                            f"freeze part of a model mid-run without that, give it its own "
                            f"parameter group before make_private and set that group's lr to "
                            f"0 (and momentum, weight_decay) when the time comes")
        roots = self.root_rec.all_calls()  # the model's own calls this step, read once
        scalar = next((c for c in roots if c.outputs and all(
            len(shape) == 0 for shape, _, _ in c.outputs)), None)
        if scalar is not None:
            keys = getattr(scalar, "keys", None)
            what = name_of(keys[0]) if keys else "the output"
            raise LossCouplingError(
                f"the model returned only scalars ({what}: e.g. a loss computed inside its "
                f"forward pass over the whole batch), no per-record output: the optimizer "
                f"attributes the gradient to records through the outputs the loss is "
                f"computed from (dim 0 = the batch). Return them too (a Hugging Face model's "
                f"ModelOutput as it is, with its logits), or return the logits and compute "
                f"the loss after the model")
        if not roots and ROOT not in self.root_rec.untracked and any(
                self.layer_rec.calls.values()):  # (an output the recorder cannot read is
            # named below: it was called a submodule call until 2026-12-01, probe X)
            ran = next(path for path, calls in self.layer_rec.calls.items() if calls)
            raise LoopError(
                f"the layers of the model made private ran ({ran or '<model>'} first), but not "
                f"the model itself: the loop called a submodule directly (model.hf(...), "
                f"model.base_model(...)), so the gradient at the private model's output, "
                f"which the optimizer attributes to records, was never recorded. Call the "
                f"model that was made private, or make_private the module the loop calls")
        if not any(any(g is not None for g in c.grads) for c in roots):
            if self.watch.announced == 0 and not roots:
                return  # an empty Poisson batch, not run through the model: Σ_i c_i g_i = 0
            if ROOT in self.root_rec.untracked:  # e.g. a dict or a Hugging Face ModelOutput
                raise TypeError(
                    f"the model returned a {self.root_rec.untracked[ROOT]}: the optimizer "
                    f"records a model whose output is a tensor or a tuple of tensors (it needs "
                    f"d loss / d output per record). Wrap the model so that it returns the "
                    f"tensor the loss reads, e.g. forward = lambda *a, **k: model(*a, **k)"
                    f"['logits'] in an nn.Module, and compute the loss from that")
            if self.dropped_backward:
                raise LoopError(
                    "step() found no gradients: optimizer.zero_grad() was called after "
                    "loss.backward() and before step(), and it dropped that backward pass's "
                    "recorded gradients (the optimizer computes the clipped gradients at "
                    "step() from what the backward pass recorded). Call zero_grad() before "
                    "the forward pass (or right after step()): optimizer.zero_grad(); "
                    "loss = criterion(model(x), y); loss.backward(); optimizer.step()")
            raise LoopError("step() called without a backward() since the last step (or "
                               "twice after one backward): each step needs its own "
                               "optimizer.zero_grad(), loss = criterion(model(x), y), "
                               "loss.backward(), then optimizer.step(). A step without fresh "
                               "gradients would be a pure-noise update charged to the budget "
                               "(only an empty batch of the engine's loader steps without a "
                               "forward pass: its clipped sum is zero)")

    def batches(self, loss_reduction: str, check, scale=None):
        """(Recording, exact per-sample gradients of fallback parameters) per backward pass.

        ``check``: ``selfcheck``'s option (True: each new call signature). ``scale``: a
        GradScaler's scale, divided out of every recorded backprop."""
        if self.layer_rec.recomputed:
            raise reentrant_refused(self.layer_rec.recomputed)
        again = sorted(self.layer_rec.again | self.root_rec.again)
        if again:  # each call's b would be the last pass's alone (13% off, silent, in every
            # mode until 2026-11-30)
            raise LoopError(
                f"a second backward pass ran through the same forward pass (loss.backward("
                f"retain_graph=True) then another backward, reaching "
                f"{', '.join(map(repr, again[:3]))}"
                f"{' ...' if len(again) > 3 else ''}): each record's gradient is that of the "
                f"sum of the losses, which the optimizer reads from one backward pass. Add the "
                f"losses and call backward once (loss = loss_a + loss_b), or run a forward "
                f"pass for each backward")
        self.layer_rec.collect()
        self.root_rec.collect()
        check_recorded(self.layers, self.layer_rec)
        roots = [c for c in self.root_rec.calls[ROOT] if c.backprops is not None]
        stray = stray_passes(roots, self.layer_rec)
        if stray:
            raise LoopError(
                f"a backward pass reached {', '.join(map(repr, stray[:3]))}"
                f"{' ...' if len(stray) > 3 else ''} without going through the private "
                f"model's output (a tensor the model kept aside, such as self.aux = "
                f"self.head(h), backwarded on its own): the optimizer reads each record's "
                f"gradient from the backward pass through the model's output. Return every "
                f"tensor the loss uses from forward() and call backward once on their loss")
        refuse_repeated_batch(roots)
        prepared = []  # every backward pass's recording first: ``comparing`` below
        for gen in sorted({c.generation for c in roots}):
            mine = [c for c in roots if c.generation == gen]
            if len(mine) > 1:
                raise several_calls(mine)
            root = mine[0]
            problem = output_rows_problem(root)
            if problem:
                raise LossShapeError(problem)
            with state_replay.modes(getattr(root, "state", None)):  # as the pass ran
                rec = self._recording(gen, mine, loss_reduction, scale)
            rec.rng = getattr(root, "rng", None)
            rec.autocast = getattr(root, "amp", None)
            rec.state = getattr(root, "state", None)
            window, hooks = self.watch.windows.get(gen, (0, []))  # the loss window's ops
            rec.trace = hash((getattr(root, "trace", 0), window))  # and hooks, with the
            # forward pass's: a term or a hook switched on later is checked again
            rec.hooks = [*getattr(root, "hooks", ()), *hooks]
            rec.signature = selfcheck.known(self.model, rec, check, extra=("optimizer",))
            rec.probe = None
            rec.padding = None  # a padded batch's check (collate_check.py)
            if rec.signature is not None and getattr(root, "swapped", None):
                raise UnsupportedLayerError(
                    f"the model's forward pass ran with parameters replaced by other tensors "
                    f"({', '.join(root.swapped[:3])}{' ...' if len(root.swapped) > 3 else ''}: "
                    f"torch.func.functional_call(model, {{name: tensor}}), or a "
                    f"reparametrisation outside torch.nn.utils.parametrize); the self-check "
                    f"re-runs model(x) on its own parameters, which is not the pass you ran (a "
                    f"raw autograd error until 2026-11-30). Make the substituted forward the "
                    f"private model (a module whose forward calls functional_call), use "
                    f"torch.nn.utils.parametrize, or pass verify=False")
            if rec.signature is not None:
                rec.halves = _inputs(root, rec.n)  # the model on each half: at the step's
                # checks, once the recording's memory is freed (optimizer._verify)
                rec.probe = selfcheck.probe_sketch(
                    rec, self.model, dot_loss_of(root), _inputs(root, rec.n),
                    root.backprops)  # g_i, as 3 numbers per parameter
                if rec.random and rec.rng is not None:  # for the record probe, after clipping
                    b = root.backprops
                    row = tuple(t[-1:].clone() for t in b) if isinstance(b, tuple) \
                        else b[-1:].clone()
                    rec.replay = (root.args, root.kwargs, row, getattr(root, "keys", None))
                rec.padding = self._padding_plan(root, rec.n)  # collate_check.py
            prepared.append((gen, mine, rec))
        if prepared and prepared[-1][2].state is not None:  # after the step's last pass:
            self._written_after(prepared[-1][2].state)  # the loop's (a later pass's are not)
        # .grad sums every backward pass since the last step: where one pass is checked
        # (a new signature), the path gradient of each is needed, known before any is clipped
        self.comparing = any(rec.signature is not None for _, _, rec in prepared)
        self.passes = len(prepared)
        for gen, mine, rec in prepared:
            f0 = _uniform(rec.factors)
            streamed, self._stream_paths = streamed_gradients(
                rec, gen, lambda g, f=rec.factors, n=rec.n, f0=f0: _rescaled(g, f, n, f0))
            yield rec, {**self._exact(rec, mine), **streamed}

    def _recording(self, gen: int, roots, loss_reduction: str, scale=None) -> Recording:
        b = roots[0].backprops
        t = b[0] if isinstance(b, tuple) else b
        n = t.shape[0] if t.dim() else 1
        f = self.watch.factors(gen, n)  # (n,) per-record factors of the loss (loss.py)
        if f is None:  # no loss seen: a mean-reduced loss scaled every b_i by 1/n
            f = torch.full((n,), float(n if loss_reduction == "mean" else 1), device=t.device)
        if scale is not None:  # a GradScaler's scale: out of every b_i
            f = f / scale.to(f.device, f.dtype)
        mine = [(path, layer, c) for path, layer in self.layers.items()
                for c in self.layer_rec.calls[path]  # as Recording.calls, and the streamed
                if (c.backprops is not None or c.sampled is not None) and c.generation == gen]
        feeds = loss_reach([e.node for r in roots for e in r.capture_edges()])
        memo: dict = {}  # one rescaled copy per tensor: calls often share one b (o = u + v)
        f0 = _uniform(f)  # one test (and host sync) per batch, not one per call
        calls = [c for _, _, c in mine if c.sampled is None] + list(roots)
        owned = sole_holders(calls)  # read by these calls only: rescaled in place (owned.py)
        for call in calls:
            call.backprops = _rescaled(call.backprops, f, n, f0, memo, owned)
        return new_recording(n, self.layers, self.layer_rec, self.params, self.uncovered,
                             mine, random=self.tracker.random, lowered=self.tracker.lowered,
                             generation=gen, factors=f,
                             feeds=feeds)

    def path_gradients(self, rec: Recording, exact: dict):
        """(id(param), Σ_i g_i) once per parameter, as the user's backward pass computed it
        (before the factors f_i): every gradient that flows through the model's output; each
        as soon as its last call is in, so the caller can compare it and let it go
        (``path_check.py``). Call before clipping (book-keeping frees the backprops)."""
        f = rec.factors
        c = torch.where(f != 0, 1 / torch.where(f != 0, f, 1), 0)  # (n,) undo f_i
        tapped = self.tapped_paths()
        plan = []
        for path, layer, call in rec.calls():
            if path in tapped:  # autograd computed no weight gradient there
                continue
            own = [p for _, p in rec.own(layer)]
            if own:
                plan.append((layer, call, own))
        exact = {key: g for key, g in exact.items()  # streamed from a tapped call: autograd
                 if not self._stream_paths.get(key, set()) & tapped}  # computed no .grad
        left = collections.Counter(id(p) for _, _, own in plan for p in own)
        left.update(iter(exact))  # contributions still to come, per parameter
        sums: dict = {}

        def done(keys):
            for key in keys:
                left[key] -= 1
                if left[key] == 0 and key in sums:
                    yield key, sums.pop(key)

        for layer, call, own in plan:
            for key, g in reweighted_weight_grads(layer, call, c, own).items():
                sums[key] = g if key not in sums else sums[key] + g
            yield from done(id(p) for p in own)
        with torch.no_grad():
            for key, g in exact.items():
                s = torch.tensordot(c.to(g.dtype), g, dims=1)
                sums[key] = s if key not in sums else sums[key] + s
                yield from done((key,))
        yield from sums.items()  # a parameter of a call that returned none for it

    def tapped_paths(self) -> set[str]:
        """The paths of the calls autograd computed no weight gradient for: the tapped layers
        (``skip_weights.py``) and the calls recorded inside their forward for a parameter
        they hand over (a layer scale ``x * lambda1`` in a rule-less leaf layer, Dinov2's
        ``LayerScale``: a ``BroadcastProduct`` whose ``owner`` was tapped, ``tied.py``)."""
        tapped = self.skipper.tapped
        if not tapped:
            return tapped
        return tapped | {path for path, layer in self.layers.items()
                         if layer.__dict__.get("owner") in tapped}

    def unchecked(self, rec: Recording) -> set[int]:
        """ids of fallback parameters of tapped layers: their exact g_i sums every use, the
        user's ``.grad`` only the uses outside the tapped calls, so they are not compared."""
        tapped = self.tapped_paths()
        return {id(p) for path in self.skipper.tapped for p in self.skipper.own[path]
                if id(p) in rec.fallback} | {key for key, paths in self._stream_paths.items()
                                             if paths & tapped and not paths <= tapped}

    def replay_probe(self, rec: Recording, args, kwargs, b_i, keys=None) -> dict:
        """Exact g_i of record n - 1 (``selfcheck.record_probe``): the batch again with the
        other records substituted and the random state of its forward pass replayed, then
        ⟨o_i, f_i b_i⟩ backpropagated (b_i: the loss's recorded gradient of that record)."""
        i = rec.n - 1

        def loss_of_record(out):
            return dot_loss(tuple(o[i:i + 1] for o in select(out, keys)), b_i).sum()

        with self.paused():
            return selfcheck.record_probe(rec, self.model, args, kwargs, loss_of_record)

    def _padding_plan(self, root, n: int):
        """The padded batch (``collate_check.Padded``) this model call's inputs came from, if
        its loader left one to check at this pass, with the rows of the loss's recorded
        gradient of the plan's records: ``padding_probe``'s arguments."""
        found = plan_for(getattr(self.watch, "padded", None), root.args, root.kwargs, n)
        if found is None:
            return None
        plan, paths = found
        b = root.backprops
        bs = b if isinstance(b, (tuple, list)) else (b,)
        rows = {i: tuple(t[i].clone() if isinstance(t, torch.Tensor) and t.dim()
                         and t.shape[0] == n else None for t in bs) for i, _, _ in plan.rows}
        return plan, root.args, root.kwargs, paths, rows, getattr(root, "keys", None)

    def padding_probe(self, rec: Recording) -> None:
        """Refuse a padded batch whose records' gradients depend on the padding
        (``collate_check.padding_probe``)."""
        plan, args, kwargs, paths, rows, keys = rec.padding
        rec.padding = None
        with self.paused():
            padding_probe(rec, self.model, plan, args, kwargs, paths, rows, keys)

    def _written_after(self, log) -> None:
        """Warn, once per buffer, that the loop wrote the model's state between the forward
        pass and ``step()``: legitimate for a counter, but a running loss or a statistic of
        the outputs or labels kept there (``model.loss_avg.mul_(0.9).add_(0.1 * loss)``) is a
        function of the records in the released model, un-noised. No taint follows the loop
        after the forward pass, so this cannot tell the two apart (the forward pass's own
        writes from the batch are refused: ``checks.state_written_from_batch``)."""
        for name in log.written_after():
            if name in self._warned_after:
                continue
            self._warned_after.add(name)
            warnings.warn(
                f"the model's {name!r} was written in place between the forward pass and "
                f"optimizer.step() (in the loop or in a backward hook). If its value comes "
                f"from the batch (a running loss, a statistic of the outputs or labels), it is "
                f"a function of the records kept in the model that DP-SGD releases, with no "
                f"clipping and no noise, outside the (epsilon, delta) the accountant reports: "
                f"keep such statistics outside the model (a Python variable), or compute them "
                f"from public data", stacklevel=7)

    def _exact(self, rec: Recording, roots) -> dict:
        names = rec.fallback_names()
        if not names or rec.n == 0:
            return {}
        served = served_gradients(rec)  # computed from parameters alone (derived.py)
        names = [name for name in names if id(self.params[name]) not in served]
        if not names:
            return served
        self._fallback_seen = True  # the next passes' state is fingerprinted (PassLog)
        reasons = sorted({why for key, why in rec.fallback.items() if key not in served})
        root = roots[0]
        problem = batch_problem(self.model, root, rec.n, proved=False) if len(roots) == 1 else None
        if len(roots) != 1 or problem:
            raise UnsupportedLayerError(
                f"{', '.join(names)} need the exact whole-model fallback ({'; '.join(reasons)})"
                f", which needs one call model(...) per backward pass with the batch on "
                f"dim 0 of every tensor input and output; this backward pass had "
                f"{len(roots)} model call(s){f', and the model {problem}' if problem else ''}"
                f". Restructure the forward pass, or compute per-sample gradients with "
                f"wb.clipped_grad_sum(model, loss_fn, x, y, C, method=...)")
        replay = (rec.rng, rec.device) if rec.random and rec.rng is not None else None
        with precision.replayed(rec.autocast, rec.device), state_replay.replayed(rec.state):
            grads = exact_per_sample_gradients(self.model, dot_loss_of(root),
                                               _inputs(root, rec.n), root.backprops, names,
                                               reasons, replay)
        return {**served, **{id(self.params[k]): g for k, g in grads.items()}}

    def drop_outside_grads(self) -> None:
        for p in self.outside:
            p.grad = None


_ROOT_WALK = ("modules", "named_modules", "parameters", "named_parameters", "_named_members")


def changes(model: nn.Module, before, after) -> str:
    """What differs between two ``structure`` readings, by name (``check_step``'s error)."""
    with torch._C.DisableTorchFunction():
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        modules = {id(m): n or "the model" for n, m in model.named_modules()}
    old, new = dict(before[1]), dict(after[1])

    def listed(ids, what):
        shown = [names.get(k, "a parameter no longer in the model") for k in ids][:3]
        return f"{what}: {', '.join(shown)}{' ...' if len(ids) > 3 else ''}"

    parts = []
    for ids, what in (([k for k in new if k not in old], "trainable since (unfrozen or added)"),
                      ([k for k in old if k not in new], "no longer trainable (frozen with "
                                                         "requires_grad_(False) or removed)"),
                      ([k for k in new if k in old and new[k] != old[k]], "resized in place "
                                                                           "(resize_token_"
                                                                           "embeddings)")):
        if ids:
            parts.append(listed(ids, what))
    added = [modules[k] for k in after[0] if k not in set(before[0]) and k in modules]
    if added:
        parts.append(f"modules added or replaced: {', '.join(added[:3])}"
                     f"{' ...' if len(added) > 3 else ''}")
    return "; ".join(parts) or "a layer replaced"


def structure(model: nn.Module) -> tuple[list[int], list[tuple]]:
    """``([id(m) for m in model.modules()], [(id(p), p.shape) for p in model.parameters() if
    p.requires_grad])``, read from each module's ``_modules`` and ``_parameters`` directly:
    checked every step (``check_step``), and ``named_modules`` builds every module's dotted
    name on the way. The same order and de-duplication (a shared module or parameter once, at
    its first place); where a class overrides the walk, the walk itself is asked."""
    mods, seen, params, seen_p = [], set(), [], set()
    todo = [model]  # depth first, children in order, marked when taken: modules()'s order
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        if type(m).named_modules is not nn.Module.named_modules or (m is model and any(
                getattr(type(m), k) is not getattr(nn.Module, k) for k in _ROOT_WALK)):
            return [id(m) for m in model.modules()], [
                (id(p), p.shape) for p in model.parameters() if p.requires_grad]
        seen.add(id(m))
        mods.append(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_p:
                seen_p.add(id(p))
                if p.requires_grad:
                    params.append((id(p), p.shape))  # resized in place (Hugging Face's
                    # resize_token_embeddings on a tied weight): the same parameter, changed
        todo.extend(c for c in reversed(m._modules.values()) if c is not None)
    return mods, params


def several_calls(roots) -> LossCouplingError:
    """One backward pass reached several calls of the model (``loss = f(model(x1)) +
    f(model(x2))``). Row i of each call would be taken for one record and clipped with the
    others' rows i: right only where the calls hold the same records (two views of each),
    and a record pair clipped as one where the batch was split in two (records i and
    n/2 + i: twice the sensitivity). Which one it is the data does not say, and neither the
    probe (it verifies the engine, not the pairing) nor the fallback can tell: refused."""
    sizes = ", ".join(str(tuple(_shape(c))[:1]) for c in roots)
    return LossCouplingError(
        f"one backward pass reached {len(roots)} calls of the private model (batch sizes "
        f"{sizes}): the optimizer would take row i of every call for one record and clip them "
        f"together, which is wrong when the calls hold different records (a batch split in "
        f"two: each pair of records would share one clip, doubling the sensitivity), and it "
        f"cannot tell that from two views of the same records. Call the model once per "
        f"backward pass. Two views of each record (augmentations, SimCLR-style pairs): stack "
        f"them per record, x = torch.stack([v1, v2], 1) of shape (n, 2, ...), and make the "
        f"private model a wrapper whose forward runs the network on x.flatten(0, 1) and "
        f"returns out.unflatten(0, x.shape[:2]): each record's views are then clipped as "
        f"one (neither gradient accumulation nor torch.cat over dim 0 does that: each would "
        f"clip every view as a record of its own, twice the sensitivity). Distinct records: "
        f"out = model(torch.cat([x1, x2])), the output split for the loss")


def _shape(call):
    shape, _, _ = call.outputs[0]
    return shape


def distributed_run(model) -> bool:
    """torch.distributed is on, or the model is wrapped: .grad is then all-reduced."""
    import torch.distributed as dist
    wrapped = isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
    return wrapped or (dist.is_available() and dist.is_initialized())


def refuse_repeated_batch(roots) -> None:
    """RecordCountError if a backward pass of a step ran the model on records an earlier
    pass of the step ran it on: the same tensors, or rows (two or more) that all equal rows
    of an earlier pass in the inputs *and* in the gradient the loss sent back to the model's
    output (the same records with the same labels: the batch again, permuted, or a part of
    it). Each pass clips its records, so a record backwarded twice adds 2 clip(g_i), an
    influence of 2 C (silent, without the engine's loader, until 2026-11-30; with it,
    ``LossWatch.count_records`` counts the rows). Records whose features repeat with other
    labels (padding rows, short texts, binary features) differ in that gradient: not
    refused (they were, by the inputs alone, in this session's first version). Compared only
    when a step has several passes."""
    if len({c.generation for c in roots}) < 2:
        return
    seen: dict = {}  # row key -> generation
    passes: list = []  # (generation, tensors)
    for call in roots:
        tensors = [t for t in call_leaves(call.args, call.kwargs) if isinstance(t, torch.Tensor)]
        rows = [t for t in tensors if t.dim() and t.shape[0]]
        if not rows:
            continue
        n = rows[0].shape[0]
        b = call.backprops if isinstance(call.backprops, tuple) else (call.backprops,)
        keys = _row_keys([*(t for t in rows if t.shape[0] == n),
                          *(_direction(t) for t in b if isinstance(t, torch.Tensor)
                            and t.dim() and t.shape[0] == n)], n)
        identical = any(gen != call.generation and len(other) == len(tensors)
                        and all(a is x for a, x in zip(tensors, other)) for gen, other in passes)
        if identical or (n >= 2 and all(k in seen and seen[k] != call.generation
                                        for k in keys)):
            raise RecordCountError(
                f"two backward passes of one step ran the model on the same records (all "
                f"{n} rows of a later pass equal rows of an earlier one, inputs and loss "
                f"alike: the same batch again, permuted, or part of it): each pass clips its "
                f"records, so each record backwarded twice adds two clipped gradients to the "
                f"step, an influence of 2 x max_grad_norm. Compute the batch's losses in one "
                f"forward pass and call backward once (loss = loss_a + loss_b), or call "
                f"step() after each backward")
        for k in keys:
            seen.setdefault(k, call.generation)
        passes.append((call.generation, tensors))


def _direction(b: torch.Tensor) -> torch.Tensor:
    """Each row's direction, to 4 digits: the loss's gradient at a record's output up to the
    pass's mean factor (1/n differs between passes of different n), so a record with the
    same features and another label (another gradient) is another record."""
    with torch.no_grad():
        rows = b.detach().reshape(b.shape[0], -1).double()
        unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-300)
        return torch.round(unit * 1e4).to(torch.int32)


def _row_keys(tensors, n: int) -> list:
    """One hashable key per row: the bytes of the row of every tensor (n rows each)."""
    with torch.no_grad():  # as bytes: any dtype (bfloat16 has no NumPy twin)
        flat = [t.detach().reshape(n, -1).contiguous().view(torch.uint8).cpu().numpy()
                for t in tensors]
        return [b"".join(f[i].tobytes() for f in flat) for i in range(n)]


def stray_passes(roots, layer_rec) -> list[str]:
    """Paths of recorded calls whose gradient came in a backward pass that never reached the
    model's output (a tensor the model kept aside, ``self.aux = self.head(h)``, backwarded on
    its own): that pass is no pass through the model the optimizer can read per record
    (0.82 off with verify=False, silently, until 2026-11-30)."""
    gens = {c.generation for c in roots}
    return sorted({path for path, calls in layer_rec.calls.items() for c in calls
                   if (c.backprops is not None or c.sampled is not None)
                   and c.generation not in gens})


def output_rows_problem(root) -> str | None:
    """Why the model's output does not hold one row per record on dim 0 (its n rows against
    the first input's), or None. The optimizer reads record i's gradient from row i of the
    output's gradient: a time-major (T, n, ...) output was read as T records, and the probe
    then blamed a loss_fn the user never passed (LossShapeError "shape (1,); got shape (2,)")
    until 2026-11-30; a flattened (n·T, ...) one failed in a record-alone re-run."""
    b = root.backprops
    got = [g for g in (b if isinstance(b, tuple) else (b,)) if isinstance(g, torch.Tensor)]
    if any(not g.dim() and bool(g.ne(0).any()) for g in got):
        return SCALAR_OUTPUT
    rows = {int(a.shape[0]) for a in call_leaves(root.args, root.kwargs)
            if isinstance(a, torch.Tensor) and a.dim()}  # any input may be the batch: a
    # conditioning time or mask of one row may come first
    t = next((g for g in got if g.dim() and rows and g.shape[0] not in rows
              and bool(g.ne(0).any())), None)  # an output the loss uses (others get zeros)
    if t is None:
        return None
    return (f"the private model's output has {t.shape[0]} rows on dim 0 (shape "
            f"{tuple(t.shape)}) but no input has that many (dim 0 of its inputs: "
            f"{sorted(rows)}): the optimizer reads record i's gradient from row i of the "
            f"output. Return the output batch-first, one row per record (a time-major "
            f"(T, n, ...) output transposed to (n, T, ...); tokens as (n, T, V), not flattened "
            f"to (n·T, V): flatten them in the loss)")


def _inputs(call, n: int):
    """The model call's inputs as the probe and the fallback take them: a ModelCall (only its
    tensors with n rows are sliced per record) unless it is one tensor; a second positional
    input without the batch (position ids of shape (1, T)) is passed whole, as by keyword."""
    if call.kwargs or len(call.args) > 1:
        return ModelCall(call.args, call.kwargs, n)
    return call.args if len(call.args) != 1 else call.args[0]


def _uniform(f: torch.Tensor) -> float | None:
    """f_0 when every f_i equals it (the usual mean or sum), else None."""
    if f.numel() and bool((f == f[0]).all()):
        return float(f[0])
    return None


_UNSET = object()


def _rescaled(b, f: torch.Tensor, n: int, f0=_UNSET, memo: dict | None = None,
              owned: set = frozenset()):
    """b (or a tuple of them) with record i's rows times f_i; one scalar when f is uniform.
    A tensor whose dim 0 is not n (not the batch: sent to the exact fallback) is unchanged
    unless f is uniform. ``f0``: ``_uniform(f)``, when the caller has it already. ``memo``
    ({id(b): (b, result)}): a tensor several calls share (the gradient of a sum reaches both
    addends as one tensor, e.g. an LSTM's input and recurrent projections) is rescaled once,
    not copied once per call. ``owned``: ids of tensors only the rescaled calls read
    (``owned.sole_holders``), multiplied in place: no second copy of b at the peak."""
    if b is None or f.numel() == 0:
        return b
    if f0 is _UNSET:
        f0 = _uniform(f)
    if isinstance(b, tuple):
        return tuple(_rescaled(t, f, n, f0, memo) for t in b)
    if memo is not None:
        if id(b) not in memo:
            memo[id(b)] = (b, _rescaled(b, f, n, f0, owned=owned))  # b kept: id stays unique
        return memo[id(b)][1]
    mul = torch.Tensor.mul_ if id(b) in owned else torch.mul  # same products either way
    if f0 is not None:
        return b if f0 == 1 else mul(b, f0)
    if b.dim() == 0 or b.shape[0] != n:
        return b
    return mul(b, f.to(b.dtype).view(-1, *[1] * (b.dim() - 1)))


__all__ = ["ROOT", "ModelRecorder", "distributed_run", "dot_loss"]
