"""Per-sample gradients in one backward pass: hooks + per-layer grad samplers.

The method of Opacus (Yousefpour et al. 2021, arXiv 2109.12298, Appendix B). One ordinary
forward pass records each layer's activations a; one ordinary backward pass of Σ_i ℓ_i
records the backprops b = ∂(Σ_i ℓ_i)/∂o (``hooks.py``). A per-layer rule then builds every
sample's gradient at once, e.g. for ``nn.Linear`` (o = W a + c)

    ∂ℓ_i/∂W = b_i a_iᵀ        (n, p, d)   Eq. (5)
    ∂ℓ_i/∂c = b_i             (n, p)

with an extra sum over the positions of a sequence. The rules live in ``samplers/`` and in
the registry (``registry.py``). A layer with trainable parameters but no rule is handled by
``vmap`` on that layer alone (``functional.layer_vmap_grad_sampler``), after a one-time
warning; ``strict=True`` raises instead.

Notation: n batch size, a activations (n, ..., d), b backprops (n, ..., p), W (p, d).
"""

import warnings

import torch
from torch import nn

from workbench.errors import UnsupportedLayerError
from workbench.per_sample.checks import check_batch, check_losses, forward, trainable_parameters
from workbench.per_sample.functional import layer_vmap_grad_sampler
from workbench.per_sample.hooks import ActivationRecorder
from workbench.per_sample.registry import SAMPLER_CHECKS, find_grad_sampler

_WARNED: set[tuple[type, str]] = set()


def layers_with_parameters(model: nn.Module) -> dict[str, nn.Module]:
    """``{path: module}`` of modules owning trainable parameters directly (not via children)."""
    return {
        path: module
        for path, module in model.named_modules()
        if any(p.requires_grad for p in module.parameters(recurse=False))
    }


def check_layers(layers: dict[str, nn.Module], strict: bool, covered=None) -> None:
    """Before the forward pass: each sampler's option check, and ``strict`` for layers
    without a sampler (``covered(layer) -> bool`` marks layers another rule handles)."""
    for path, layer in layers.items():
        kind = type(layer)
        if kind in SAMPLER_CHECKS:
            SAMPLER_CHECKS[kind](layer)
        if strict and not _has_rule(layer, covered):
            raise UnsupportedLayerError(
                f"{kind.__name__} at {path or '<model>'} has trainable parameters but no grad "
                f"sampler; register one with @wb.register_grad_sampler({kind.__name__}) or "
                f"pass strict=False to compute it by vmap on that layer")


def _has_rule(layer, covered) -> bool:
    return find_grad_sampler(layer) is not None or (covered is not None and covered(layer))


def warn_fallbacks(layers: dict[str, nn.Module], recorder, covered=None) -> None:
    """After the forward pass: warn once per layer that will be sampled by vmap."""
    for path, layer in layers.items():
        kind = type(layer)
        if _has_rule(layer, covered) or not recorder.calls[path] or (kind, path) in _WARNED:
            continue
        _WARNED.add((kind, path))
        warnings.warn(f"{kind.__name__} at {path or '<model>'} has no registered grad sampler; "
                      f"computing its per-sample gradients by vmap on that layer (slower). "
                      f"Register one with @wb.register_grad_sampler({kind.__name__}).",
                      stacklevel=4)


def check_recorded(layers: dict[str, nn.Module], recorder: ActivationRecorder) -> None:
    """A layer that must be sampled but whose output could not be recorded is an error.

    The hooks record Tensor outputs only. A layer returning a tuple (``nn.LSTM``,
    ``nn.MultiheadAttention``) with no grad sampler of its own would otherwise silently get
    zero per-sample gradients.
    """
    for path in recorder.untracked:
        layer = layers[path]
        if find_grad_sampler(layer) is None:
            kind = type(layer).__name__
            raise UnsupportedLayerError(
                f"{kind} at {path or '<model>'} returns a {recorder.untracked[path]}, not a "
                f"Tensor, so its per-sample gradients cannot be captured (torch.nn's fused "
                f"recurrent and attention kernels hide their inner products); use "
                f"wb.fix_model(model) to swap in the wb.layers DP version, or register a "
                f"grad sampler for {kind}")


def sample_layer(layer: nn.Module, call) -> dict[str, torch.Tensor]:
    """Per-sample gradients of ``layer``'s own parameters for one recorded call.

    Samplers run under ``no_grad``: the results are data for clipping, not part of a graph
    (so they keep no activations alive and may write into preallocated outputs).
    """
    sampler = find_grad_sampler(layer)
    with torch.no_grad():
        if sampler is None:  # torch.func transforms ignore the outer no_grad
            return layer_vmap_grad_sampler(layer, call.args, call.kwargs, call.backprops)
        return sampler(layer, call.args, call.backprops)


def einsum_per_sample_gradients(model, loss_fn, inputs, targets, strict=False):
    """``{name: Tensor(n, *param.shape)}`` from one forward and one backward pass."""
    n = check_batch(inputs, targets)
    params = trainable_parameters(model)
    layers = layers_with_parameters(model)
    check_layers(layers, strict)

    with ActivationRecorder(layers) as recorder:
        losses = loss_fn(forward(model, inputs), targets)  # (n,)
        check_losses(losses, n)
    check_recorded(layers, recorder)
    warn_fallbacks(layers, recorder)
    recorder.backward(losses.sum())  # autograd.grad inside: the .grad fields stay untouched

    by_param: dict[int, torch.Tensor] = {}  # id(param) -> (n, *param.shape), summed over uses
    for path, layer in layers.items():
        for call in recorder.calls[path]:
            if call.backprops is None:
                continue  # this call's output did not reach the loss
            for local_name, g in sample_layer(layer, call).items():
                p = getattr(layer, local_name)
                if p.requires_grad:
                    key = id(p)
                    by_param[key] = g if key not in by_param else by_param[key] + g

    return {
        name: by_param[id(p)] if id(p) in by_param
        else torch.zeros(n, *p.shape, dtype=p.dtype, device=p.device)  # never reached the loss
        for name, p in params.items()
    }
