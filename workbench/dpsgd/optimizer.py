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

**Empty batches** still step: the clipped sum is zero and the noise is added; skipping would
reveal that the batch was empty.

Notation: n realised batch size, C max_grad_norm, σ noise multiplier, q sample rate, N data
set size, B = qN.
"""

import math

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from workbench.clipping.flat import check_max_grad_norm
from workbench.clipping.ghost import LayerCalls
from workbench.dpsgd.privatise import MODES, clipped_sum, gaussian_noise
from workbench.per_sample.checks import check_no_sample_mixing
from workbench.per_sample.einsum import check_layers, check_recorded, layers_with_parameters
from workbench.per_sample.hooks import ActivationRecorder


def check_noise_multiplier(noise_multiplier) -> float:
    sigma = float(noise_multiplier)
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"noise_multiplier must be a finite number >= 0 (σ, the noise std in "
                         f"units of max_grad_norm); got {noise_multiplier!r}")
    return sigma


class DPOptimizer(Optimizer):
    """Wraps ``optimizer``; records ``model``'s layer calls; steps with DP-SGD gradients."""

    def __init__(self, optimizer: Optimizer, model: torch.nn.Module, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float,
                 grad_sample_mode: str = "einsum", loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, on_step=None):
        if grad_sample_mode not in MODES:
            raise ValueError(f"grad_sample_mode must be one of {MODES}; got {grad_sample_mode!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' (criterion averages over the batch)"
                             f" or 'sum'; got {loss_reduction!r}")
        if not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0 (q N); got {expected_batch_size!r}")
        check_no_sample_mixing(model)
        super().__init__(optimizer.param_groups, optimizer.defaults)  # creates the hook tables
        self.__dict__["original_optimizer"] = optimizer  # from now on the properties delegate
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.max_grad_norm = self._check_clip_norms(max_grad_norm)
        self.expected_batch_size = float(expected_batch_size)
        self.grad_sample_mode = grad_sample_mode
        self.loss_reduction = loss_reduction
        self.generator = generator
        self.on_step = on_step  # called as on_step(noise_multiplier) after each logical step
        self.expect_more = False  # set by a virtual-step loader: more chunks of this batch
        self.model = model
        self.layers = layers_with_parameters(model)
        check_layers(self.layers, strict=False)
        self.recorder = ActivationRecorder(self.layers, capture="hooks").__enter__()
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
        """(max_grad_norm argument, group_of) for ``privatise.clipped_sum``."""
        if not isinstance(self.max_grad_norm, list):
            return self.max_grad_norm, None
        group = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        return dict(enumerate(self.max_grad_norm)), lambda p: group.get(id(p))

    def detach(self) -> None:
        """Remove the recording hooks; the model is as it was before ``make_private``."""
        self.recorder.__exit__(None, None, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.recorder.clear()

    def _batch_calls(self) -> LayerCalls:
        check_recorded(self.layers, self.recorder)
        calls = [c for cs in self.recorder.calls.values() for c in cs if c.backprops is not None]
        params = [p for g in self.param_groups for p in g["params"]]
        n = calls[0].backprops.shape[0] if calls else 0
        if any(c.backprops.shape[0] != n for c in calls):
            raise RuntimeError("the recorded layer calls have different batch sizes: call "
                               "optimizer.zero_grad() before each forward pass and step() after "
                               "each backward pass")
        if self.loss_reduction == "mean":
            for call in calls:  # a mean-reduced loss scaled every b_i by 1/n
                call.backprops = call.backprops * n
        return LayerCalls(n, self.layers, self.recorder, params[0].dtype, params[0].device)

    def accumulate_clipped_sum(self) -> None:
        """Add this (physical) batch's Σ_i c_i g_i to the running sums."""
        calls = self._batch_calls()
        if calls.n == 0:
            self.last = {"norms": torch.zeros(0), "clip_factors": torch.zeros(0)}
            return
        C, group_of = self._clip_spec()
        with self.recorder.paused():  # the samplers may call the layers themselves
            sums, norms, c = clipped_sum(calls, C, self.grad_sample_mode, group_of)
        for key, s in sums.items():
            self._sums[key] = s if key not in self._sums else self._sums[key] + s
        self.last = {"norms": norms.detach(), "clip_factors": c.detach()}
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
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                total = self._sums.get(id(p), torch.zeros_like(p)).detach().clone()
                if distributed:  # Σ over all ranks' samples, each clipped on its own rank
                    signal = total.clone()
                    dist.all_reduce(signal)
                    signal_sq += float(signal.pow(2).sum())
                else:
                    signal_sq += float(total.pow(2).sum())
                if adds_noise:
                    total += gaussian_noise(p, std, self.generator)
                if distributed:
                    dist.all_reduce(total)
                d += p.numel()
                p.grad = total / self.expected_batch_size
        self._sums = {}
        B = self.expected_batch_size
        self.last["signal"] = signal_sq ** 0.5 / B
        self.last["noise"] = std * d ** 0.5 / B

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
