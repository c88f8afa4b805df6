"""DPOptimizer: any torch optimizer, stepping on clipped, noised gradients.

The ordinary loop stays unchanged (``zero_grad``; ``loss = criterion(model(x), y)``;
``loss.backward()``; ``step()``). Hooks on the model record every layer call's activations
and output gradients during that loop (``per_sample.hooks``, ``capture="hooks"``); ``step``
turns them into the DP-SGD update (``privatise.py``; Abadi et al. 2016, arXiv 1607.00133,
Algorithm 1), writes it to ``.grad`` and calls the wrapped optimizer:

    p.grad = (Σ_i c_i g_i + N(0, σ² C² I)) / B

**Why B = qN, the expected batch size, and not the realised one.** With Poisson sampling
the realised size n is itself random and depends on who is in the batch; dividing by it
would make the update's scale data-dependent, which the privacy analysis of the sampled
Gaussian mechanism does not cover (adding or removing one example would change every
coordinate by more than C / B). Dividing by the public constant qN keeps the sensitivity of
the sum at C. The mean-reduced loss the user writes divides by n; ``loss_reduction="mean"``
multiplies the captured gradients back by n before clipping.

**Virtual steps.** A logical (Poisson) batch may be split into physical chunks
(``max_physical_batch_size``): each chunk's clipped sum is accumulated, and noise is added
once, when the logical batch's last chunk steps. The loader tags every chunk with its logical
batch (``begin_chunk``): a chunk of another batch discards an unfinished one's partial sums
(warned), and a step on data that did not come from the loader while a batch is unfinished
raises, so batches never mix and a loop left early never blocks later steps.

**The loop's guards** (``loop.py``): every public setting (σ, C, B, mode, reduction, generator,
timeout, ...) is checked whenever it is assigned; a step is accounted (``on_step``) before the
wrapped optimizer moves the weights; one thread at a time may be between a forward pass and
its step; parameters outside the optimizer never keep a ``.grad``.

**Distributed** (``torch.distributed`` initialised, e.g. under DistributedDataParallel):
each rank clips its own samples, rank 0 alone adds the noise, and the noised sums are
all-reduced, so the update equals the single-process one for the union of the ranks'
samples: samples are clipped before any reduction, and noise enters exactly once. B is then
the expected *global* batch size (q times the whole data set).

**Checked, not assumed** (``recorded.py``, ``loss_watch.py``, ``per_sample/selfcheck.py``):
every batch whose call signature is new (n symbolic: varying Poisson sizes share one, a size
equal to another dimension of a call is new) is verified: the engine's ||g_i|| of one record
against its exact twin (micro-batching; with randomness, the batch replayed with the same
random state and the other records substituted), and the user's ``.grad`` against Σ_i g_i
(a term reaching the parameters outside the model's output, e.g. an L2 penalty, raises:
use the optimizer's ``weight_decay``, data-independent and applied after the noise).
``torch.amp.GradScaler``: ``scaler.step(optimizer)`` hands over its scale
(``_step_supports_amp_scaling``), which is divided out of every recorded gradient before
clipping; ``scaler.update()`` reads the inf check of ``.grad`` as usual. The step is taken
even when an inf was found (skipping it would depend on the data). ``torch.autocast``
(bfloat16, float16): norms, clip factors and sums are computed in float32, the self-check
replays the recorded autocast state (``per_sample/precision.py``).

**Skipping the weight gradients** (``skip_weight_grads``, on by default from the first
step; ``skip_weights.py``): the user's backward pass computes no unclipped weight gradient of
the recorded leaf layers (every mode recomputes their clipped sum from the recording; Bu et
al. 2023, arXiv 2210.00038, §3), the same updates bit for bit. The ``.grad`` contract: before
``step()`` no non-private gradient is kept for those layers; after ``step()`` every parameter
holds the private one. What reads ``.grad`` before the step: a GradScaler (the default's first
step keeps the weight gradients of one layer, the smallest, for its inf check to run on; a
scaler seen there turns skipping off for the run, one seen later is refused),
``clip_grad_norm_`` (harmless: DP-SGD never reads ``.grad``, it clips per record),
DDP and autocast (skipping is off under both), the path check below (it leaves the skipped
calls out of Σ_i g_i too). ``skip_weight_grads = False`` restores the ordinary ``.grad``
(``bench training --skip-weight-grads`` measures the gain).

**Non-finite records** (a NaN or inf per-sample gradient) are left out of the sum, counted in
``last["nonfinite"]`` (indices in ``last["nonfinite_indices"]``) and warned about; a batch of
n >= 2 records that are all non-finite raises (``clipping/nonfinite.py`` says why), except
under a GradScaler, whose overflowing scale is the usual cause: the step then releases noise
alone and ``scaler.update()`` lowers the scale.

**Empty batches** still step: the clipped sum is zero and the noise is added; skipping would
reveal that the batch was empty.

Notation: n realised batch size, C max_grad_norm, σ noise multiplier, q sample rate, N data
set size, B = qN.
"""

import math
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from workbench.checks import (
    check_choice,
    check_max_grad_norm,
    check_noise_multiplier,
    check_positive,
)
from workbench.clipping.auto import choose_mode
from workbench.clipping.engine import clipped_sum
from workbench.clipping.nonfinite import skip_nonfinite, warn_skipped
from workbench.deprecation import Default, keyword, warn_renamed
from workbench.dpsgd import loop, other_optimizers
from workbench.dpsgd.distributed import (
    DEFAULT_TIMEOUT_MINUTES,
    all_reduce,
    check_timeout_minutes,
)
from workbench.dpsgd.path_check import PathCheck
from workbench.dpsgd.privatise import MODES, gaussian_noise
from workbench.dpsgd.recorded import ModelRecorder, distributed_run
from workbench.errors import (
    LoopError,
    LossCouplingError,
    NonFiniteGradientError,
    PerSampleCheckError,
    SampleMixingError,
    UnattributedGradientError,
)
from workbench.methods import OPTIMIZER_ALIASES
from workbench.per_sample import precision, selfcheck, state_replay
from workbench.per_sample.checks import check_no_sample_mixing
from workbench.per_sample.hooks import OwnHook
from workbench.per_sample.sketch import RowSketch

AUTO = Default("auto")  # the method= default, told apart from an explicit "auto"


def check_method(value) -> str:
    """One of ``MODES`` (``workbench/methods.py``) or "auto"; "ghost", one code path with
    "bookkeeping" once the user's backward has run, is its deprecated alias."""
    if value in OPTIMIZER_ALIASES:
        warn_renamed(f"method={value!r}", f"method={OPTIMIZER_ALIASES[value]!r} (in the "
                     f"optimizer they are one code path)", "DPOptimizer", stacklevel=5)
        return OPTIMIZER_ALIASES[value]
    return check_choice(value, "method", (*MODES, "auto"))


def _layout(value):
    """Shapes and dtypes of a call's Tensor arguments (one level into lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype, value.device
    if type(value) in (list, tuple):
        return tuple(_layout(v) for v in value)
    return type(value)


def mode_key(rec) -> tuple:
    """Everything ``choose_mode`` reads of a recording: n, dtype, the recorded calls (layer,
    type, input shapes), the trainable parameters (id, shape, requires_grad), the fallback
    and the parameters taken over (``Recording.taken``). A layer added or replaced, a new
    shape, a parameter frozen or unfrozen changes it."""
    with torch._C.DisableTorchFunction():  # attribute reads, not ops of the loop
        return (rec.n, rec.dtype,
                tuple((path, id(layer), type(layer), _layout(call.args))
                      for path, layer, call in rec.calls()),
                tuple((id(p), p.shape, p.requires_grad) for p in rec.params.values()),
                tuple(sorted(rec.fallback)), tuple(sorted(rec.taken)))


def _group_ids(groups) -> list:
    """The parameters of each group, by identity and in order."""
    return [tuple(id(p) for p in g["params"]) for g in groups]


def _needs_closure(optimizer) -> bool:
    """Whether ``optimizer.step`` cannot run without a closure (``torch.optim.LBFGS``)."""
    import inspect
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # a C or wrapped step: nothing to read
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_wrappable(optimizer, model) -> None:
    """Refuse, by name, a DPOptimizer over a DPOptimizer (a notebook cell re-run with the
    optimizer an earlier ``make_private`` returned: the new one stepped through the old, which
    the new call had detached, and refused at the first ``zero_grad`` with advice to use the
    optimizer the user was using) and a model compiled with ``torch.compile`` before (a bare
    ``KeyError: 'training'`` from the recorder: the compiled wrapper forwards attribute reads
    to the model it wraps)."""
    if isinstance(optimizer, DPOptimizer):
        raise TypeError("optimizer is already a DPOptimizer (returned by an earlier "
                        "make_private or built over this model): wrap the torch optimizer "
                        "itself, optimizer.original_optimizer, with the data loader you made "
                        "(not the private one returned)")
    if _needs_closure(optimizer):
        raise TypeError(f"{type(optimizer).__name__}.step needs a closure that it calls "
                        f"several times per step (a line search): each call is a pass over "
                        f"the batch that DP-SGD would have to clip, noise and account, and "
                        f"one step charges one (probe of 2026-12-01: a bare TypeError after "
                        f"the step was accounted). Use an optimizer whose step takes the "
                        f"gradient once (SGD, Adam, AdamW, ...)")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise TypeError("the model is a torch.compile wrapper (OptimizedModule): the optimizer "
                        "records the layers of an ordinary nn.Module, op by op in Python, "
                        "which a compiled model does not run. Pass the module itself "
                        "(model._orig_mod) and train it uncompiled (a private model called "
                        "under torch.compile is refused at its forward pass)")


CHECKS = (PerSampleCheckError, SampleMixingError, UnattributedGradientError, LossCouplingError)
# a refused check of a step whose passes set gradient hooks: the message names them


class DPOptimizer(Optimizer):
    """Wraps ``optimizer``; records ``model``'s layer calls; steps with DP-SGD gradients."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler.step passes its scale: step()

    def __init__(self, optimizer: Optimizer, model: torch.nn.Module, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float,
                 method: str = AUTO, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, on_step=None, criterion=None,
                 **renamed):
        check_wrappable(optimizer, model)  # before anything is built on either
        super().__init__(optimizer.param_groups, optimizer.defaults)  # creates the hook tables
        self.__dict__["original_optimizer"] = optimizer  # from now on the properties delegate
        # every setting is checked (the same checks as on a later assignment) before the
        # model gets a single hook
        self.method = keyword(method, renamed, "method", "grad_sample_mode", "DPOptimizer")
        self.loss_reduction = loss_reduction
        self.expected_batch_size = expected_batch_size
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.generator = generator
        self._drawn: set[int] = set()  # the noise generator's states each step drew from
        self.on_step = on_step  # on_step(noise_multiplier): each logical step, before it moves
        check_no_sample_mixing(model)
        self.expect_more = False  # more chunks of this logical batch (a virtual-step loader)
        self._batch_token, self._fresh_chunk = None, False  # see begin_chunk
        self.model = model
        self.recorder = ModelRecorder(model, self.param_groups, loss_reduction, criterion)
        self.recorder.watch.on_skipped = self._skipped_batch  # charged (LossWatch.batch_ends)
        me = weakref.ref(self)  # B for the loss window's factors (record_reduction.realised)
        self.recorder.watch.expected = lambda: getattr(me(), "expected_batch_size", None)
        self._groups = _group_ids(self.param_groups)  # what the recorder clips: _check_groups
        self.guard = loop.ThreadGuard()
        self._guard_handle = self.recorder.model.register_forward_pre_hook(
            OwnHook(self._enter_forward), prepend=True)  # before the recorder's hooks record
        self._drop_handles = loop.drop_gradients(self.recorder.outside)  # no non-private .grad
        self._drop_handles.append(other_optimizers.guard(self))  # nor a second optimizer's step
        self.verify = True  # each new call signature; "always"; False: see verify_next_step()
        self._verify_next = False
        self._zeroed, self._released = False, {}  # is .grad this step's own? (_path_check_applies)
        self.all_reduce_timeout_minutes = DEFAULT_TIMEOUT_MINUTES  # make_private may set it
        self._sums: dict[int, torch.Tensor] = {}
        self._modes: dict = {}  # mode_key -> the mode "auto" chose for that layout
        self.user_level = None  # privacy_unit="user": a user_level.UserLevel (make_private)
        self.last = {}  # norms and clip factors of the last batch, for widgets and training logs
        self.recorder.watch.follow()  # batch statistics before the first forward pass

    # param_groups, state and defaults are the wrapped optimizer's own objects, looked up on
    # every access: its load_state_dict replaces them, and LR schedulers must edit the live ones.
    def _delegated(name):
        def get(self):
            inner = self.__dict__.get("original_optimizer")
            return getattr(inner, name) if inner is not None else self.__dict__[f"_{name}"]

        def set_(self, value):
            inner = self.__dict__.get("original_optimizer")
            if inner is not None:
                setattr(inner, name, value)
            else:  # during Optimizer.__init__, before the wrapped optimizer is attached
                self.__dict__[f"_{name}"] = value

        return property(get, set_)

    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")
    del _delegated

    # Public settings, checked whenever assigned (``loop.Checked``): a bad σ or C set after
    # construction fails here, before a step could use it.
    noise_multiplier = loop.Checked(lambda self, v: check_noise_multiplier(v), "σ")
    max_grad_norm = loop.Checked(lambda self, v: self._check_clip_norms(v), "C, or one per group")
    expected_batch_size = loop.Checked(
        lambda self, v: check_positive(v, "expected_batch_size", note="B = q N"), "B = q N")
    method = loop.Checked(lambda self, v: check_method(v), "per-sample method, or auto")
    loss_reduction = loop.Checked(lambda self, v: loop.check_loss_reduction(v), "mean or sum")
    generator = loop.Checked(lambda self, v: loop.check_generator(v), "the noise generator")
    on_step = loop.Checked(lambda self, v: loop.check_callback(v), "the accountant's callback")
    verify = loop.Checked(lambda self, v: loop.check_verify(v), "self-check schedule")
    all_reduce_timeout_minutes = loop.Checked(
        lambda self, v: check_timeout_minutes(v), "collective timeout")

    @property
    def grad_sample_mode(self) -> str:
        """The old name of ``method`` (deprecated)."""
        warn_renamed("DPOptimizer.grad_sample_mode", "method", "DPOptimizer")
        return self.method

    @grad_sample_mode.setter
    def grad_sample_mode(self, value) -> None:
        warn_renamed("DPOptimizer.grad_sample_mode", "method", "DPOptimizer")
        self.method = value

    def _check_clip_norms(self, max_grad_norm):
        """One C (flat clipping), or one C per parameter group (per-layer clipping): a
        ``ClipNorms`` list, whose in-place edits are checked too. Refused while a logical
        batch is half accumulated (``_clip_norms_settled``)."""
        if isinstance(max_grad_norm, (list, tuple)):
            if len(max_grad_norm) != len(self.param_groups):
                raise ValueError(f"max_grad_norm has {len(max_grad_norm)} values for "
                                 f"{len(self.param_groups)} parameter groups; give one C per "
                                 f"group (per-layer clipping) or a single number")
            value = loop.ClipNorms(check_max_grad_norm(C) for C in max_grad_norm)
            value.changed = self._clip_norms_settled
        else:
            value = check_max_grad_norm(max_grad_norm)
        self._clip_norms_settled(value)
        return value

    def _clip_norms_settled(self, value) -> None:
        """LoopError if C changes while a logical batch's chunks are half accumulated
        (``max_physical_batch_size``): its chunks so far were clipped to the old C, and the
        noise of its last chunk would be σ times the new one; a clip-norm schedule stepped
        per chunk released a record clipped to 1 under noise 1e-6, charged at σ, until
        2026-11-30."""
        old = self.__dict__.get("_checked_max_grad_norm")
        if self.__dict__.get("_sums") and old is not None and list(
                old if isinstance(old, list) else [old]) != list(
                value if isinstance(value, list) else [value]):
            raise LoopError(
                f"max_grad_norm changed from {old} to {value} in the middle of a logical batch "
                f"(max_physical_batch_size: its earlier chunks are clipped to the old C, and "
                f"the noise added at its last chunk would be sigma times the new one, so the "
                f"release would not be the Gaussian mechanism the accountant charges). Change "
                f"it between logical steps, when optimizer.expect_more is False (step a "
                f"clip-norm schedule after the logical step)")

    @property
    def clip_norm_total(self) -> float:
        """The sensitivity of the clipped sum: C, or ||(C_1, ..., C_G)||₂ per layer."""
        C = self.max_grad_norm
        return math.sqrt(sum(c * c for c in C)) if isinstance(C, list) else C

    def _clip_spec(self):
        """(max_grad_norm argument, group_of) for ``clipping.engine.clipped_sum``."""
        if not isinstance(self.max_grad_norm, list):
            return self.max_grad_norm, None
        group = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        return dict(enumerate(self.max_grad_norm)), lambda p: group.get(id(p))

    def detach(self, reason: str = "") -> None:
        """Remove the recording hooks; the model is as it was before ``make_private``.
        ``reason``: why; a later step() or zero_grad() raises with it (``loop.check_alive``)."""
        self.recorder.close()
        for handle in [self._guard_handle, *self._drop_handles]:
            handle.remove()
        self.__dict__["_detached"] = reason or "optimizer.detach() was called"

    @property
    def skip_weight_grads(self) -> bool:
        """On by default. On: in the forward passes between ``zero_grad()`` and ``step()``,
        autograd skips the unclipped weight gradients of the recorded leaf layers, which every
        mode recomputes clipped (``skip_weights.py``; Bu et al. 2023 §3). The ``.grad``
        contract: before ``step()``, no non-private gradient is kept for those layers (only
        terms outside their calls, e.g. a tied head's use); after ``step()``, every parameter
        holds the private one. Any other gradient taken through those passes
        (``torch.autograd.grad`` w.r.t. the parameters) lacks their part too. The default
        starts at the first step, where it keeps one layer's (the smallest's) weight
        gradients, and stays off once a ``GradScaler`` steps the optimizer (its inf check
        reads ``.grad``; the first step's kept layer is what it checks there); ``True``
        starts at once and refuses a GradScaler at the step; ``False``: ``.grad`` before
        ``step()`` is the ordinary gradient. Off under DDP and autocast (the ordinary path
        runs)."""
        return self.recorder.skip_weight_grads is not False

    @skip_weight_grads.setter
    def skip_weight_grads(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"skip_weight_grads must be True or False; got {value!r}")
        self.recorder.skip_weight_grads = value
        self.recorder.skipper.attach(value)

    def _enter_forward(self, module, args):
        if torch.is_grad_enabled():  # no_grad passes record nothing (evaluation)
            self.guard.enter("a forward pass of the private model")

    def verify_next_step(self) -> None:
        """Verify the next step whatever its call signature (``recorded.py``)."""
        self._verify_next = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        loop.check_alive(self, "zero_grad")
        self.guard.enter("optimizer.zero_grad()")
        if self.recorder.watch.loss_alive() and self.recorder.forward_awaits_backward():
            # loss = crit(model(x), y); zero_grad();
            # loss.backward(): PyTorch's own tutorial order. Only .grad is cleared; the
            # forward pass recorded stays for its backward (refused as "step() without a
            # backward()" until 2026-11-30)
            try:
                with self.recorder.watch.unfollowed():
                    self.original_optimizer.zero_grad(set_to_none=set_to_none)
                self._zeroed = True
            finally:
                self.guard.release()
            return
        with self.recorder.watch.unfollowed():  # .grad of the parameters: not the batch's data
            self.original_optimizer.zero_grad(set_to_none=set_to_none)
        watch = self.recorder.watch
        self.recorder.dropped_backward = self.recorder.backward_ran()  # named by a step
        # without one (recorded.py: "zero_grad() between backward() and step()")
        self.recorder.clear()
        watch.drop_used()  # the passes it drops count for no step (count_records); a loader
        # batch among them is charged (_skipped_batch)
        self.recorder.armed = True  # skip_weight_grads: this step's forward passes
        self._zeroed = True
        watch.follow()  # batch statistics from here to the forward pass
        self.guard.release()

    def _skipped_batch(self) -> None:
        """The engine's loader handed out a batch no step() was taken for
        (``LossWatch.batch_ends``): the loop skipped it before or after its backward pass
        (``continue`` on an empty batch, on a non-finite loss or one above a threshold, its
        gradients dropped by zero_grad()) or left the loader's pass. Charged to the
        accountant as a step, with a warning: the accountant charged only the steps taken
        until 2026-11-30 (28 of 40 batches where a loop skipped the empty ones)."""
        warnings.warn(
            "a batch the private loader handed out had no step(): the loop skipped it (an "
            "empty batch, a non-finite loss or one above a threshold, its gradients dropped "
            "by zero_grad()), peeked at it, or left the loader's pass. It is charged to the "
            "accountant as a step (it was sampled); if the skip was decided from the batch's "
            "records, that decision reveals them beyond what the accountant covers: call "
            "step() for every batch (the optimizer leaves a non-finite record out, and an "
            "empty batch releases noise alone)", stacklevel=4)
        if self.on_step is not None:
            self.on_step(self.noise_multiplier)

    def begin_chunk(self, token, last: bool) -> None:
        """A virtual-step loader hands out a chunk of the logical batch ``token``; ``last``:
        the batch's last chunk (noise is added at its step). Partial sums of a *different*
        batch (a loop left early, a new iterator, two iterators interleaved) are discarded
        with a warning: those samples were drawn for that batch, not for this one."""
        if token != self._batch_token and (self._sums or self.expect_more):
            self.reset_virtual_step()  # subclasses (adaptive.py) drop their own partials too
        self._batch_token, self.expect_more, self._fresh_chunk = token, not last, True

    def reset_virtual_step(self) -> None:
        """Drop the partial sums of an unfinished logical batch (a virtual-step loop that was
        left early): those samples were sampled for that batch, not for the next one."""
        if self._sums or self.expect_more:
            warnings.warn("a logical batch was left unfinished (the loop over the virtual-step "
                          "loader stopped before its last chunk); its partial clipped sums are "
                          "discarded and no step was taken for it", stacklevel=4)
        self._sums, self.expect_more, self._batch_token = {}, False, None

    def accumulate_clipped_sum(self, scale=None) -> None:
        """Add this (physical) batch's Σ_i c_i g_i to the running sums: every backward pass
        since the last step is a batch of its own samples, clipped one by one. ``scale``: a
        GradScaler's scale, divided out first."""
        C, group_of = self._clip_spec()
        check = "always" if self.verify == "always" or self._verify_next else self.verify
        self.recorder.watch.check = check is not False
        self.recorder.watch.close()  # the loop's loss calls are in: the probes' are not
        norms, factors, modes, replays, paths = [], [], [], [], None
        skipped, seen, tol, unchecked, compare = [], 0, 0.0, set(), False
        why = {}  # id(param) -> why its g_i come from the whole-model fallback
        cpu_amp = False  # a pass ran under autocast on the CPU (path_check's known cause)
        hooks = self.recorder.step_hooks()  # named in a refused check
        try:
            with self.recorder.paused():  # the samplers may call the layers themselves
                for rec, exact in self.recorder.batches(self.loss_reduction, check, scale):
                    if rec.n == 0:
                        continue
                    mode = self.method
                    if mode == "auto":  # einsum or book-keeping, by clipping/auto.py's rule
                        mode = self._auto_mode(rec)
                    modes.append(mode)
                    tol = max(tol, precision.tolerance(rec))
                    cpu_amp = cpu_amp or (rec.autocast is not None and rec.device.type == "cpu")
                    if self.recorder.comparing and not compare:  # once per step
                        compare = True
                        if self._path_check_applies():
                            several = self.recorder.passes > 1  # .grad is their sum
                            paths = PathCheck(self.recorder.params, hold=several,
                                              free=not several,
                                              marks=self.recorder.grad_marks)
                    if paths is not None:  # before clipping frees the backprops; every pass
                        # of the step, not only the checked ones
                        with state_replay.modes(rec.state):
                            for key, g in self.recorder.path_gradients(rec, exact):
                                paths.add(key, g)  # compared and let go (path_check.py)
                        unchecked |= self.recorder.unchecked(rec)
                        why.update(rec.fallback)
                    users = None if self.user_level is None else self.user_level.batch(rec)
                    row = None if rec.signature is None else RowSketch(
                        {id(p): p for p in rec.params.values()})  # record n - 1's part
                    with state_replay.modes(rec.state):  # the modes the pass ran in
                        sums, norm, c = clipped_sum(rec, C, mode, group_of, exact=exact,
                                                    users=users, row=row)  # user_level.py
                    if rec.signature is not None:
                        replays.append((rec, norm[rec.n - 1].detach(), row))
                    skipped += [seen + i for i in skip_nonfinite(norm, scale is not None)]
                    # masked by the engine; under a GradScaler an all-inf batch is its overflow
                    seen += rec.n
                    for key, s in sums.items():
                        self._sums[key] = s if key not in self._sums else self._sums[key] + s
                    norms.append(norm.detach())
                    factors.append(c.detach())
            self.recorder.watch.count_records(seen)  # one row per record the loader drew
            late = bool(self.recorder.skipper.late)  # a tapped layer called off the rows:
            # its .grad cannot be compared at this step (skip_weights.py), at the next it can
            self.recorder.clear(keep_pending=True)  # the checks' extra passes: on freed memory
            self.recorder.watch.probe()
            for rec, norm, row in replays:
                if torch.isfinite(norm):  # a non-finite record is left out, not compared
                    self._verify(rec, norm, row)
            if paths is not None and not skipped:  # Σ_i g_i with a NaN record proves nothing
                first = next(iter(self.recorder.params.values()))
                tol = max(tol, precision.tolerance_of(first.dtype, first.device))
                paths.verdict(tol, unchecked, why, cpu_amp)
        except Exception as err:
            if hooks and isinstance(err, CHECKS):
                err.args = (f"{err.args[0]}. This step's passes registered gradient hooks "
                            f"({'; '.join(hooks[:3])}{' ...' if len(hooks) > 3 else ''}): "
                            f"a hook that combines the records' gradients (a mean or norm over "
                            f"dim 0) couples the records, and no per-record gradient carries "
                            f"it. Apply such a hook to each record's rows alone, or remove it",
                            *err.args[1:])
            self._sums = {}  # nothing of a refused batch is kept for a later step
            self.recorder.clear()
            watch = self.recorder.watch  # nor counted for it (count_records), nor waiting
            watch.used, watch.backwarded = {}, set()  # for a step (batch_ends may charge it)
            raise
        # a check a non-finite record kept from running waits for the next batch
        self._verify_next = (bool(skipped) and bool(replays or compare)) or (
            late and self.verify is not False)
        self.last = {"norms": torch.cat(norms) if norms else torch.zeros(0),
                     "clip_factors": torch.cat(factors) if factors else torch.zeros(0),
                     "mode": modes[-1] if modes else None,  # the mode "auto" chose
                     "nonfinite": len(skipped), "nonfinite_indices": skipped}
        warn_skipped(skipped, seen, scale is not None)

    def _auto_mode(self, rec) -> str:
        """``choose_mode(rec)[0]``, remembered for the batch's layout (``mode_key``): the
        rule reads only the calls' layers and input shapes, the parameters' shapes and the
        fallback, never values, so a batch of the same layout gets the same mode (and either
        mode is exact: a stale choice could only cost time)."""
        key = mode_key(rec)
        mode = self._modes.get(key)
        if mode is None:
            if len(self._modes) >= 16:  # Poisson sizes: n is part of the key (BYTES)
                self._modes.clear()
            mode = self._modes[key] = choose_mode(rec)[0]
        return mode

    def _verify(self, rec, norm, row) -> None:
        """Record n - 1's ||g_i||, then its contribution as the clipped sum added it (``row``:
        parameter by parameter, ``per_sample/sketch.py``), against its exact twin; then the
        verdict is remembered."""
        if rec.halves is not None:  # the model on each half of the batch (selfcheck.py)
            inputs, rec.halves = rec.halves, None
            with self.recorder.paused():
                selfcheck.check_model_halves(rec, self.model, inputs)
        if getattr(rec, "padding", None) is not None:  # a padded batch (collate_check.py)
            self.recorder.padding_probe(rec)
        if rec.replay is not None:  # randomness: the record probe (selfcheck.py)
            ref = selfcheck.as_sketch(rec, self.recorder.replay_probe(rec, *rec.replay))
        else:
            ref = rec.probe
        rec.replay = None
        selfcheck.compare_norm(rec, norm, ref)
        selfcheck.compare_rows(rec, row, ref)
        selfcheck.remember(self.recorder.model, rec.signature, dict(rec.fallback))

    def _path_check_applies(self) -> bool:
        """Whether the user's ``.grad`` is this step's Σ_i g_i to compare (``path_check.py``,
        to ``tol``: the dtype the batches were computed in, autocast's, ``precision.py``):
        not where it is all-reduced, holds an earlier step's, or a GradScaler overflowed.
        Asked before the path gradients are computed: the check lets each ``.grad`` go once
        compared (``step()`` replaces it with the private one; a refused step leaves it
        None)."""
        if distributed_run(self.model) or not (self._zeroed or all(
                p.grad is not self._released.get(id(p)) for p in self.recorder.params.values())):
            return False  # .grad is all-reduced, or holds an earlier step's
        return self._amp_scale() is None or all(
            p.grad is None or bool(torch.isfinite(p.grad).all())
            for p in self.recorder.params.values())  # an overflow: the scaler's inf check
        # lowers the scale (module docstring)

    def noise_std(self) -> float:
        """σ C: the standard deviation of the noise on each coordinate of the clipped sum."""
        return self.noise_multiplier * self.clip_norm_total

    def privatise(self) -> None:
        """p.grad = (Σ_i c_i g_i + N(0, σ²C² I)) / B for every trainable parameter.

        Also records the update's signal ||Σ_i c_i g_i|| / B and the noise's expected norm
        σ C √d / B (d trainable coordinates) in ``self.last``: their ratio is the gradient
        signal-to-noise ratio of this step.
        """
        std = self.noise_std()
        distributed = dist.is_available() and dist.is_initialized()
        adds_noise = not distributed or dist.get_rank() == 0  # noise exactly once
        if adds_noise:
            self._fresh_noise(std)
        signal_sq, d = 0.0, 0
        names = {id(p): k for k, p in self.model.named_parameters()} if distributed else {}
        norms = []  # ||Σ_i c_i g_i|| per parameter (0-d): one host sync for all, at the end
        if not distributed:  # the common case: no copies, the noise buffer is p.grad
            d, norms = self._noised_means(std)
        for group in self.param_groups if distributed else ():
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                d += p.numel()
                total = self._sums.get(id(p), torch.zeros_like(p)).detach().to(p.dtype).clone()
                # Σ over all ranks' samples, each clipped on its own rank
                signal = total.clone()
                all_reduce(signal, timeout_minutes=self.all_reduce_timeout_minutes,
                           name=f"clipped sum of {names.get(id(p), 'a parameter')}")
                signal_sq += float(signal.pow(2).sum())
                if adds_noise:
                    total += gaussian_noise(p, std, self.generator)
                all_reduce(total, timeout_minutes=self.all_reduce_timeout_minutes,
                           name=f"noised sum of {names.get(id(p), 'a parameter')}")
                p.grad = total / self.expected_batch_size
        if norms:
            device = norms[0].device
            signal_sq += float(torch.stack([v.to(device) for v in norms]).double().square().sum())
        self._sums = {}
        self.recorder.drop_outside_grads()  # no parameter keeps a non-private gradient
        B = self.expected_batch_size
        self.last["signal"] = signal_sq ** 0.5 / B
        self.last["noise"] = std * d ** 0.5 / B

    def _fresh_noise(self, std: float) -> None:
        """LoopError if the noise generator (or, without one, torch's default CPU generator)
        is at a state an earlier step of this optimizer drew its noise from: it was seeded or
        set back (``manual_seed``, ``set_state``, ``torch.manual_seed`` in the loop), so this
        step's noise would repeat that step's, and the difference of the two releases would
        carry none. The family of the checkpoint roll-back ``load_checkpoint`` refuses (probe
        AL: the replayed steps differed by 0.016 where fresh noise gives 0.32); this catches
        every other way back. A digest of the state per step (a few microseconds)."""
        g = self.generator
        if not std or hasattr(g, "next"):  # no noise; secure mode: a fresh seed each draw
            return
        if g is None:
            if next((p.device.type for grp in self.param_groups for p in grp["params"]),
                    "cpu") != "cpu":
                return  # (a device's default generator: not followed)
            state = torch.random.get_rng_state()
        elif isinstance(g, torch.Generator):
            state = g.get_state()
        else:
            return
        digest = hash(state.numpy().tobytes())
        if digest in self._drawn:
            which = "the noise generator" if g is not None else "torch's default generator"
            raise LoopError(
                f"{which} is at a state an earlier step drew its noise from: it was seeded or "
                f"set back since (manual_seed, set_state, torch.manual_seed in the loop, a "
                f"checkpoint loaded into a run that had moved on), so this step's noise would "
                f"repeat that step's, and the difference of the two releases would carry no "
                f"noise, while the accountant charges both as independent. Seed the "
                f"generator once, before the first step (make_private(..., "
                f"noise_generator=torch.Generator().manual_seed(seed))), and never set it "
                f"back")
        self._drawn.add(digest)

    def _noised_means(self, std: float) -> tuple[int, list]:
        """p.grad = (Σ_i c_i g_i + N(0, σ²C² I)) / B for every trainable parameter, on one
        process: ``privatise.noised_mean`` bit for bit (the noise drawn parameter by
        parameter in the same order, the sum added to it and B divided, elementwise the same
        operations). Each parameter's sum is let go once added: the sums and the noise
        (each the model's size) overlap by one parameter, not whole. (d, [||Σ_i c_i g_i||
        per parameter reached]) for the signal."""
        B, d = self.expected_batch_size, 0
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        sums = {}
        for p in params:
            s = self._sums.pop(id(p), None)
            if s is not None:  # detach and cast only when needed: each is an op
                s = s.detach() if s.requires_grad else s
                sums[id(p)] = s if s.dtype == p.dtype else s.to(p.dtype)
        with torch.no_grad():
            norms = list(torch._foreach_norm(list(sums.values()))) if sums else []  # ||s||
            for p in params:
                d += p.numel()
                noise = gaussian_noise(p, std, self.generator)  # fresh: ours to write
                s = sums.pop(id(p), None)
                if s is not None:
                    noise.add_(s)
                    del s  # the last reference: freed before the next noise is drawn
                p.grad = noise
            if params:
                torch._foreach_div_([p.grad for p in params], B)
        return d, norms

    def step(self, closure=None):
        loop.check_alive(self, "step")
        self.guard.enter("optimizer.step()")
        by_values = False
        try:
            return self._step(closure)
        except NonFiniteGradientError:  # refused for its records' values: a loop that
            # catches it and goes on has skipped the batch by its records: charged (it was
            # not, silently, until 2026-11-30), unless a later chunk of its logical batch
            by_values = not self.expect_more  # will step (and charge) it
            raise
        finally:
            watch = self.recorder.watch  # the pass's loss window ends with its step, always
            watch.close()
            watch.batch_ends(report=by_values)  # another refusal is the loop's mistake
            watch.follow()  # the next batch's statistics, from here to its forward pass
            self.guard.release()

    def _step(self, closure):
        loss = None
        self.recorder.watch.stop_following()  # the step's own tensor calls are no batch's
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        self.recorder.check_step()  # a fresh backward since the last step, same model
        loop.check_inputs_private(self.recorder.root_rec.all_calls())
        if self.expect_more and not self._fresh_chunk:
            raise LoopError(
                "step() on a batch that did not come from the virtual-step loader while its "
                "logical batch is unfinished (a loop over it was left before the batch's last "
                "chunk): this step's samples would be mixed into that batch and no update "
                "would be taken. Finish the loop over the loader, or start a new pass "
                "(for x, y in loader: ...), which discards the unfinished batch")
        self._fresh_chunk = False
        if self.user_level is None:  # (its own check: a batch of the user-level loader)
            self.recorder.watch.check_handed()  # each step a batch of the engine's loader
        if self._amp_scale() is not None:
            if self.recorder.skipper.tapped and (self.recorder.skip_weight_grads is True
                                                 or self.recorder.warm):
                self.recorder.clear()
                raise ValueError("skip_weight_grads with a GradScaler: the scaler's inf check "
                                 "reads .grad, which the skipped weight gradients leave empty "
                                 "(the default skips nothing once the first step had the "
                                 "scaler); set optimizer.skip_weight_grads = False, or step "
                                 "through the scaler from the first step")
            self.recorder.scaler_seen = True  # the default skips nothing from now on (its
            # first step kept one layer's .grad for the scaler's inf check: skip_weights.py)
        self.accumulate_clipped_sum(self._amp_scale())
        self.recorder.warm = True  # a step taken: the default skips from the next one
        if self.expect_more:
            self._mark_released()
            return loss  # a virtual step: noise comes with the logical batch's last chunk
        self._batch_token = None
        self.privatise()
        self._mark_released()
        if self.on_step is not None:  # accounted before the weights move: never unaccounted
            self.on_step(self.noise_multiplier)
        self.__dict__["_stepping"] = True  # the one step of the wrapped optimizer allowed
        try:  # (other_optimizers.check refuses it anywhere else)
            self.original_optimizer.step()
        finally:
            self.__dict__["_stepping"] = False
            self._mark_versions()  # an optimizer that edits .grad in place (maximize=True)
        return loss

    def _check_groups(self) -> None:
        """The parameters are the ones the optimizer was made over (they may move between
        groups, or a group be split, as long as each group has its C: the step reads the
        groups as they are). The recorder clips
        the parameters it was given (and, with one C per group, by their groups): a group
        added later (``add_param_group``) was never trained (its .grad dropped as a
        parameter outside the optimizer), a parameter taken out of a group still counted in
        every record's clip and kept its non-private .grad, and per-group C met a group it
        had no C for (a bare KeyError), until 2026-11-29."""
        now = _group_ids(self.param_groups)
        per_group = isinstance(self.max_grad_norm, list)  # one C per group: as many groups
        if (per_group and len(now) != len(self.max_grad_norm)) or sorted(
                i for g in now for i in g) != sorted(i for g in self._groups for i in g):
            raise LoopError(
                "the optimizer's parameter groups changed after the DPOptimizer was made (a "
                "group added with add_param_group, a group's params edited, or with one "
                "max_grad_norm per group, a group without its C): it records, "
                "clips and noises the parameters it was made over, so the changed groups "
                "would be trained wrong or not at all. Create the DPOptimizer (or call "
                "make_private) over the optimizer with all its groups; a group's lr and "
                "other options may change freely")

    def _mark_released(self) -> None:
        """The .grad tensors now held: a later backward adding into them is not fresh."""
        self._released = {id(p): p.grad for p in self.recorder.params.values()}
        self._mark_versions()
        self._zeroed = False

    def _mark_versions(self) -> None:
        """The released .grad tensors' versions: a later backward pass without zero_grad()
        accumulates the ordinary gradient into the same tensor, in place, and changes its
        version (``other_optimizers.released``)."""
        self.__dict__["_released_versions"] = {
            id(p): p.grad._version for p in self.recorder.params.values()
            if p.grad is not None}

    def _amp_scale(self):
        """The scale torch.amp.GradScaler.step set (``grad_scale``), or None without one."""
        if "grad_scale" not in self.__dict__:
            return None
        if self.grad_scale is None:
            raise ValueError("scaler.unscale_(optimizer) was called before scaler.step("
                             "optimizer): it divides only .grad, which DP-SGD discards, and "
                             "hides the scale the recorded per-sample gradients carry. Remove "
                             "scaler.unscale_ (clip with max_grad_norm, not clip_grad_norm_): "
                             "scaler.step(optimizer) unscales the per-sample gradients itself")
        return self.grad_scale

    def state_dict(self):
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)


__all__ = ["AUTO", "DPOptimizer", "check_method", "check_wrappable"]
