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

**Non-finite records** (a NaN or inf per-sample gradient) are left out of the sum, counted in
``last["nonfinite"]`` (indices in ``last["nonfinite_indices"]``) and warned about; a batch of
n >= 2 records that are all non-finite raises (``clipping/nonfinite.py`` says why).

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
from workbench.clipping.nonfinite import skip_nonfinite, warn_skipped
from workbench.dpsgd.distributed import DEFAULT_TIMEOUT_MINUTES, all_reduce
from workbench.dpsgd.privatise import gaussian_noise
from workbench.dpsgd.recorded import ModelRecorder
from workbench.per_sample.checks import check_no_sample_mixing


class DPOptimizer(Optimizer):
    """Wraps ``optimizer``; records ``model``'s layer calls; steps with DP-SGD gradients."""

    def __init__(self, optimizer: Optimizer, model: torch.nn.Module, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float,
                 grad_sample_mode: str = "auto", loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, on_step=None):
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
        self.recorder = ModelRecorder(model, self.param_groups)
        self.verify = "first"  # "first" step, "always", or False: see verify_next_step()
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
        """Check the next step against micro-batching on one sample (``recorded.py``)."""
        self.verify = "always" if self.verify == "always" else "next"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.recorder.clear()

    def reset_virtual_step(self) -> None:
        """Drop the partial sums of an unfinished logical batch (a virtual-step loop that was
        left early): those samples were sampled for that batch, not for the next one."""
        if self._sums or self.expect_more:
            warnings.warn("a logical batch was left unfinished (the loop over the virtual-step "
                          "loader stopped before its last chunk); its partial clipped sums are "
                          "discarded and no step was taken for it", stacklevel=3)
        self._sums, self.expect_more = {}, False

    def accumulate_clipped_sum(self) -> None:
        """Add this (physical) batch's Σ_i c_i g_i to the running sums: every backward pass
        since the last step is a batch of its own samples, clipped one by one."""
        C, group_of = self._clip_spec()
        verify = self.verify in ("first", "next", "always")
        norms, factors, modes, skipped, seen = [], [], [], [], 0
        with self.recorder.paused():  # the samplers may call the layers themselves
            for rec, exact in self.recorder.batches(self.loss_reduction, verify):
                if rec.n == 0:
                    continue
                mode = self.grad_sample_mode
                if mode == "auto":  # einsum or book-keeping, by clipping/auto.py's rule
                    mode = choose_mode(rec)[0]
                modes.append(mode)
                sums, norm, c = clipped_sum(rec, C, mode, group_of, exact=exact)
                self.recorder.verify(rec, norm)
                skipped += [seen + i for i in skip_nonfinite(norm)]  # masked by the engine
                seen += rec.n
                for key, s in sums.items():
                    self._sums[key] = s if key not in self._sums else self._sums[key] + s
                norms.append(norm.detach())
                factors.append(c.detach())
        if verify and self.verify != "always":
            self.verify = False
        self.last = {"norms": torch.cat(norms) if norms else torch.zeros(0),
                     "clip_factors": torch.cat(factors) if factors else torch.zeros(0),
                     "mode": modes[-1] if modes else None,  # the mode "auto" chose
                     "nonfinite": len(skipped), "nonfinite_indices": skipped}
        warn_skipped(skipped, seen)
        self.recorder.clear()

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
        self.accumulate_clipped_sum()
        if self.expect_more:
            return loss  # a virtual step: noise comes with the logical batch's last chunk
        self.privatise()
        self.original_optimizer.step()
        if self.on_step is not None:
            self.on_step(self.noise_multiplier)
        return loss

    def state_dict(self):
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)
