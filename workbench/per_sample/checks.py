"""Input validation shared by every per-sample gradient method.

Each check raises a specific exception that names the argument (or module path), the value
received and the fix, before any expensive work starts.
"""

from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils._pytree import tree_map

from workbench.errors import (
    LossShapeError,
    SampleMixingError,
    UnsupportedLayerError,
    WorkbenchError,
)
from workbench.per_sample.leaves import leaves


def batch_size(inputs) -> int:
    """Size of dim 0 of ``inputs`` (a Tensor, or a tuple/list of Tensors batched alike), or
    the n of a recorded ``ModelCall`` (the optimizer's whole-model fallback on a model called
    with keywords: a TypeError until 2026-11-30)."""
    if isinstance(inputs, ModelCall):
        return inputs.n
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0:
            raise ValueError("inputs is a 0-dim tensor; the batch must be dim 0 of inputs, "
                             "e.g. shape (n, features)")
        return inputs.shape[0]
    if isinstance(inputs, (tuple, list)) and inputs and all(
        isinstance(x, torch.Tensor) for x in inputs
    ):
        sizes = {x.shape[0] if x.dim() else None for x in inputs}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"inputs: all tensors must share the batch size on dim 0; got "
                             f"shapes {[tuple(x.shape) for x in inputs]}")
        return sizes.pop()
    raise TypeError(f"inputs must be a Tensor or a tuple of Tensors (passed to model(*inputs)); "
                    f"got {type(inputs).__name__}")


def check_batch(inputs, targets) -> int:
    """Batch size n, after checking inputs and targets agree and the batch is not empty."""
    n = batch_size(inputs)
    if n == 0:
        raise ValueError("inputs is an empty batch (n = 0): there are no per-sample gradients "
                         "to compute; pass at least one sample")
    if targets is not None:
        m = batch_size(targets)
        if m != n:
            raise ValueError(f"inputs and targets have different batch sizes: inputs has n = {n} "
                             f"on dim 0, targets has {m}; pass one target per sample")
    return n


def check_losses(losses, n: int) -> None:
    """``loss_fn`` must return one loss per sample: a Tensor of shape (n,)."""
    if not isinstance(losses, torch.Tensor):
        raise LossShapeError(f"loss_fn must return a Tensor of shape (n,) = ({n},); "
                             f"got {type(losses).__name__}")
    if losses.dim() == 0:
        raise LossShapeError("loss_fn returned a scalar, so the per-sample losses were already "
                             "reduced; use reduction='none' (e.g. nn.CrossEntropyLoss("
                             "reduction='none')) so it returns one loss per sample, shape (n,)")
    if tuple(losses.shape) != (n,):
        raise LossShapeError(f"loss_fn must return one loss per sample, shape ({n},); got shape "
                             f"{tuple(losses.shape)}. Sum or average over the non-batch "
                             f"dimensions inside loss_fn")


SCALAR_OUTPUT = (
    "the loss used a 0-dim output of the model (a value over the whole batch: a router's "
    "load-balancing term such as Mixtral's aux_loss, a reconstruction error summed over the "
    "records inside forward): each record's gradient is read from its rows of the model's "
    "outputs, and a scalar has none, so its gradient would be spread over the records by the "
    "layers it came through, coupled to every other record. Return that term per record, "
    "shape (n,), and add it to the loss; or drop it (output_router_logits=False)")


def scalar_output_problem(outputs, losses, paused) -> str | None:
    """``SCALAR_OUTPUT`` when ``losses`` (the batch's, (n,)) have gradient through a 0-dim
    floating output of the model, else None: the batched methods' twin of the optimizer's
    check (``dpsgd.recorded.output_rows_problem``). Mixtral's aux_loss, computed partly in
    float32, added to a float64 per-record loss was 59% off on the router's weight with
    ghost clipping, under the float32 self-check's tolerance, until 2026-12-02. Only the
    loss's part of the graph is walked (the gradient stops at the outputs); ``paused``: the
    recorders' pause, so their hooks ignore this pass."""
    scalars = [t for t in leaves(outputs) if isinstance(t, torch.Tensor) and t.dim() == 0
               and t.is_floating_point() and t.requires_grad]
    if not scalars or not losses.requires_grad:
        return None
    with paused(), torch.enable_grad():
        got = torch.autograd.grad(losses.sum(), scalars, retain_graph=True, allow_unused=True)
    if any(g is not None and bool(g.ne(0).any()) for g in got):
        return SCALAR_OUTPUT
    return None


def check_no_sample_mixing(model: nn.Module) -> None:
    """Raise SampleMixingError for the first layer that mixes samples of a batch."""
    for path, module in model.named_modules():
        problem = sample_mixing_problem(module)
        if problem:
            raise SampleMixingError(f"{type(module).__name__} at {path or '<model>'} {problem}")


def sample_mixing_problem(module: nn.Module) -> str | None:
    """Why ``module`` mixes samples (and the fix), or None when it does not."""
    if isinstance(module, _BatchNorm) and not frozen_statistics(module):  # SyncBatchNorm too
        return ("mixes samples (in training mode, or without running statistics, it "
                "normalises with the batch's statistics and writes them into its running "
                "statistics), so per-sample gradients are undefined; use wb.fix_model(model) "
                "to replace it with GroupNorm, or keep it in eval mode with the running "
                "statistics it has (a per-channel affine map then, e.g. statistics from "
                "public pre-training): after model.train(), call .eval() on each BatchNorm, "
                "for m in model.modules(): if isinstance(m, nn.modules.batchnorm._BatchNorm): "
                "m.eval()")
    if isinstance(module, _InstanceNorm) and module.track_running_stats:  # (its rule
        # normalises by each record's own statistics, not by running ones in eval mode)
        return ("has track_running_stats=True, so its running statistics mix samples; "
                "use track_running_stats=False or wb.fix_model(model)")
    return None


def statistics_layers(model: nn.Module) -> list:
    """(path, module) of the model's BatchNorm layers: accepted with frozen statistics, so
    checked at every pass (``norms_mixing``)."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, _BatchNorm)]


def norms_mixing(norms) -> SampleMixingError | None:
    """The SampleMixingError for the first of ``norms`` (``statistics_layers``) that mixes
    samples now: one put back in training mode after the optimizer was made with its
    statistics frozen (``model.train()`` in the loop) normalises by the batch."""
    for path, module in norms:
        problem = sample_mixing_problem(module)
        if problem:
            return SampleMixingError(f"{type(module).__name__} at {path or '<model>'} "
                                     f"{problem}")
    return None


@contextmanager
def evaluating(model: nn.Module):
    """``model.eval()`` for the block, then every module's own mode back: ``model.train(
    was_training)`` on the root put a frozen BatchNorm back in training mode (the training
    loop's accuracy, perplexity, sampling: refused at the next step, until 2026-11-30)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def train_keeping_frozen(model: nn.Module) -> nn.Module:
    """``model.train()``, but a BatchNorm whose statistics were frozen (eval mode, running
    statistics: ``frozen_statistics``) stays so, as a private fine-tuning loop keeps it: the
    audits' replays of a step (``audit/influence_steps.py``) ran it in training mode, a
    batch statistic, and refused a model the optimizer trains (until 2026-11-30)."""
    frozen = [m for m in model.modules() if isinstance(m, _BatchNorm) and frozen_statistics(m)]
    model.train()
    for m in frozen:
        m.eval()
    return model


def frozen_statistics(module: nn.Module) -> bool:
    """A BatchNorm that normalises with its fixed running statistics (eval
    mode, both present): (x - μ) / σ · γ + β per channel, each record alone, nothing written
    (refused by type, in any mode, until 2026-11-30: freezing a pre-trained model's batch
    statistics is the usual way to fine-tune it privately). Checked again at every pass
    (``model.train()`` turns it back into a batch statistic)."""
    return not module.training and getattr(module, "running_mean", None) is not None \
        and getattr(module, "running_var", None) is not None


def buffer_ids(model: nn.Module) -> set[int]:
    """ids of the model's buffers now (before a forward pass: ``state_written_from_batch``)."""
    return {id(b) for m in model.modules() for b in m._buffers.values() if b is not None}


def state_written_from_batch(model: nn.Module, written, aliased=lambda t: False,
                             before=frozenset()) -> SampleMixingError | None:
    """The SampleMixingError for the first buffer or parameter the forward pass wrote from the
    batch's values (``written(t)``: whether t was computed from, or written in place with, a
    tensor computed from the model's inputs, ``derived.Taint.has``): a custom running mean
    ``self.running_mean.mul_(0.9).add_(0.1 * h.mean(0))``, a buffer rebound to a statistic of
    the batch, a data-dependent initialisation ``self.bias.copy_(-x.mean(0))`` (Glow's
    ActNorm). Its value is an unclipped, un-noised function of the records, kept in the model
    the steps release and read by later steps, so no step's (ε, δ) covers it; the type check
    above knows BatchNorm and InstanceNorm, this one any layer, by what it did. A write
    through an alias (``self.running_mean.data.mul_(...)``: another tensor object, its
    storage the buffer's) is found by storage (``aliased``), for the parameters and the
    buffers that existed before the pass (``before``: ids; a buffer made during the pass may
    sit where a freed activation was)."""
    for module in model.modules():  # names only for the one found: this runs every pass
        for kind, table in (("buffer", module._buffers), ("parameter", module._parameters)):
            for attr, t in table.items():
                if t is not None and (written(t) or (
                        (kind == "parameter" or id(t) in before) and aliased(t))):
                    path = next(p for p, m in model.named_modules() if m is module)
                    return SampleMixingError(
                        f"{type(module).__name__} at {path or '<model>'} wrote its {kind} "
                        f"{attr!r} from the batch during the forward pass: its value is a "
                        f"statistic of the records, kept in the model (and in its state_dict) "
                        f"with no clipping and no noise, so DP-SGD's guarantee does not cover "
                        f"it. Compute it from public data outside the private loop, or keep it "
                        f"fixed while training privately (write it only when not "
                        f"module.training), or replace the layer (wb.fix_model for "
                        f"BatchNorm-like layers)")
    return None


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: param}`` of trainable parameters, keyed like ``model.named_parameters()``.

    A Parameter shared by two modules appears once, under its first name (as in PyTorch).
    A complex one is refused by name: the rules, norms and checks are written for real
    gradients (an einsum rule without the conjugate was 120% off; the optimizer's probe
    raised PyTorch's "grad can be implicitly created only for real scalar outputs").
    """
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    for name, p in params.items():
        if p.is_complex():
            raise UnsupportedLayerError(
                f"parameter {name} is complex ({p.dtype}): per-sample gradients, their norms "
                f"and the clipped sum are defined here for real parameters only. Keep the "
                f"real and imaginary parts as two real parameters (torch.view_as_real) and "
                f"build the complex weight from them in forward")
    return params


class ModelCall(NamedTuple):
    """A recorded call ``model(*args, **kwargs)`` of a batch of n (dict and nested inputs)."""

    args: tuple
    kwargs: dict
    n: int


def forward(model: nn.Module, inputs):
    """``model(inputs)``, ``model(*inputs)`` for a tuple/list of Tensors, or a ModelCall."""
    if isinstance(inputs, ModelCall):
        return model(*inputs.args, **inputs.kwargs)
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


ALONE_ERRORS = (RuntimeError, ValueError, IndexError, TypeError)


def batch_runs(model, loss_fn, inputs, targets) -> bool:
    """Whether the model and the loss run on the whole batch (no grad). A record alone that
    fails where the batch fails too (a float32 input to a float64 model, a wrong shape) failed
    for the inputs' own reason, not for lack of the other records: its error is the user's to
    see as it is, not a coupling refusal (a misleading SampleMixingError until 2026-11-30)."""
    try:
        with torch.no_grad():
            loss_fn(forward(model, inputs), targets)
    except Exception:  # noqa: BLE001  (any error: the batch does not run either)
        return False
    return True


@contextmanager
def alone(kinds=ALONE_ERRORS, whole=None):
    """Around the model and the loss run on one record (or a few) taken from the batch: the
    exact twins (micro-batching, the self-check's probe) run every record on its own. A model
    or loss that cannot (``x1, x2 = x.chunk(2)``, ``x[:k]`` padded back to n, a reshape to a
    fixed batch, a loss needing two records) computes a record's result from its position or
    the batch's size: it couples the records. The raw error it raised alone (an unpacking
    error, a batch-size mismatch) said nothing of that, until 2026-11-29."""
    try:
        yield
    except kinds as err:  # method='vmap': not RuntimeError, its own limits' (functional.py)
        if isinstance(err, WorkbenchError) or (whole is not None and not whole()):
            raise  # ``whole``: () -> whether the batch runs (``batch_runs``); if not, the
            # record's error is the inputs' own
        raise SampleMixingError(
            f"the model and loss cannot run on one record alone ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160]}), which every exact per-record gradient "
            f"does: their computation depends on the batch's size or on the records' "
            f"positions in it (x.chunk(2), x[:k], a reshape to a fixed batch size, a loss "
            f"over pairs of records), so record i's gradient is not a function of record i "
            f"and DP-SGD's per-record clipping does not bound its influence. Make the model "
            f"and loss treat each record on its own (a pair as one record: stack it along "
            f"dim 1)") from err


def dense(t):
    """``t`` in the default (contiguous) memory format when it is a 4-D or 5-D Tensor in
    another (channels_last): a layer re-run on its recorded input, which requires no grad,
    met PyTorch 2.13's CPU GroupNorm backward on such an input, which crashes the process
    (a segmentation fault, timm's ``GroupNorm1Act`` in a channels_last model, until
    2026-11-29). The values are the same; only their layout changes."""
    if isinstance(t, torch.Tensor) and t.dim() in (4, 5) and not t.is_contiguous():
        return t.contiguous()
    return t


def take(batch, index: slice):
    """Rows ``index`` of a Tensor, or of each Tensor in a tuple/list (None stays None), or of
    each Tensor with n rows in a ModelCall."""
    if batch is None:
        return None
    if isinstance(batch, ModelCall):
        def rows(t):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch.n:
                return t[index]
            return t

        args, kwargs = tree_map(rows, (batch.args, batch.kwargs))
        return ModelCall(args, kwargs, len(range(batch.n)[index]))
    if isinstance(batch, (tuple, list)):
        return type(batch)(x[index] for x in batch)
    return batch[index]


__all__ = [
    "ModelCall", "batch_runs", "batch_size", "buffer_ids", "check_batch", "check_losses",
    "dense", "alone", "check_no_sample_mixing", "forward", "state_written_from_batch",
    "sample_mixing_problem", "take", "trainable_parameters", "frozen_statistics",
    "norms_mixing", "statistics_layers", "evaluating", "train_keeping_frozen",
    "SCALAR_OUTPUT", "scalar_output_problem",
]
