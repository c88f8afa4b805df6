"""Per-sample gradients with torch.func: ``vmap(grad(loss of one sample))``.

The model is turned into a pure function of its parameters with
``torch.func.functional_call``; ``grad`` differentiates the loss of *one* sample, and ``vmap``
maps that over the batch (the approach of JAX and of the torch.func "per-sample gradients"
tutorial; Yousefpour et al. 2021, arXiv 2109.12298, §3 compare it with hooks):

    g_i = (vmap_i ∘ grad_θ) ℓ(f(x_i; θ), y_i)

The same machinery gives the *fallback* for a single layer without a registered grad sampler:
the per-sample gradient of a layer output o_i = h(a_i; w) is the vector-Jacobian product
g_i = (∂o_i/∂w)^T b_i with the captured backprop b_i, computed by ``vmap(vjp)``.

**One value per slot.** ``functional_call`` swaps each named tensor into its module for the
call and swaps the originals back after it. A module registered under two parents (VB-LoRA's
vector bank, one ``ParameterDict`` in every adapted layer; any shared submodule) has one slot,
``module._parameters[name]``, reached by several dotted names, and ``tie_weights=True`` swaps
it once per name: the second swap saves the first's substitute as the "original", so the
restore leaves the substitute in the model (a plain, detached or vmap-wrapped tensor in place
of the Parameter: the parameter silently drops out of every later call). ``slot_values``
names every slot exactly once (``named_modules`` visits a shared module once) and gives each
the value of its tensor, so a Parameter tied across two modules (a tied head) still gets its
substitute in both, with ``tie_weights=False``.

Notation: n batch size, θ trainable parameters, a activations, b backprops.
"""

import warnings

import torch
from torch.func import functional_call, grad, vjp, vmap
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from workbench.errors import UnsupportedLayerError, WorkbenchError
from workbench.per_sample import precision
from workbench.per_sample.checks import (
    alone,
    batch_runs,
    check_batch,
    check_losses,
    dense,
    trainable_parameters,
)
from workbench.per_sample.hooks import bare, output_tensors
from workbench.per_sample.microbatch import layer_microbatch_grad_sampler


def _one_sample(x):
    """Give a sample (vmapped, so without batch dim) its batch dimension of size 1 back."""
    return x.unsqueeze(0) if isinstance(x, torch.Tensor) else x


def _as_rows(x):
    """A sample's T rows of a call on batch-flattened rows: as the call flattened them."""
    return x


def slot_values(model, values: dict) -> dict:
    """{dotted name: tensor} naming each parameter and buffer slot of ``model`` once (module
    docstring), valued ``values[id(t)]`` for the tensors t in ``values``, t.detach() for the
    others: what ``functional_call(..., tie_weights=False)`` swaps in and out exactly once."""
    out = {}
    for path, module in model.named_modules():  # a shared module: once, under its first path
        prefix = f"{path}." if path else ""
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    out[prefix + name] = values.get(id(t), t.detach())
    return out


def vmap_per_sample_gradients(model, loss_fn, inputs, targets, names=None):
    """``{name: Tensor(n, *param.shape)}`` by ``vmap(grad(...))`` over the batch.

    Randomness inside the model (dropout) is drawn independently per sample
    (``randomness="different"``), as in an ordinary batched forward pass. ``names``: only
    these trainable parameters (the others are held fixed), e.g. the exact fallback's.
    """
    check_batch(inputs, targets)
    chosen = {k: p for k, p in trainable_parameters(model).items()
              if names is None or k in names}
    params = {k: p.detach() for k, p in chosen.items()}
    many = isinstance(inputs, (tuple, list))

    def loss_of_one(p, x, y):
        args = tuple(_one_sample(v) for v in x) if many else (_one_sample(x),)
        values = slot_values(model, {id(chosen[k]): v for k, v in p.items()})
        with _reparametrize_module(model, values, tie_weights=False):  # functional_call's
            # swap, held over the loss too: a loss reading a parameter (an L2 term, a
            # learned temperature) differentiates the swapped one (dropped until 2026-11-29)
            out = model(*args)
            with CapturedParameters(originals):  # one held in loss_fn's closure: refused
                loss = loss_fn(out, tree_map(_one_sample, y))  # (1,); tuple targets by row
        check_losses(loss, 1)
        return loss.sum()

    originals = {id(p): k for k, p in chosen.items()}
    in_dims = (None, 0, None if targets is None else 0)
    per_sample = vmap(grad(loss_of_one), in_dims=in_dims, randomness="different")
    return per_sample(params, tuple(inputs) if many else inputs, targets)


class CapturedParameters(TorchFunctionMode):
    """Around loss_fn under vmap: an op on a trainable parameter itself (not the swapped
    value the module attribute holds during the call) is a parameter loss_fn captured before
    (``w = model.head.weight``), whose gradient vmap cannot take: refused by name."""

    def __init__(self, originals: dict):
        super().__init__()
        self.originals = originals

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(a, torch.Tensor) and id(a) in self.originals:
                raise UnsupportedLayerError(
                    f"loss_fn reads the parameter {self.originals[id(a)]} through a reference "
                    f"it holds itself: method='vmap' differentiates the parameters it swaps "
                    f"into the model, and that reference is not one of them (its gradient "
                    f"would be dropped). Read it through the model (model.<path>.weight) "
                    f"inside loss_fn, or use method='einsum' or 'microbatch'")
        return func(*args, **(kwargs or {}))


def check_vmappable(model) -> None:
    """Layers whose forward torch.func.vmap cannot run: a clear error before the attempt."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and (module.max_norm is not None
                                                        or module.sparse):
            option, why = ("max_norm", "it renormalises the weight in place") \
                if module.max_norm is not None else \
                ("sparse=True", "its sparse gradients have no batching rule")
            raise UnsupportedLayerError(
                f"Embedding at {path or '<model>'} uses {option}, which torch.func.vmap cannot "
                f"run ({why}); use method='microbatch', or drop {option}")


def vmap_or_explain(model, loss_fn, inputs, targets):
    """``vmap_per_sample_gradients``, turning torch.func's internal errors into one that
    says what in the model vmap cannot run, and what to use instead."""
    check_vmappable(model)
    check_batch(inputs, targets)  # the arguments' own errors, before alone() reads any
    # error as the model's need for its batch (a misleading SampleMixingError until 2026-11-29)
    try:
        with alone((ValueError, IndexError, TypeError),  # a model needing its batch
                   whole=lambda: batch_runs(model, loss_fn, inputs, targets)):
            return vmap_per_sample_gradients(model, loss_fn, inputs, targets)
    except WorkbenchError:
        raise
    except (RuntimeError, NotImplementedError) as error:
        if not batch_runs(model, loss_fn, inputs, targets):
            raise  # the batch fails too: the inputs' own error, not vmap's (checks.py)
        p0 = next(model.parameters(), None)
        amp = None if p0 is None else precision.state(p0.device)
        if amp is not None:
            raise UnsupportedLayerError(
                f"method='vmap' cannot run this model under torch.autocast({amp}): "
                f"torch.func.vmap's backward failed with {type(error).__name__}: "
                f"{str(error).splitlines()[0][:160]} (torch's batching rules do not support "
                f"every mixed-precision backward, e.g. a LayerNorm on a {amp} input). Use "
                f"method='einsum' or 'microbatch', which are exact under autocast, or call "
                f"outside the autocast block") from error
        raise UnsupportedLayerError(
            f"method='vmap' cannot run this model: torch.func.vmap failed with "
            f"{type(error).__name__}: {str(error).splitlines()[0][:200]}. Models that pack "
            f"sequences (PackedSequence), update buffers in place, call .item() or branch on "
            f"data cannot be vmapped; method='einsum' or 'microbatch' are exact for them") \
            from error


def layer_vmap_grad_sampler(layer, args, kwargs, backprops, flat: bool = False):
    """Per-sample gradients of one layer's own trainable parameters by ``vmap(vjp)``.

    Used for layers without a registered grad sampler. Every Tensor argument of the layer
    is assumed to carry the batch on dim 0 (non-Tensor arguments are passed through).
    A forward torch.func cannot run (a ``torch.autograd.Function`` without
    ``setup_context``, a sparse op, ``.item()``) is re-run one record at a time instead
    (``microbatch.layer_microbatch_grad_sampler``: the same vector-Jacobian products, a loop),
    with a warning once per layer type: exact, n times the layer's cost.

    ``flat``: the call ran on batch-flattened rows (``flat_rows.rule_less_rows``: every
    Tensor given here as (n, T, ...)); each sample's call then gets its T rows as they were
    flattened, (1·T, ...) = (T, ...), as it got them in the batch.
    """
    try:
        return _layer_vmap(layer, args, kwargs, backprops, flat)
    except (RuntimeError, NotImplementedError) as error:
        kind = type(layer)
        if kind not in _LOOPED:
            _LOOPED.add(kind)
            warnings.warn(f"torch.func.vmap cannot run the forward of {kind.__name__} "
                          f"({type(error).__name__}: {str(error).splitlines()[0][:160]}); its "
                          f"per-sample gradients are computed one record at a time instead "
                          f"(exact, n times slower for this layer)", stacklevel=3)
        try:
            return layer_microbatch_grad_sampler(layer, args, kwargs, backprops, flat)
        except (RuntimeError, NotImplementedError) as looped:
            raise UnsupportedLayerError(
                f"{kind.__name__} has no rule, and its recorded call cannot be run again on "
                f"its own: under torch.func.vmap {type(error).__name__}: "
                f"{str(error).splitlines()[0][:120]}; record by record "
                f"{type(looped).__name__}: {str(looped).splitlines()[0][:120]} (a forward "
                f"that reads state an earlier pass left on the module, a cache or a "
                f"recurrent state, cannot be replayed from its inputs). Use "
                f"method='microbatch' or 'vmap', which differentiate the whole model per "
                f"sample, or register a grad sampler for {kind.__name__} "
                f"(wb.register_grad_sampler)") from looped


_LOOPED: set[type] = set()  # layer types warned about (layer_vmap_grad_sampler)


def _layer_vmap(layer, args, kwargs, backprops, flat=False):
    params = {k: p.detach() for k, p in layer.named_parameters(recurse=False) if p.requires_grad}
    one = _as_rows if flat else _one_sample

    def grads_of_one(a, kw, b):
        def output(p):
            with bare(layer):  # forward on the recorded inputs: no hook of its own twice
                out = functional_call(layer, p, tree_map(one, a), tree_map(one, kw))
            return tuple(output_tensors(out)) if isinstance(out, (tuple, list)) else out

        out, pullback = vjp(output, params)
        b1 = tree_map(one, b)
        if isinstance(b1, tuple):  # a tuple output: its Tensors, None skipped (hooks.py)
            b1 = type(out)(b1)
        return pullback(b1)[0]  # g_i = (∂o_i/∂w)^T b_i

    def batched(x):
        return 0 if isinstance(x, torch.Tensor) else None

    args, kwargs = tree_map(dense, (args, kwargs))  # re-run on a default layout (checks.py)
    in_dims = (tree_map(batched, args), tree_map(batched, kwargs), 0)
    return vmap(grads_of_one, in_dims=in_dims, randomness="different")(args, kwargs, backprops)


__all__ = [
    "check_vmappable", "layer_vmap_grad_sampler", "slot_values", "vmap_or_explain",
    "vmap_per_sample_gradients",
]
