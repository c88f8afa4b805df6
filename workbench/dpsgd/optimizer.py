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
once, when the logical batch's last chunk steps (``expect_more`` says which chunk is last).

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
even when an inf was found (skipping it would depend on the data).

**Empty batches** still step: the clipped sum is zero and the noise is added; skipping would
reveal that the batch was empty.

Notation: n realised batch size, C max_grad_norm, σ noise multiplier, q sample rate, N data
set size, B = qN.
"""

import math
import warnings

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from workbench.checks import check_max_grad_norm, check_noise_multiplier, check_positive
from workbench.clipping.auto import choose_mode
from workbench.clipping.engine import MODES, clipped_sum
from workbench.dpsgd.distributed import DEFAULT_TIMEOUT_MINUTES, all_reduce
from workbench.dpsgd.privatise import gaussian_noise
from workbench.dpsgd.recorded import ModelRecorder, distributed_run
from workbench.errors import UnattributedGradientError
from workbench.per_sample import selfcheck
from workbench.per_sample.checks import check_no_sample_mixing


class DPOptimizer(Optimizer):
    """Wraps ``optimizer``; records ``model``'s layer calls; steps with DP-SGD gradients."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler.step passes its scale: step()

    def __init__(self, optimizer: Optimizer, model: torch.nn.Module, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float,
                 grad_sample_mode: str = "auto", loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, on_step=None, criterion=None):
        if grad_sample_mode not in (*MODES, "auto"):
            raise ValueError(f"grad_sample_mode must be one of {(*MODES, 'auto')}; got "
                             f"{grad_sample_mode!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' (criterion averages over the batch)"
                             f" or 'sum'; got {loss_reduction!r}")
        B = check_positive(expected_batch_size, "expected_batch_size", note="B = q N")
        check_no_sample_mixing(model)
        super().__init__(optimizer.param_groups, optimizer.defaults)  # creates the hook tables
        self.__dict__["original_optimizer"] = optimizer  # from now on the properties delegate
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.max_grad_norm = self._check_clip_norms(max_grad_norm)
        self.expected_batch_size = B
        self.grad_sample_mode = grad_sample_mode
        self.loss_reduction = loss_reduction
        self.generator = generator
        self.on_step = on_step  # called as on_step(noise_multiplier) after each logical step
        self.expect_more = False  # set by a virtual-step loader: more chunks of this batch
        self.model = model
        self.recorder = ModelRecorder(model, self.param_groups, loss_reduction, criterion)
        self.verify = True  # each new call signature; "always"; False: see verify_next_step()
        self._verify_next = False
        self._zeroed, self._released = False, {}  # is .grad this step's own? (_check_path)
        self.all_reduce_timeout_minutes = DEFAULT_TIMEOUT_MINUTES  # make_private may set it
        self._sums: dict[int, torch.Tensor] = {}
        self.last = {}  # norms and clip factors of the last batch, for widgets and training logs

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

    def _check_clip_norms(self, max_grad_norm):
        """One C (flat clipping), or one C per parameter group (per-layer clipping)."""
        if isinstance(max_grad_norm, (list, tuple)):
            if len(max_grad_norm) != len(self.param_groups):
                raise ValueError(f"max_grad_norm has {len(max_grad_norm)} values for "
                                 f"{len(self.param_groups)} parameter groups; give one C per "
                                 f"group (per-layer clipping) or a single number")
            return [check_max_grad_norm(C) for C in max_grad_norm]
        return check_max_grad_norm(max_grad_norm)

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

    def detach(self) -> None:
        """Remove the recording hooks; the model is as it was before ``make_private``."""
        self.recorder.close()

    def verify_next_step(self) -> None:
        """Verify the next step whatever its call signature (``recorded.py``)."""
        self._verify_next = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.recorder.clear()
        self._zeroed = True

    def reset_virtual_step(self) -> None:
        """Drop the partial sums of an unfinished logical batch (a virtual-step loop that was
        left early): those samples were sampled for that batch, not for the next one."""
        if self._sums or self.expect_more:
            warnings.warn("a logical batch was left unfinished (the loop over the virtual-step "
                          "loader stopped before its last chunk); its partial clipped sums are "
                          "discarded and no step was taken for it", stacklevel=3)
        self._sums, self.expect_more = {}, False

    def accumulate_clipped_sum(self, scale=None) -> None:
        """Add this (physical) batch's Σ_i c_i g_i to the running sums: every backward pass
        since the last step is a batch of its own samples, clipped one by one. ``scale``: a
        GradScaler's scale, divided out first."""
        C, group_of = self._clip_spec()
        check = "always" if self.verify == "always" or self._verify_next else self.verify
        self.recorder.watch.check = check is not False
        self.recorder.watch.close()  # the loop's loss calls are in: the probes' are not
        norms, factors, modes, replays, paths = [], [], [], [], {}
        try:
            with self.recorder.paused():  # the samplers may call the layers themselves
                for rec, exact in self.recorder.batches(self.loss_reduction, check, scale):
                    if rec.n == 0:
                        continue
                    mode = self.grad_sample_mode
                    if mode == "auto":  # einsum or book-keeping, by clipping/auto.py's rule
                        mode = choose_mode(rec)[0]
                    modes.append(mode)
                    if rec.signature is not None:  # before clipping frees the backprops
                        for key, g in self.recorder.path_gradient(rec, exact).items():
                            paths[key] = g if key not in paths else paths[key] + g
                    sums, norm, c = clipped_sum(rec, C, mode, group_of, exact=exact)
                    if rec.signature is not None:
                        replays.append((rec, norm[rec.n - 1].detach()))
                    for key, s in sums.items():
                        self._sums[key] = s if key not in self._sums else self._sums[key] + s
                    norms.append(norm.detach())
                    factors.append(c.detach())
            self.recorder.clear(keep_pending=True)  # the checks' extra passes: on freed memory
            self.recorder.watch.probe()
            for rec, norm in replays:
                self._verify(rec, norm)
            if paths:
                self._check_path(paths)
        except Exception:
            self._sums = {}  # nothing of a refused batch is kept for a later step
            self.recorder.clear()
            raise
        self._verify_next = False
        self.last = {"norms": torch.cat(norms) if norms else torch.zeros(0),
                     "clip_factors": torch.cat(factors) if factors else torch.zeros(0),
                     "mode": modes[-1] if modes else None}  # the mode "auto" chose

    def _verify(self, rec, norm) -> None:
        """Record n - 1's ||g_i|| against its exact twin; then the verdict is remembered."""
        if rec.replay is not None:  # randomness: the record probe (selfcheck.py)
            ref = self.recorder.replay_probe(rec, *rec.replay)
        else:
            ref = rec.probe
        rec.replay = None
        selfcheck.compare_norm(rec, norm, ref)
        selfcheck.remember(self.recorder.model, rec.signature, dict(rec.fallback))

    def _check_path(self, paths: dict) -> None:
        """The user's ``.grad`` must be Σ_i g_i: what flowed through the model's output."""
        if distributed_run(self.model) or not (self._zeroed or all(
                p.grad is not self._released.get(id(p)) for p in self.recorder.params.values())):
            return  # .grad is all-reduced, or holds an earlier step's: not this batch's sum
        pairs = {}
        for name, p in self.recorder.params.items():
            user = torch.zeros_like(p) if p.grad is None else p.grad.detach()
            pairs[name] = (user, paths.get(id(p), torch.zeros_like(p)).to(user.dtype))
        # .grad rescaled as a whole after backward (clip_grad_norm_, an unscale_) is
        # harmless here (DP-SGD never reads it): compare with the best common factor
        dot = sum(float((u.double() * o.double()).sum()) for u, o in pairs.values())
        sq = sum(float(o.double().pow(2).sum()) for _, o in pairs.values())
        alpha = dot / sq if sq > 0 else 1.0
        diffs = [(float((u.double() - alpha * o.double()).norm()), name)
                 for name, (u, o) in pairs.items()]
        total = sum(d * d for d, _ in diffs)
        scale = max(max(float(u.double().norm()), abs(alpha) * float(o.double().norm()))
                    for u, o in pairs.values())
        tol = selfcheck.TOLERANCE.get(next(iter(self.recorder.params.values())).dtype, 1e-3)
        if total ** 0.5 <= tol * scale + 1e-12:
            return
        worst = [name for d, name in sorted(diffs, reverse=True)[:3] if d > 0]
        raise UnattributedGradientError(
            f"the gradient of the loss in .grad differs from the sum of the per-record "
            f"gradients by {total ** 0.5:.3g} (relative {total ** 0.5 / max(scale, 1e-300):.3g})"
            f", mostly in {', '.join(worst)}: a term of the loss reaches these parameters "
            f"outside the model's output (an L2 penalty lambda * ||theta||^2, a loss reading a "
            f"parameter directly), and DP-SGD can neither clip it per record nor drop it "
            f"silently. For an L2 penalty use the optimizer's weight_decay (= 2 lambda for "
            f"SGD; data-independent, it is applied outside the noise); move any other "
            f"parameter-dependent term into the model's forward")

    def privatise(self) -> None:
        """p.grad = (Σ_i c_i g_i + N(0, σ²C² I)) / B for every trainable parameter.

        Also records the update's signal ||Σ_i c_i g_i|| / B and the noise's expected norm
        σ C √d / B (d trainable coordinates) in ``self.last``: their ratio is the gradient
        signal-to-noise ratio of this step.
        """
        std = self.noise_multiplier * self.clip_norm_total
        distributed = dist.is_available() and dist.is_initialized()
        adds_noise = not distributed or dist.get_rank() == 0  # noise exactly once
        signal_sq, d = 0.0, 0
        names = {id(p): k for k, p in self.model.named_parameters()}
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                total = self._sums.get(id(p), torch.zeros_like(p)).detach().clone()
                if distributed:  # Σ over all ranks' samples, each clipped on its own rank
                    signal = total.clone()
                    all_reduce(signal, timeout_minutes=self.all_reduce_timeout_minutes,
                               name=f"clipped sum of {names.get(id(p), 'a parameter')}")
                    signal_sq += float(signal.pow(2).sum())
                else:
                    signal_sq += float(total.pow(2).sum())
                if adds_noise:
                    total += gaussian_noise(p, std, self.generator)
                if distributed:
                    all_reduce(total, timeout_minutes=self.all_reduce_timeout_minutes,
                               name=f"noised sum of {names.get(id(p), 'a parameter')}")
                d += p.numel()
                p.grad = total / self.expected_batch_size
        self._sums = {}
        self.recorder.drop_outside_grads()  # no parameter keeps a non-private gradient
        B = self.expected_batch_size
        self.last["signal"] = signal_sq ** 0.5 / B
        self.last["noise"] = std * d ** 0.5 / B

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.recorder.check_step()  # a fresh backward since the last step, same model
        self.accumulate_clipped_sum(self._amp_scale())
        if self.expect_more:
            self._mark_released()
            return loss  # a virtual step: noise comes with the logical batch's last chunk
        self.privatise()
        self._mark_released()
        self.original_optimizer.step()
        if self.on_step is not None:
            self.on_step(self.noise_multiplier)
        return loss

    def _mark_released(self) -> None:
        """The .grad tensors now held: a later backward adding into them is not fresh."""
        self._released = {id(p): p.grad for p in self.recorder.params.values()}
        self._zeroed = False

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
