"""Seeing the loss in the user's own loop: the criterion calls after the model's forward pass.

``DPOptimizer`` is handed no loss: the loop computes ``loss = criterion(model(x), y)`` and
calls ``loss.backward()``. Between the model's forward pass and the backward pass, while the
*window* is open, a global module hook (``torch.nn.modules.module.register_module_forward_
hook``, on only for that window) sees every outermost module call that is a loss: a
``torch.nn`` loss (``_Loss``), the ``criterion=`` given to ``make_private``, or any module
returning a scalar that requires grad. For each such call (``per_sample.loss``):

- its reduction must be the optimizer's ``loss_reduction`` (else ``ValueError``);
- the per-record factors f (Eq. 2 of ``loss.py``) that make record i's recorded gradient the
  gradient of its own loss (class weights, ``ignore_index``) are computed from the targets;
- the first call with a new signature (type, reduction, shapes with n symbolic) is probed
  at the next ``step()``, after the recorded activations are freed (``probe``): a loss
  coupling records raises ``LossCouplingError`` before anything is released.

A loss written as a plain function is seen too, by a ``TorchFunctionMode`` open for the same
window (``LossFunctions``):

- a functional loss of ``torch.nn.functional`` (``F.cross_entropy(out, y, weight=w)``,
  ``F.nll_loss``, ``F.mse_loss``, ...) called outside any module with its mean is treated as
  the equivalent ``nn`` loss module (the same reduction check, factors and probe); with
  ``reduction="sum"`` or ``"none"`` it is a term of a larger expression (``F.cross_entropy(o,
  y, reduction="sum") / n`` is a mean), so the loop's ``loss_reduction`` decides, as before;
- at ``loss.backward()``, before anything is computed, the loss is tested for coupling through
  the model's output o (``coupling``): for record i = n - 1 and a random v, the second
  derivative ∂⟨∂L/∂o_i, v⟩/∂o_j must vanish for every other record j. A contrastive (InfoNCE)
  loss, logits centred over the batch or any batch statistic of the outputs fails it, and
  ``LossCouplingError`` is raised before the backward pass runs. Only the loss's own part of
  the graph (from L down to o) is differentiated twice; the model is not re-run. Once per
  output signature (shapes with n symbolic), when the optimizer verifies. A loss whose ops
  show it to be a sum of per-record terms (``F.cross_entropy`` over the logits' rows, a mean
  over positions, a weighted sum of such terms) is not differentiated twice: the second
  derivative across records is 0 by construction (``loss_rows.py``), and the first step does
  not hold the test's logit-sized tensors beside the activations.

Before the window: from the moment the engine's loader hands out a batch to the model's
forward pass, a second ``TorchFunctionMode`` (``BeforeForward``) follows the same batch
statistics (``loss_terms.py``) in the user's code, so a normalisation computed from the
batch's labels *before* the forward pass (a Trainer's ``num_items_in_batch``, an inverse
class frequency, a mask count) is carried into the window and refused at ``backward`` like
one computed after it; a model input computed from such a statistic (inputs centred or
scaled by the batch's mean or std) is refused when the forward pass begins. A loader the
engine does not own (``poisson_sampling=False`` keeps the user's, or a loop over tensors) is
followed from the optimizer's boundary instead (created, ``zero_grad``, ``step``: ``follow``),
n named by the forward pass; a forward pass without gradient (evaluation) pauses it. The
window's lifetime (its step, a refusal, its model) is ``lifetime.py``'s.

Notation: n batch size, f (n,) per-record factors.
"""

import contextlib
import functools
import inspect
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.compiler import is_compiling
from torch.nn.modules import module as module_hooks
from torch.nn.modules.loss import _Loss
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from workbench.dpsgd.backward_calls import ENTRY_POINTS, backward_call, objective
from workbench.dpsgd.batches import batch_size
from workbench.dpsgd.lifetime import Weak, push_bottom, reaches, sweep, weak_attribute
from workbench.dpsgd.lifetime import remove as _remove
from workbench.dpsgd.loss_rows import LossRows, opaque
from workbench.dpsgd.loss_terms import (
    LEFT_TORCH,
    BatchStatistics,
    follow_host,
    left_torch_message,
    statistic_error,
)
from workbench.dpsgd.model_loss import name_of
from workbench.dpsgd.record_reduction import COUNT_READS, RecordReduction, count_read
from workbench.dpsgd.row_mixing import Earlier
from workbench.errors import LoopError, LossCouplingError, RecordCountError
from workbench.per_sample import precision
from workbench.per_sample.derived import graph_nodes
from workbench.per_sample.loss import DENOMINATOR, check_separable, record_factors, reduction_of
from workbench.per_sample.selfcheck import symbolic
from workbench.per_sample.uses import HOOKS, gated_off

ATTRIBUTE_OPS = BatchStatistics.ATTRIBUTES
"""Attributes that are ops to the batch statistics (``loss_terms.BatchStatistics.after``)."""


class LossWatch:
    """The loss calls of each backward pass (``generation``): (generation, f, name). One
    window is open at a time, process-wide: the last model's forward pass owns the loss.
    The window never outlives its step or its model (``lifetime``)."""

    _open = staticmethod(lambda: None)  # weak: a garbage-collected engine's window closes

    def __init__(self, loss_reduction: str, criterion=None):
        self.loss_reduction, self.criterion = loss_reduction, criterion
        self.calls: list[tuple[int, torch.Tensor, str]] = []
        self.checked: set = set()  # loss signatures already probed
        self.pending: list = []  # (key, criterion, z, rest, n, reduction): probed at step
        self.check = True  # the optimizer's verify policy: False skips the probe
        self.n, self.generation, self._depth, self._busy = 0, 0, 0, False
        self._stack: list[tuple[bool, int, str]] = []  # the window's open module calls:
        # (torch's own loss class, len(calls) at entry, its class name): ``_exit``
        self._handles: list = []
        self.outputs: list = []  # the model's output tensors of the open window
        self.rows: LossRows | None = None  # the loss's row proof (loss_rows.py)
        self._mode = None  # LossFunctions, on the TorchFunctionMode stack while the window is open
        self.earlier = Earlier()  # the records' tensors of earlier batches (row_mixing.py)
        self.stats = BatchStatistics(earlier=self.earlier)  # batch statistics of the data in
        # the loss (loss_terms)
        self.scale = RecordReduction()  # sum or mean over the records (record_reduction.py)
        self.model_losses = None  # model_loss.ModelLosses: scalars the model computed
        self.announced = None  # n of the batch the engine's loader handed out, until its step
        self.owned = False  # the engine made the loader: every step takes one of its batches
        self.loss = lambda: None  # weak: the window's latest tensor with gradient (the loss
        # a zero_grad() before its backward pass keeps the forward pass for: ``loss_alive``)
        self.steps_checked = 0  # steps that took one (``check_handed``)
        self.shuffled = False  # the user's shuffled loader announces (``watch_loader``):
        # several of its batches may go into one step
        self.serial = 0  # batches the engine's loader handed out so far
        self.used: dict[int, int] = {}  # serial -> n of each such batch a training forward
        # pass ran on since the last step (``count_records``)
        self.stepped = 0  # the last serial a step() was taken for (``batch_ends``)
        self.backwarded: set[int] = set()  # serials of handed-out batches a backward pass
        # ran on since the last step or zero_grad(): their gradients wait for a step
        self.on_skipped = lambda: None  # a handed-out batch had no step (the optimizer's)
        self.prefetch = 0  # the engine loader's num_workers: its sampler runs ahead
        self.chunked = False  # the engine's loader hands out chunks (max_physical_batch_size)
        self.passing = False  # a pass of the engine's loader is in progress (``watched``)
        self.before = BatchStatistics(before=True, earlier=self.earlier)  # the same, from
        # the loader's batch to the forward pass
        self._before_mode = None  # BeforeForward, on the stack while ``before`` follows calls
        self.paused = contextlib.nullcontext  # the recorder's pause (recorded.py sets it)
        self.before_backward = lambda: None  # the recorder's gradient hooks moved last
        self.after_backward = lambda: None  # the recorder marks each .grad as the pass left
        # it (path_check.py: an edit before the step is named)
        self.inside = lambda: ({}, {})  # () -> the outputs of the recorded layer calls and
        # of the model's calls awaiting their backward pass (the recorder's ``_awaiting``)
        self.roots: list = []  # the model's outputs with gradient: a loss must read them
        self.second_order: list = []  # weak references to torch.autograd.grad results with
        # create_graph=True from this window's outputs (backward_calls.py)
        self.parameter_ids: set[int] = set()  # the model's trainable parameters (recorded.py):
        # a backward pass into none of them is no pass of the step (backward_calls.py)
        self._resume = False  # following paused by a forward pass without gradient
        self.parameter_names: dict[int, str] = {}  # every parameter of the model, by id
        # (recorded.py): a trainable leaf the loss reaches that is none of them is refused
        self.trace = 0  # the window's ops with gradient, by name in order (``traced``)
        self.hooks: list[str] = []  # gradient hooks the window registered (``traced``)
        self.windows: dict[int, tuple] = {}  # generation -> (trace, hooks) of its backward
        self.replaced: list = []  # weak references to the outputs of the forward passes a
        # later pass replaced in the window since the last step (``_backward``)
        self.input_ids: set[int] = set()  # the model's inputs of the pass (``outside``)
        self.modules: list = []  # weak references to the window's outermost module calls
        self.count_reads: set[int] = set()  # counts the loop read off tensors since the
        # batch was handed out or the last step (len(x), x.shape[0]): record_reduction's
        # ``realised`` factors
        self.expected = lambda: None  # the optimizer's expected batch size B (optimizer.py)
        weakref.finalize(self, _remove, self._handles_box)

    def open(self, n: int, generation: int, outputs=(), rows_of=None,
             hooked: bool = True) -> None:
        """At the end of the model's forward pass (n records, before backward ``generation``);
        ``outputs``: the model's output tensors, for the coupling test at ``backward``;
        ``rows_of``: the forward pass's row tags (``FlatRows.full``), which start the loss's
        row proof (``loss_rows.py``); ``hooked``: the pass registered gradient hooks."""
        if self.roots and not any(isinstance(o, torch.Tensor) and o.requires_grad
                                  for o in outputs):
            self.before.reset(0)  # a pass without gradient (an evaluation) between a training
            return  # pass and its loss: the training window stays, and its loss is checked
            # on that pass's outputs (it replaced them, and a loss centring the logits over
            # the batch went unchecked until 2026-12-01: probe X's P1)
        self.n, self.generation, self._depth, self._stack = n, generation, 0, []
        self.trace, self.hooks, self.modules = 0, [], []
        if torch.is_grad_enabled():  # (a pass without gradient between: the loss stays)
            self.loss = lambda: None
        self.model_losses = None
        last = LossWatch._open()
        if last is not None and last is not self:
            last.close()
        sweep()
        LossWatch._open = weakref.ref(self)
        if not self._handles:  # the global hooks hold the watch weakly and run quietly
            self._handles.extend([  # (lifetime.Weak): their tensor calls are not the loop's
                module_hooks.register_module_forward_pre_hook(Weak(self, "_enter")),
                module_hooks.register_module_forward_hook(Weak(self, "_exit"))])
        self.roots = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        self.earlier.outputs(self.roots)  # of the batch the pass ran on
        self.outputs = [o for o in self.roots if o.dim() and o.shape[0] == n]
        self.stats.reset(n if self.check else 0, self.outputs)
        self.rows = LossRows([(o, rows_of(o)) for o in self.outputs]) if (
            self.check and rows_of is not None and not hooked) else None
        stats = self.stats
        self.scale.reset(n if self.check else 0, lambda t: stats._has(stats.derived, t),
                         self.loss_reduction)
        self.scale.moved = lambda t: stats.order.moved_dim0(t)
        self.scale.reads, self.scale.expected = self.count_reads, self.expected()
        self.scale.records = {n, *self.used.values()} | (
            {self.announced} if self.announced is not None else set())
        if n == 1 and self.check and max(self.scale.records) >= 2:  # a chunk of one record
            self.scale.on = True  # of a larger batch: its factor n_c / n is still followed
        self.stats.inherit(self.before)  # statistics computed before the forward pass
        self.before.reset(0)
        if self._mode is None:
            self._mode = LossFunctions(self)
            push_bottom(self._mode)

    @property
    def _handles(self) -> list:
        return self._handles_box

    @_handles.setter
    def _handles(self, value) -> None:
        if "_handles_box" not in self.__dict__:
            self._handles_box = []
        self._handles_box[:] = value

    def batch_begins(self, n: int) -> None:
        """The engine's loader hands out a batch of n records: follow batch statistics of its
        data until the model's forward pass (``forward_begins``)."""
        self.batch_ends()
        self.count_reads.clear()
        self.announced = n  # an empty batch may step without a forward pass (recorded.py)
        self.serial += 1
        self._follow(n)

    def follow(self) -> None:
        """The optimizer's boundary (created, ``zero_grad``, ``step``): follow batch
        statistics until the model's forward pass, n not known yet (any loader, or none);
        a batch the engine's loader announced is followed already."""
        if self._before_mode is None:
            self._follow(None)

    @contextlib.contextmanager
    def unfollowed(self):
        """The workbench's own tensor calls between steps (the wrapped optimizer's
        ``zero_grad`` on ``.grad``): not the batch's data, so the follower skips their
        book-keeping (``BatchStatistics.after``, the cost of every op it follows)."""
        on, self.before.on = self.before.on, False
        try:
            yield
        finally:
            self.before.on = on

    def _follow(self, n: int | None) -> None:
        if BeforeForward.following is not None:  # another engine's abandoned batch
            _leave(BeforeForward.following)
        sweep()
        self._resume = False
        self.before.reset(n if self.check else 0)
        if self.before.on:
            self._before_mode = BeforeForward.following = BeforeForward(self.before,
                                                                        self.count_reads)
            push_bottom(self._before_mode)

    def forward_begins(self, inputs) -> None:
        """The model's forward pass begins: stop following; a model input computed from a
        batch statistic couples the records inside the model (LossCouplingError). A pass
        without gradient (evaluation) only pauses the following (``forward_ends``)."""
        following = self._before_mode is not None
        self._stop_before()
        if not torch.is_grad_enabled():
            self._resume = following
            return
        if self.announced is not None:  # a training pass on the loader's latest batch
            self.used[self.serial] = self.announced
        self.input_ids = {id(t) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
        self.earlier.fed(inputs)  # its inputs: an earlier batch's from the next on
        first = next((t for t in tree_flatten(inputs)[0]
                      if isinstance(t, torch.Tensor) and t.dim()), None)
        if first is not None:
            self.before.settle(int(first.shape[0]), first.shape)
        what = next((w for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)
                     for w in [self.before.statistic(t)] if w), None)
        if what is not None and LEFT_TORCH in what:
            self.before.reset(0)
            raise LossCouplingError(left_torch_message(what, "the model's input"))
        if what is not None:
            self.before.reset(0)
            raise LossCouplingError(
                f"the model's input depends on {what} (a statistic of the whole batch, "
                f"computed before the forward pass): e.g. inputs centred or scaled by the "
                f"batch's own mean, std or max. Every record's input then depends on the "
                f"other records, so removing one record moves every other record's gradient "
                f"and the sensitivity is no longer max_grad_norm. Normalise with constants of "
                f"the data set (computed once, before training, or privately) or per record "
                f"(over its own features: dim >= 1)")
        rows = next(((t, r) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)
                     for r in [self.before.order.one_row(t)] if r), None)
        if rows is not None:
            self.before.reset(0)
            (t, (why, k)) = rows
            why = (f"{why}. Each row is clipped as a record of its own, so that record's "
                   f"influence on the step is {k} x max_grad_norm, not max_grad_norm, although "
                   f"there are no more rows than records") if k > 1 else why
            if k == 0:  # (the records moved off dim 0)
                raise RecordCountError(
                    f"the model's input {tuple(t.shape)} is not one row per record the loader "
                    f"drew: {why}. Keep the records on dim 0 of every model input: pass the "
                    f"batch as the loader hands it out (batch_first=True for nn.LSTM, nn.GRU, "
                    f"nn.Transformer and pad_sequence), and transpose inside the model's "
                    f"forward if its layers want time first")
            raise RecordCountError(
                f"the model's input {tuple(t.shape)} is not one row per record the loader "
                f"drew: {why}. Give each record one row: augment inside a Dataset transform "
                f"(each record one augmented row per draw); for several views of a record, "
                f"stack them along dim 1 and average them inside the model, or make the unit "
                f"the user (privacy_unit=\"user\", user-level DP); sample with the engine's "
                f"Poisson loader instead of resampling or repeating the batch; pack sequences "
                f"inside the Dataset, so a row never straddles two records"
                + ("" if k > 1 else "; a fixed record for every step belongs in the model "
                   "(a buffer) or in public data, not taken from the training set"))

    def forward_ends(self) -> None:
        """A forward pass without gradient ended: the following it paused goes on."""
        if self._resume and self._before_mode is None and self.before.on:
            self._before_mode = BeforeForward.following = BeforeForward(self.before,
                                                                        self.count_reads)
            push_bottom(self._before_mode)
        self._resume = False

    def drop_used(self) -> None:
        """``zero_grad()`` drops the passes since the last step: an earlier loader batch
        whose backward pass it drops, with no step taken for it, is reported
        (``on_skipped``), once; the batch still out is reported when the loader moves on
        (``batch_ends``). A forward pass alone (a validation batch through the private
        model with grad on) reports nothing: it was charged twice, its own step's and this,
        in this session's first version."""
        current = self.serial if self.announced is not None else None
        dropped = sorted(s for s in self.backwarded if s > self.stepped and s != current)
        self.used, self.backwarded = {}, set()
        for serial in dropped:
            self.stepped = max(self.stepped, serial)
            if not self.shuffled:  # (a shuffled pass is charged whole: the bracket's passes)
                self.on_skipped()

    def count_records(self, rows: int) -> None:
        """At ``step()``: ``rows``, the rows its backward passes clipped as records (Σ n),
        against the records the engine's loader handed out for it. DP-SGD's sensitivity C
        holds when each sampled record is one row of one pass; the step refuses
        (``RecordCountError``) the rows of two loader batches (gradient accumulation over
        Poisson batches: a record drawn in both counts twice, and the accountant charges one
        step at q) and more rows than the batch held (the batch forwarded twice, a record's
        augmented views concatenated along dim 0, a record reshaped into several rows before
        the model: each clipped as a record, one record's influence up to k C). Fewer rows
        (records filtered out) are harmless. Without the engine's loader nothing is known."""
        self.count_reads.clear()
        used = {s: n for s, n in self.used.items() if s in self.backwarded}  # a batch only
        # forwarded (then skipped) is in no step: counted as one, it made the next step
        # "accumulate two batches" until 2026-11-30
        self.used, self.backwarded = {}, set()
        if self.announced is not None:  # this step is the handed-out batch's, empty or not
            self.stepped = self.serial
        if len(used) > 1 and self.chunked:
            raise RecordCountError(
                f"one step() took the gradients of {len(used)} chunks the private loader "
                f"handed out: with max_physical_batch_size the loader hands out each logical "
                f"batch in chunks, and the optimizer needs step() after every chunk (it adds "
                f"a logical batch's chunks up and releases them once, with the noise, at its "
                f"last chunk). Call optimizer.step() (and zero_grad()) after each chunk's "
                f"backward pass")
        if len(used) > 1 and not self.shuffled:
            raise RecordCountError(
                f"one step() took the gradients of {len(used)} batches the private loader "
                f"handed out (gradient accumulation over loader batches): each is a Poisson "
                f"sample of its own, so a record drawn in two of them counts twice (influence "
                f"2 x max_grad_norm), and the accountant charges one step at q for a step over "
                f"{len(used)} samples. Call step() after every batch, or, to bound memory, pass "
                f"max_physical_batch_size to make_private: it splits each logical batch into "
                f"chunks that the optimizer accumulates into one noisy step")
        if used and rows > sum(used.values()):
            raise RecordCountError(
                f"the step's backward passes clipped {rows} rows as records, but the private "
                f"loader handed out {sum(used.values())} records for it: each row is clipped "
                f"as a record of its own, so a record behind several rows (the batch forwarded "
                f"twice, a record's augmented views concatenated along dim 0, a record "
                f"reshaped into several rows before the model) has an influence of several "
                f"times max_grad_norm. Forward each record once; keep a record's views in "
                f"that record (stack them along dim 1 and average their losses inside it)")

    def batch_ends(self, report: bool = True, last: bool = False) -> None:
        """The loader's pass ended (or was abandoned): nothing more to follow. A batch it
        handed out that no step() was taken for (the loop skipped it: ``continue`` on an
        empty batch, on a loss above a threshold; or left the pass) is reported to the
        optimizer (``on_skipped``), which charges the accountant for it: the batch was
        sampled, and whether its step was taken may depend on its records. ``report=False``:
        a step that raised (its batch refused, not skipped by the loop), a detach; ``last``:
        the loader's pass is over, no step will come for a batch still waiting."""
        if self.announced is not None and self.serial > self.stepped \
                and (last or self.serial not in self.backwarded):  # its gradients wait for
            # a step, unless the loader's pass is over (``last``: a backward then a break or
            # continue on the run's last batch escaped the charge until 2026-11-30)
            self.stepped = self.serial
            if report and not self.shuffled:  # (the bracket charges a shuffled pass whole)
                self.on_skipped()
        self.announced = None
        self._stop_before()
        self.before.reset(0)

    def loss_alive(self) -> bool:
        """The open window computed a tensor with gradient the loop still holds (``loss =
        crit(model(x), y)`` before ``zero_grad()``, or the records' losses); a forward pass
        left without one (its output dropped) is abandoned."""
        return self.loss() is not None  # (a pass without gradient between closes the
        # window, not the loss's pass: it still awaits its backward)

    def check_handed(self) -> None:
        """At ``step()``, with a loader the engine made (``owned``): a batch of it was handed
        out for this step (the loop may draw its batches ahead: ``list(loader)``; never
        fewer batches than steps). A loop over the data_loader given to ``make_private``
        instead of the one returned stepped on fixed-size shuffled batches that the
        accountant charged as Poisson samples (ε understated by half, silently, until
        2026-11-30)."""
        if self.owned and self.serial <= self.steps_checked:
            raise LoopError(
                "step() with no batch of the loader make_private returned since the last step: "
                "the loop iterates another loader (the data_loader given to make_private, whose "
                "fixed-size shuffled batches the accountant, charging Poisson samples at rate "
                "q, does not describe: the epsilon would be understated), steps twice for one "
                "batch, or steps after the loader's pass ended. Iterate the loader that "
                "make_private returned (model, optimizer, loader = engine.make_private(...)) "
                "and call step() once per batch")
        self.steps_checked += 1

    def stop_following(self) -> None:
        """The optimizer's own work begins (``step``): what the follower saw since the last
        backward pass is no batch's (the step's finally follows afresh)."""
        self._stop_before()
        self.before.reset(0)

    def _stop_before(self) -> None:
        mode, self._before_mode = self._before_mode, None
        if mode is not None:
            _leave(mode)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.replaced = [r for r in self.replaced if r() is not None] + [
            weakref.ref(o) for o in self.roots]  # a later loss on them is refused (_backward)
        self.outputs, self.roots, self.rows = [], [], None
        self.model_losses = None
        self.stats.reset(0)
        self.scale.reset(0)
        self._close_mode()
        if LossWatch._open() is self:
            LossWatch._open = staticmethod(lambda: None)

    def _close_mode(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.watch = None  # from now on a pass-through, wherever it sits on the stack
        _leave(mode)

    def _loss_call(self, module, z, rest, functional: bool = False) -> None:
        """One loss call of the loop (a module, or a functional loss seen as one)."""
        if not isinstance(z, torch.Tensor) or not z.requires_grad or not z.dim() \
                or not reaches(z, self.roots):  # not this model's loss: not its window's
            return
        self._busy = True  # the probe calls the criterion again: not a loss call of the loop
        try:
            if functional and getattr(module, "reduction", "mean") in ("sum", "none"):
                # a summed or per-element term inside a larger expression (often divided by
                # n afterwards): no denominator of its own, so the loop's reduction decides
                f = torch.full((self.n,), float(self.n if self.loss_reduction == "mean" else 1),
                               dtype=torch.float64, device=z.device)
            else:
                f = self._factors(module, z, rest)
            name = type(module).__name__
            outer = next((mine for known, _, mine in self._stack if not known), name)
            self.calls.append((self.generation, f, name if outer == name else
                               f"{outer}: {name}"))  # (a user's criterion around it)
        except Exception:
            self.close()  # the refused pass's window ends with it
            raise
        finally:
            self._busy = False

    def statistics(self, loss) -> None:
        """Before ``loss.backward()``: LossCouplingError if the loss divides, multiplies or
        shifts by a statistic of the batch's data (``loss_terms.py``); then the window stops
        following calls (what runs after backward is the engine's)."""
        what = self.stats.statistic(loss)
        branched = self.stats.branch()
        self.stats.stop()
        error = statistic_error(what, branched)
        if error is not None:
            raise error

    def internal(self, loss) -> None:
        """Before ``loss.backward()``: LoopError if the loss reaches a recorded layer's output
        other than through the model's outputs (a feature the model keeps aside,
        ``self.feat = z`` read by a term ``((feat - feat.mean(0)) ** 2).sum()``; a layer called
        outside forward, ``model.head(model(x))``). Each record's gradient through it is its
        own only if that term is a sum of per-record terms, which the loss window checks on
        the model's outputs alone: a term on ``feat`` mixing the records passed silently
        (1.07x the step's own gradient) from the second step on, until 2026-11-30. The walk
        from the loss stops at the outputs: a few nodes for an ordinary loss."""
        inside, nodes = self.inside()[0], self._loss_nodes(loss)
        reached = sorted({inside[id(node)][1] for node in nodes if id(node) in inside})
        if not reached:  # (a walk into the model's layers meets the workbench's own leaves)
            self.outside(nodes)
        if reached:
            raise LoopError(
                f"the loss reads the output of {', '.join(map(repr, reached[:3]))}"
                f"{' ...' if len(reached) > 3 else ''} other than through the private model's "
                f"outputs: a tensor the model keeps aside (self.feat = z, self.aux = "
                f"self.head(h)) or a layer called outside forward (model.head(model(x))). The "
                f"optimizer checks how the loss combines the records on the model's outputs "
                f"only, so a term on such a tensor could couple them unseen. Return every "
                f"tensor the loss uses from forward() (a tuple or dict of outputs), with every "
                f"layer the loss goes through called inside it")

    def _loss_nodes(self, loss) -> list:
        """The nodes of the loss's own part of the graph, from the loss down to the model's
        outputs (every model call's: a loss over two calls is refused at the step by name)."""
        stops = {id(t.grad_fn) for t in self.roots if t.grad_fn is not None} | set(
            self.inside()[1])
        return list(graph_nodes([loss], stops))

    def outside(self, nodes) -> None:
        """Before ``loss.backward()``, on the nodes of the loss's own part of the graph (from
        the loss down to the model's outputs): the leaves with gradient it reaches there.
        The private model's parameters read by the loss directly (an L2 penalty, ``out /
        model.temp``) are named in the window's trace, so a term switched on at a later step
        is a new signature, whose ``.grad`` check refuses it (``path_check.py``: dropped from
        the release, silently, until 2026-11-30); any other trainable tensor (a second
        model's parameters, a learnable temperature kept outside the model, a teacher run
        with gradient) is refused: backward would hand it the batch's unclipped, unnoised
        gradient (a second model trained on it by its own optimizer passed silently until
        2026-11-30; ``loop.check_inputs_private`` is the same rule on the input side)."""
        private, foreign = [], []
        names = self.parameter_names
        with torch._C.DisableTorchFunction():
            for node in nodes:
                var = getattr(node, "variable", None)  # AccumulateGrad's leaf
                if var is None:
                    continue
                if id(var) in names:
                    private.append(names[id(var)])
                elif id(var) not in self.input_ids and not any(var is r for r in self.roots) \
                        and not getattr(var, "workbench_own", False):  # skip_weights' tap
                    foreign.append(var)
            if private:
                self.trace = hash((self.trace, "parameters", tuple(sorted(private))))
            if not foreign:
                return
            found = ", ".join(self._leaf_name(v) for v in foreign[:4])
        raise LoopError(
            f"the loss's gradient reaches {found}{' ...' if len(foreign) > 4 else ''}: "
            f"trainable tensors (requires_grad=True) outside the private model, such as a "
            f"second model's output or loss added to the private model's (F.cross_entropy("
            f"model(x) + aux(x), y)), a learnable temperature or scale kept outside it, or a "
            f"teacher run with gradient. backward() would give them the batch's unclipped, "
            f"unnoised gradient: an optimizer stepping on it trains them on every record "
            f"without privacy, and what they add to the loss carries that into the private "
            f"model's later gradients. Put them inside the module given to make_private (one "
            f"nn.Module holding both, its parameters in the DP optimizer), or take them out "
            f"of the gradient: detach their output (aux(x).detach()), run a teacher under "
            f"torch.no_grad(), or freeze them (requires_grad_(False))")

    def _leaf_name(self, var) -> str:
        """A module's parameter as ``Linear.weight (shape (3, 6))`` when a module the window
        called holds it; else its kind and shape."""
        shape = f"shape {tuple(var.shape)}"
        for ref in self.modules:
            module = ref()
            if module is None:
                continue
            for name, p in module.named_parameters():
                if p is var:
                    return f"{type(module).__name__}.{name} ({shape})"
        kind = "an nn.Parameter" if isinstance(var, nn.Parameter) else "a tensor"
        return f"{kind} of {shape}"

    def traced(self, name: str, args, kwargs, out) -> None:
        """One op of the window: its name in the trace if it computes with gradient (or sets a
        gradient hook, or reads a node to set one on), with whether it takes a factor of 0
        (``uses.gated_off``). Part of the recording's signature (``recorded.py``): a loss
        term or a hook switched on at a later step is checked again."""
        hook = name in HOOKS or name == "grad_fn"
        if not hook:
            if not torch.is_grad_enabled():
                return
            if isinstance(out, torch.Tensor):
                if not out.requires_grad:
                    return
            elif not (isinstance(out, (tuple, list)) and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in out)):
                return
        self.trace = hash((self.trace, name, gated_off(name, args, kwargs)))
        if hook:
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            what = "a .grad_fn read (its node's hooks)" if name == "grad_fn" else name
            shape = "" if t is None else f" of shape {tuple(t.shape)}"
            self.hooks.append(f"{what} on a tensor{shape} after the model's forward pass")

    def attribute(self, loss) -> None:
        """Before ``loss.backward()``: each scalar the model computed inside its forward pass
        from its outputs that ``loss`` is computed from (``out.loss`` of a Hugging Face
        model called with ``labels=``) is a loss call of this pass, if a functional loss
        returned it (``model_loss.py``); any other raises LossCouplingError."""
        losses = self.model_losses
        if losses is None:
            return
        key = losses.upstream_use(loss)
        if key is not None:
            raise LossCouplingError(
                f"the loss reads {name_of(key)}, a model output the model's other outputs are "
                f"computed from (e.g. a seq2seq model's encoder_last_hidden_state, or "
                f"hidden_states): the gradient recorded there would also hold what flows "
                f"through those outputs, and the engine's exact checks would count it twice. "
                f"Compute that term inside the model's forward pass (a wrapper module "
                f"returning it as an output of its own), or leave it out of the loss")
        for key, t in losses.used_by(loss):
            inner = losses.inner
            found = inner.call_of(t) if inner is not None else None
            if found is None:
                raise LossCouplingError(
                    f"the loss is computed from {name_of(key)}, a scalar the model computed "
                    f"inside its forward pass from its outputs, not returned by a loss "
                    f"function the engine knows (e.g. a loss divided by num_items_in_batch, "
                    f"or with an auxiliary term over the whole batch added): it cannot be "
                    f"split into one term per record, and a normalisation by the batch would "
                    f"couple the records. Call the model without labels= (or ignore "
                    f"{name_of(key)}) and compute the loss from its logits after the model, "
                    f"e.g. F.cross_entropy(logits.view(-1, V), labels.view(-1), "
                    f"ignore_index=-100), which the engine makes per-record exact")
            cls, options, z, y = found
            self._loss_call(cls(**options), z, () if y is None else (y,))

    def reduction(self, loss) -> None:
        """Before ``loss.backward()``: LossCouplingError if the loss sums its records' terms
        under ``loss_reduction="mean"``, averages them under "sum", or mixes the two
        (``record_reduction.py``)."""
        found = self.scale.check(loss, self.loss_reduction)
        self.scale.on = False
        if found is None:
            return
        kind, what = found
        declared = self.loss_reduction
        if kind == "coupled":
            seen = self._loss_names()
            raise LossCouplingError(
                f"the loss{seen} passed to backward is not a sum of one term per record: it "
                f"takes {what}, so whether and how much record i's term counts depends on "
                f"the other records (a top-k or max of the records' losses, a clamp or a "
                f"power of the batch's loss, outputs centred over the batch). Removing one "
                f"record would then move the others' "
                f"clipped gradients, so the sensitivity is no longer max_grad_norm (and the "
                f"second-derivative test cannot see a piecewise-linear coupling). Fix: apply "
                f"such a function to each record's own term before reducing "
                f"(F.cross_entropy(o, y, reduction='none').clamp(max=t).mean()), and reduce "
                f"the records only by a sum or a mean. A guard on the batch's loss "
                f"(torch.nan_to_num(loss), torch.where(loss.isfinite(), loss, 0)) zeroes every "
                f"record's gradient when one record's is not finite: the optimizer leaves a "
                f"non-finite record out by itself, so drop the guard")
        if kind == "scaled":
            raise LossCouplingError(
                f"the loss passed to backward is {what}: a factor computed from the realised "
                f"batch size (len(x), x.shape[0], x.size(0), y.numel() of this batch, of a "
                f"chunk of it, or its ratio to the expected batch size). With "
                f"loss_reduction={declared!r} the optimizer clips each record's gradient "
                f"as its own term times that factor, so removing one record changes n and "
                f"moves every other record's clipped contribution: the sensitivity is no "
                f"longer max_grad_norm. Fix: for gradient accumulation over chunks of one "
                f"batch, backward each chunk's own mean as it is (F.cross_entropy(model(xc), "
                f"yc), no n_c / n weight), or pass max_physical_batch_size to make_private "
                f"and let its virtual steps split the batch; for a sum rescaled by hand, use "
                f"the loss's mean with loss_reduction='mean', or its sum with "
                f"loss_reduction='sum'; put a constant factor into the learning rate. (The "
                f"factor is matched by value: if it is a constant that equals this count by "
                f"coincidence, write it into the learning rate instead)")
        if kind == "mixed":
            why = (f"adds terms that sum the records to terms that average them ({what}): "
                   f"no single factor makes every record's gradient its own")
            fix = ("normalise every term the same way (each a mean over the batch with "
                   "loss_reduction='mean', or each a sum with loss_reduction='sum')")
        elif kind == "sum":
            why = (f"sums the records' terms ({what}), but loss_reduction='mean': the engine "
                   f"multiplies each record's gradient by the batch size n to undo a mean "
                   f"that is not there")
            fix = ("divide the sum by the batch size (loss.sum() / n, or reduction='mean'), "
                   "or pass loss_reduction='sum' to make_private / DPOptimizer (then a "
                   "constant factor such as 1 / expected_batch_size is fine)")
        else:
            why = (f"averages the records' terms ({what}), but loss_reduction="
                   f"{declared!r}: each record's gradient keeps the factor 1 / n")
            fix = ("pass loss_reduction='mean' to make_private / DPOptimizer, or sum the "
                   "records' terms (reduction='sum')")
        raise LossCouplingError(
            f"the loss passed to backward {why}. Each record's clipped contribution would "
            f"then scale with the realised batch size n, a statistic of which other records "
            f"were sampled, so the sensitivity is no longer max_grad_norm. Fix: {fix}")

    def _loss_names(self) -> str:
        """" (CrossEntropyLoss, ...)": the loss calls of this window, for a message."""
        names = sorted({name for g_, _, name in self.calls if g_ == self.generation})
        return f" ({', '.join(names)})" if names else ""

    def second_order_use(self, loss) -> None:
        """Before ``loss.backward()``: LossCouplingError if the loss reads a gradient taken
        with ``create_graph=True`` from this window's outputs (``backward_calls.py``)."""
        found = [g for g in (ref() for ref in self.second_order) if g is not None]
        if not found or not reaches(loss, found, limit=None):  # the whole graph: a limit's
            return  # "yes" would refuse a large model's loss whenever such a gradient lives
        raise LossCouplingError(
            "the loss reads a gradient taken with torch.autograd.grad(..., create_graph=True) "
            "from the private model's outputs (a gradient penalty, an input-gradient "
            "regulariser, a physics-informed residual, a meta-learning step): the "
            "parameters' gradient then has second-order terms that no record's gradient at "
            "the model's outputs carries, so the optimizer would clip and release a gradient "
            "that is not the loss's. DP-SGD of such a loss needs each record's exact "
            "gradient: compute it with wb.per_sample_gradients(..., method='microbatch') and "
            "clip it yourself, or take the input gradient without create_graph=True (FGSM) "
            "and train on its detached result")

    def coupling(self, loss) -> None:
        """Before ``loss.backward()``: LossCouplingError if record i's ∂L/∂o_i moves with any
        other record's output (the second derivative test of the module docstring)."""
        outs, n = self.outputs, self.n
        if not (self.check and outs and n >= 2 and isinstance(loss, torch.Tensor)
                and loss.requires_grad):
            return
        key = ("backward", tuple(symbolic(o.shape, n) for o in outs), self.trace)  # a term
        # switched on later (the window's ops) is tested again
        if key in self.checked:
            return
        if self.rows is not None and not self.hooks and self.rows.proves(loss) and not \
                opaque(self._loss_nodes(loss)):  # a sum of per-record terms: the second
            self.checked.add(key)  # derivative across records is 0 by its ops (loss_rows.py)
            return
        try:
            with self.paused(), torch.enable_grad():  # the recording hooks must not see this
                g = torch.autograd.grad(loss, outs, create_graph=True, retain_graph=True,
                                        allow_unused=True)
                gen = torch.Generator().manual_seed(0)  # not the global RNG: the run's stays
                terms = [(gk[n - 1] * torch.randn(gk[n - 1].shape, generator=gen, dtype=gk.dtype)
                          .to(gk.device)).sum() for gk in g if gk is not None and gk.requires_grad]
                del g  # only row n - 1 is read: the rest of ∂L/∂o is not held through h
                if not terms:  # ∂L/∂o does not depend on o: nothing couples through o
                    self.checked.add(key)
                    return
                h = torch.autograd.grad(sum(terms), outs, retain_graph=True, allow_unused=True)
        except RuntimeError as err:  # an op without a second derivative, in a loss its ops
            raise LossCouplingError(  # did not prove a sum of per-record terms: unverified
                f"the loss{self._loss_names()} passed to backward could not be checked for "
                f"coupling between records: its ops do not prove it a sum of one term per "
                f"record (loss_rows.py follows loss functions, elementwise ops, softmaxes, "
                f"reductions, cdist to fixed points and a CTC loss), and the test that "
                f"measures whether record i's gradient depend on the other records' outputs "
                f"needs a second derivative that an op of the loss lacks ({err}). A term such "
                f"as torch.cdist(o, o) or F.pdist(o) between the records' outputs couples "
                f"them: removing one record would move every other record's clipped "
                f"gradient, so the sensitivity is no longer C. Fix: give each record a term "
                f"of its own outputs alone (distances to fixed prototypes, "
                f"torch.cdist(o, centres) with centres detached or constant); or write the "
                f"term with ops that have a second derivative (((a[:, None] - b[None]) ** 2)"
                f".sum(-1) for squared distances) so the test can measure it") from err
        own = others = 0.0
        for hk in h:
            if hk is not None:
                own += float(hk[n - 1].double().norm()) ** 2
                others += float(hk[:n - 1].double().norm()) ** 2
        tol = precision.tolerance_of(loss.dtype, loss.device)
        if others ** 0.5 > tol * max(own ** 0.5, 1e-12) + 1e-12:
            seen = self._loss_names()
            raise LossCouplingError(
                f"the loss{seen} computed after the model makes record {n - 1}'s gradient "
                f"depend on "
                f"the other records' outputs (its second derivative across records is "
                f"{others ** 0.5:.3g}, against {own ** 0.5:.3g} within the record): a "
                f"contrastive (InfoNCE) loss, logits centred over the batch, or a batch "
                f"statistic of the outputs. Removing one record would then move every other "
                f"record's clipped gradient, so the sensitivity is no longer C. Use a loss "
                f"that treats each record on its own (one term per record), or train with "
                f"user- or batch-level accounting that covers the coupling"
                + (f". The window registered gradient hooks ({'; '.join(self.hooks[:3])}): a "
                   f"hook combining the records' gradients (a mean or norm over dim 0) "
                   f"couples them too; apply it to each record's rows alone, or remove it"
                   if self.hooks else ""))
        self.checked.add(key)

    def clear(self) -> None:
        self.calls = []
        self.pending = []
        self.windows = {}
        self.replaced = []

    def _enter(self, module, args):
        if self._depth == 0 and len(self.modules) < 64:  # names a foreign leaf (outside)
            self.modules.append(weakref.ref(module))
        self._depth += 1
        self._stack.append((torch_loss(module), len(self.calls), type(module).__name__))

    def known_losses(self) -> int:
        """How many of torch's own loss modules are running now: a functional loss inside
        one is that module's own computation, counted once, as the module's call."""
        return sum(known for known, _, _ in self._stack)

    def _exit(self, module, args, output):
        """A module call ends. Its loss call counts if it is torch's own loss class (at any
        depth: inside a user's criterion too) outside any other, or the outermost module
        of the window in which no loss call was counted (a user's criterion written by
        hand). A user's criterion around torch's losses counts as those losses: its
        ``F.cross_entropy(o, y)`` divides by the non-ignored count, which the criterion's
        own uniform factors missed (probe AI, 2026-12-02: 0.14-0.27 of the step, silent)."""
        self._depth = max(self._depth - 1, 0)
        known, before, _ = self._stack.pop() if self._stack else (False, len(self.calls), "")
        if self._busy or not self._is_loss(module, output):
            return
        if known:
            if self.known_losses():  # (inside another of torch's losses)
                return
        elif self._depth or len(self.calls) > before:
            return
        self._loss_call(module, args[0] if args else None, args[1:])
        reduction = getattr(module, "reduction", None)
        self.scale.loss_call(type(module).__name__, reduction, output)
        if reduction in ("sum", "mean"):
            self.stats.loss_reduced(output, f"{type(module).__name__}(reduction={reduction!r})")

    def _is_loss(self, module, output) -> bool:
        if isinstance(module, _Loss) or module is self.criterion:
            return True
        return (isinstance(output, torch.Tensor) and output.dim() == 0 and output.requires_grad
                and not isinstance(module, nn.Sequential))

    def _factors(self, criterion, z, rest) -> torch.Tensor:
        n = self.n
        if getattr(criterion, "reduction", None) == "none":  # rows of the records' own
            # terms, reduced by the loop (``l.mean()`` over every row, ignored ones' zeros
            # included): the loop's reduction decides, as for a functional loss. The mean's
            # D / N_i was applied here (probe AI: 0.24-0.59 of the step, silent, with
            # ignored labels; class weights refused as a coupling)
            self._probe(criterion, z, rest, "sum")
            return torch.full((n,), float(n if self.loss_reduction == "mean" else 1),
                              dtype=torch.float64, device=z.device)
        reduction = reduction_of(criterion, self.loss_reduction)
        self._probe(criterion, z, rest, reduction)
        y = rest[0] if rest else None
        if reduction == "mean" and type(criterion) in DENOMINATOR and \
                self.stats.order.moved_dim0(z) and (criterion.weight is not None or (
                    isinstance(y, torch.Tensor) and not y.is_floating_point()
                    and bool((y == criterion.ignore_index).any()))):
            raise LossCouplingError(
                f"{type(criterion).__name__} with the mean over class weights or ignored "
                f"positions on rows that are not record-major (a {tuple(z.shape)} input "
                f"made by a transpose or permute of the outputs: time-major, "
                f"o.transpose(0, 1).reshape(-1, V)): the mean divides by the weights of the "
                f"whole batch, and the engine makes it exact per record only where it can "
                f"tell each record's rows (per_sample/loss.py Eq. 1), so record i's "
                f"gradient would be scaled by other records' counts. Fix: flatten "
                f"record-major (o.reshape(-1, V), y.reshape(-1), or classes on dim 1 with "
                f"F.cross_entropy(o.transpose(1, 2), y)), or use reduction='none' and "
                f"reduce each record's rows yourself")
        return record_factors(criterion, z.detach(), y, n, reduction)

    def _probe(self, criterion, z, rest, reduction: str) -> None:
        n = self.n
        shapes = tuple(symbolic(a.shape, n) for a in (z, *rest) if isinstance(a, torch.Tensor))
        key = (type(criterion), reduction, shapes)
        if self.check and key not in self.checked:
            self.pending.append((key, criterion, z.detach(), tuple(rest), n, reduction))

    def probe(self) -> None:
        """The separability probe (``loss.check_separable``) of each new loss signature."""
        pending, self.pending = self.pending, []
        for key, criterion, z, rest, n, reduction in pending:
            if key not in self.checked:
                check_separable(criterion, z, rest, n, reduction,
                                precision.tolerance_of(z.dtype, z.device))
                self.checked.add(key)

    def factors(self, generation: int, n: int) -> torch.Tensor | None:
        """f (n,) of one backward pass: the loss calls' own (they must agree), or None when
        no loss call was seen."""
        mine = [(f, name) for g, f, name in self.calls if g == generation and f.shape[0] == n]
        if not mine:
            return None
        f0, name0 = mine[0]
        for f, name in mine[1:]:
            if not torch.allclose(f.to(f0.dtype), f0, rtol=1e-5):
                raise LossCouplingError(
                    f"two losses of one backward pass ({name0} and {name}) normalise records "
                    f"differently (class weights or ignored positions), so the records' "
                    f"gradients cannot be rescaled to their own losses; use reduction='sum' "
                    f"(and loss_reduction='sum') or one loss")
        return f0


def torch_loss(module) -> bool:
    """Is ``module`` one of torch's own loss classes, its ``forward`` torch's?"""
    return type(module).__module__ == "torch.nn.modules.loss"


#: functional loss -> (its nn module, the keyword arguments the module takes)
FUNCTIONAL = {
    F.cross_entropy: (nn.CrossEntropyLoss, ("weight", "ignore_index", "reduction",
                                            "label_smoothing")),
    F.nll_loss: (nn.NLLLoss, ("weight", "ignore_index", "reduction")),
    F.mse_loss: (nn.MSELoss, ("reduction",)),
    F.l1_loss: (nn.L1Loss, ("reduction",)),
    F.smooth_l1_loss: (nn.SmoothL1Loss, ("reduction", "beta")),
    F.huber_loss: (nn.HuberLoss, ("reduction", "delta")),
    F.binary_cross_entropy: (nn.BCELoss, ("weight", "reduction")),
    F.binary_cross_entropy_with_logits: (nn.BCEWithLogitsLoss, ("weight", "reduction",
                                                                "pos_weight")),
    F.kl_div: (nn.KLDivLoss, ("reduction", "log_target")),
}
PRIVATE = {  # torch's entry points under F.cross_entropy / F.nll_loss: (module, positional
    # options after input and target); reduction as torch's enum (REDUCTION_ENUM)
    torch._C._nn.cross_entropy_loss: (nn.CrossEntropyLoss, ("weight", "reduction",
                                                            "ignore_index", "label_smoothing")),
    **{f: (nn.NLLLoss, ("weight", "reduction", "ignore_index"))
       for f in (torch._C._nn.nll_loss_nd, torch._C._nn.nll_loss, torch._C._nn.nll_loss2d)}}
REDUCTION_ENUM = {0: "none", 1: "mean", 2: "sum"}
BACKWARD = (torch.Tensor.backward, torch.autograd.backward)  # the entry points writing .grad


class LossFunctions(TorchFunctionMode):
    """The loss window's view of plain functions: functional losses outside any module become
    loss calls, and ``backward`` runs the coupling test first (module docstring)."""

    def __init__(self, watch: LossWatch):
        super().__init__()
        self.watch = watch

    watch = weak_attribute("watch")  # a garbage-collected engine's mode passes calls through

    def is_stale(self) -> bool:  # lifetime.stale
        return self.watch is None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_compiling() or _OWN:  # Dynamo traces the modes on the stack: the op alone
            return func(*args, **kwargs)  # (the private model's pass is refused: recorded.py)
        watch = self.watch
        if watch is None or watch._busy:
            return func(*args, **kwargs)
        if func in ENTRY_POINTS:
            return self._backward(watch, func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # an attribute: only .grad_fn (a node's hooks) is traced
            attribute = getattr(getattr(func, "__self__", None), "__name__", None)
            if attribute == "grad_fn":
                with torch._C.DisableTorchFunction():
                    watch.traced(attribute, args, kwargs, None)
            out = func(*args, **kwargs)
            if attribute == "shape" and watch.scale.on:  # n read off a tensor (realised)
                watch.scale.read(name, args, kwargs, out)
            if attribute in ATTRIBUTE_OPS and watch.stats.on:  # (``l.mean().data``, ``o.T``:
                with torch._C.DisableTorchFunction():  # a detached copy, the records moved
                    out = watch.stats.follow(func, args, kwargs, out)  # to dim 1; unseen until
            return out  # 2026-12-01, so ``l.mean() / l.mean().data`` passed)
        reduction = None
        if func in FUNCTIONAL and not watch.known_losses():
            cls, names = FUNCTIONAL[func]
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            options = {k: bound.arguments[k] for k in names if k in bound.arguments}
            positional = [v for k, v in bound.arguments.items() if k not in names]
            watch._loss_call(cls(**options), positional[0], tuple(positional[1:2]),
                             functional=True)
            reduction = options.get("reduction", "mean")
        elif func in PRIVATE and not watch.known_losses() and len(args) >= 2:
            cls, names = PRIVATE[func]  # torch's own entry point under F.cross_entropy,
            options = dict(zip(names, args[2:])) | {  # called directly: its mean divides
                k: v for k, v in kwargs.items() if k in names}  # by Σ w too (probe AI)
            options = {k: v for k, v in options.items() if v is not None}
            options["reduction"] = REDUCTION_ENUM.get(options.get("reduction", 1), "mean")
            watch._loss_call(cls(**options), args[0], tuple(args[1:2]), functional=True)
            reduction = options["reduction"]
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            watch.traced(name, args, kwargs, out)
            if watch.rows is not None:
                watch.rows.after(name, args, kwargs, out, func)
        if isinstance(out, torch.Tensor) and out.requires_grad:  # (loss_alive: a scalar, or
            watch.loss = weakref.ref(out)  # the records' loss vector reduced after zero_grad,
            # ``l = ce(out, y, reduction="none"); opt.zero_grad(); l.mean().backward()``:
            # refused as "step() without a backward()" until 2026-12-01)
        if watch.stats.on or watch.scale.on:  # batch statistics, the loss's kind
            with torch._C.DisableTorchFunction():  # a subclass (Opacus' ExpandedWeight) is
                out = watch.stats.follow(func, args, kwargs, out)  # read, never dispatched
                if reduction is not None:  # sum or mean over the records: the loss's kind
                    watch.scale.loss_call(f"F.{func.__name__}", reduction, out)
                    if reduction in ("sum", "mean"):
                        watch.stats.loss_reduced(
                            out, f"F.{func.__name__}(reduction={reduction!r})")
                else:
                    watch.scale.after(func, args, kwargs, out)
        return out

    def _backward(self, watch: LossWatch, func, args, kwargs):
        """A backward pass requested by any entry point (``backward_calls.py``): a training
        pass from this model's outputs is checked on the objective it differentiates before
        it runs; one writing no parameter's .grad runs unrecorded (a second-order one's
        results remembered: a loss reading them is refused); one restricted to some
        parameters is refused."""
        call = backward_call(func, args, kwargs)
        mine = [(t, v) for t, v in call.roots
                if isinstance(t, torch.Tensor) and t.requires_grad and reaches(t, watch.roots)]
        if not mine:  # not this model's loss
            earlier = [o for r in watch.replaced if (o := r()) is not None]
            if earlier and any(isinstance(t, torch.Tensor) and t.requires_grad and reaches(
                    t, earlier, limit=None) for t, _ in call.roots):
                raise LoopError(
                    "backward of a loss on the outputs of an earlier forward pass of the "
                    "private model, after a later one (o1 = model(x1); o2 = model(x2); "
                    "loss(o1).backward()): the optimizer checks how a loss combines the "
                    "records on the outputs of the model's last forward pass, so this loss "
                    "would go unchecked (a loss coupling the records, a batch statistic in "
                    "it, released unseen). Call backward on each forward pass's loss before "
                    "the next forward pass (gradient accumulation), or run the later pass "
                    "under torch.no_grad() if it is an evaluation")
            return func(*args, **kwargs)
        kind = call.kind(watch.parameter_ids)
        if kind in ("aside", "second order"):  # no pass of the step: unrecorded
            with watch.paused():
                try:
                    result = func(*args, **kwargs)
                except RuntimeError as err:
                    if "not have been used in the graph" not in str(err) or not any(
                            id(t) in watch.parameter_ids for t in call.inputs or ()):
                        raise
                    raise LoopError(
                        "torch.autograd.grad from the private model's outputs into its "
                        "parameters: the optimizer keeps autograd from computing the weight "
                        "gradients of the layers it records (it computes them clipped at "
                        "step(); skip_weight_grads), so the graph does not reach those "
                        "weights. For training, call loss.backward() and let step() write "
                        "every parameter's gradient; to read the ordinary gradient aside "
                        "(a log), set optimizer.skip_weight_grads = False first") from err
            if kind == "second order":  # a loss reading these is refused at its backward
                watch.second_order = [r for r in watch.second_order if r() is not None] + [
                    weakref.ref(g) for g in tree_flatten(result)[0]
                    if isinstance(g, torch.Tensor) and g.grad_fn is not None]
            return result
        try:
            if kind == "restricted":
                raise LoopError(
                    "backward(inputs=...) naming the private model's parameters: the "
                    "optimizer reads every layer's backprops from the whole backward pass of "
                    "the loss and computes each parameter's private gradient itself; a pass "
                    "restricted to some inputs runs only part of the graph (the optimizer "
                    "keeps autograd from computing the weight gradients it discards, so "
                    "whole layers' backprops would be missing). Call loss.backward() with no "
                    "inputs= and let step() write every parameter's gradient")
            loss = objective(mine, lambda f, *a: self.__torch_function__(f, (), a, {}))
            watch.second_order_use(loss)
            watch.attribute(loss)
            watch.internal(loss)
            watch.statistics(loss)
            watch.coupling(loss)  # a smooth coupling, measured, before ``reduction`` names
            watch.reduction(loss)  # any non-linear one (record_reduction.py)
            watch.before_backward()  # b read after the loop's own hooks on the outputs
            watch.windows[watch.generation] = (watch.trace, list(watch.hooks))  # its
            # recording's signature (recorded.py)
        except Exception:
            watch.close()  # the refused pass's window ends with it
            raise
        if watch.announced is not None:  # the handed-out batch's gradients wait for a step
            watch.backwarded.add(watch.serial)
        result = func(*args, **kwargs)
        watch.after_backward()
        watch.follow()  # the next batch of the step (gradient accumulation over the loop's
        # own batches), prepared from here to its forward pass: followed as the first is
        # (its mixup or normalisation passed silently until 2026-11-30)
        return result


class BeforeForward(TorchFunctionMode):
    """From the loader's batch to the model's forward pass: follows batch statistics of the
    data (``loss_terms.BatchStatistics``) in the user's code (module docstring). One at a
    time, process-wide (``following``): a new batch of any engine stops the last one, so an
    abandoned pass never leaves more than one behind."""

    following: "BeforeForward | None" = None

    def __init__(self, stats: BatchStatistics, reads: set | None = None):
        super().__init__()
        self.stats = stats
        if stats.on and stats.exported is not None:  # (following resumed after an export)
            follow_host(stats, True)
        self.reads = reads  # LossWatch.count_reads: counts read off tensors (len(x), ...)

    stats = weak_attribute("stats")

    def is_stale(self) -> bool:  # lifetime.stale
        return self.stats is None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_compiling() or _OWN:  # Dynamo traces the modes on the stack: the op alone
            return func(*args, **kwargs)  # (the private model's pass is refused: recorded.py)
        out = func(*args, **kwargs)
        if self.reads is not None and getattr(func, "__name__", "") in COUNT_READS:
            with torch._C.DisableTorchFunction():
                r = count_read(func.__name__, args, kwargs, out)
            if r is not None:
                self.reads.add(r)
        stats = self.stats  # read once: a weak reference, gone at any collection
        if stats is not None and stats.on:  # reading the tensors dispatches to no
            with torch._C.DisableTorchFunction():  # subclass: another library's tensors
                out = stats.follow(func, args, kwargs, out)  # (ExpandedWeight) unharmed
        return out


_OWN: list = []  # the workbench's own public calls now running (``own_work``)


def own_work(func):
    """``func`` is the workbench's own (a checkpoint saved or loaded in the loop, between the
    loader's batch and its step): the loss windows do not follow its tensor calls, which are
    not the batch's data (load_checkpoint's ``.numpy()`` of a 624-word RNG state was taken
    for the batch leaving torch, and the window that followed it was left open when the load
    raised, with ``torch.from_numpy`` wrapped, until 2026-12-01)."""
    @functools.wraps(func)
    def call(*args, **kwargs):
        _OWN.append(func)
        try:
            return func(*args, **kwargs)
        finally:
            _OWN.pop()
    return call


def _leave(mode) -> None:
    """Take ``mode`` off the TorchFunctionMode stack, wherever it sits: modes the user entered
    after it stay, in their order (their ``__exit__`` pops the top, which is theirs again)."""
    if isinstance(mode, BeforeForward):
        if mode.stats is not None:  # (no call followed now: torch.from_numpy is the original
            follow_host(mode.stats, False)  # once no window is told; the statistics stay for
            # the forward pass to read: ``settle``)
        mode.stats = None  # a pass-through from now on
        if BeforeForward.following is mode:
            BeforeForward.following = None
    depth = torch._C._len_torch_function_stack()
    if not any(torch._C._get_function_stack_at(i) is mode for i in range(depth)):
        return
    above = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def watched(batches, watch: "LossWatch | None", handed=None, dataset=None):
    """The engine loader's batches, each announced to the optimizer's ``watch``
    (``batch_begins``) before the user's code sees it. Following stops at the model's forward
    pass, at the next batch, when the pass ends, or when the optimizer is detached; a pass
    abandoned after handing out a batch (``next(iter(loader))``, a ``break``) leaves that
    batch followed until its forward pass. ``handed()``: called for each batch after the
    watch is told (a batch skipped before it charged first), before the loop sees it: the
    loader's ``batch_rate`` (``sampling.PoissonBatchSampler``)."""
    if watch is not None:
        watch.passing = True
        watch.earlier.data_set(dataset)  # (a record of it joined to a batch: one_row)
    try:
        for batch in batches:
            if watch is not None:
                watch.batch_begins(batch_size(batch, "the loader's batch"))
                watch.before.order.handed(batch)  # its rows are the records'
                watch.earlier.handed(batch)
            if handed is not None:
                handed()
            yield batch
        if watch is not None:
            watch.batch_ends(last=True)
    finally:  # ended, or closed (left and collected): no pass in progress
        if watch is not None:
            watch.passing = False


_WATCHED: dict[type, type] = {}  # a loader class -> its subclass announcing its batches


class _Announced:
    """The loader's iterator, its batches announced (``watched``): ``len`` as the loader's."""

    def __init__(self, inner, batches):
        self._inner, self._batches = inner, batches

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._batches)

    def __len__(self):
        return len(self._inner)


def _announcing_iter(self):
    inner = batches = type(self).__mro__[1].__iter__(self)  # the loader's own iterator
    for ref in self.__dict__.get("_wb_watches", ()):
        watch = ref()
        if watch is not None:  # (each engine made private over this loader)
            batches = watched(batches, watch)
    return batches if batches is inner else _Announced(inner, batches)


def _plain(cls, state):
    """The loader unpickled or copied: its own class, announcing to no optimizer."""
    loader = cls.__new__(cls)
    loader.__dict__.update(state)
    return loader


def _reduce_ex(self, protocol):
    state = {k: v for k, v in self.__dict__.items() if k != "_wb_watches"}
    return _plain, (type(self).__mro__[1], state)


def watch_loader(loader, watch: "LossWatch") -> None:
    """The user's own loader (``make_private(poisson_sampling=False)``, returned as it is,
    the same object) announces each batch it hands out to ``watch``, as the engine's loaders
    do (``watched``): its class becomes a subclass whose ``__iter__`` wraps the batches.
    Nothing announced them until 2026-11-30, so a record behind two rows of a step (two
    augmented views forwarded, influence 2C), a step on no batch of it, and mixup with the
    previous batch passed silently. Held weakly; a second ``make_private`` over the loader
    is announced to as well. Accumulating several of its batches into one step stays accepted
    (each record is in one batch of a pass; the bracket counts passes: ``shuffled``)."""
    cls = type(loader)
    if not cls.__dict__.get("_wb_announces", False):
        sub = _WATCHED.get(cls)
        if sub is None:
            sub = _WATCHED[cls] = type(cls.__name__, (cls,), {
                "__iter__": _announcing_iter, "_wb_announces": True,
                "__reduce_ex__": _reduce_ex,  # (pickled or copied: its own class, unwatched)
                "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        loader.__class__ = sub
    watches = [r for r in loader.__dict__.get("_wb_watches", []) if r() is not None]
    loader.__dict__["_wb_watches"] = [*watches, weakref.ref(watch)]
    watch.owned = watch.shuffled = True


__all__ = ["BACKWARD", "FUNCTIONAL", "BeforeForward", "LossFunctions", "LossWatch", "watch_loader",
           "watched"]
