"""Normalisation layers: backprop times the normalised input (grad rules only; their norms
are taken by fast gradient clipping).

Every layer here computes o = γ ⊙ â + β, where â is the input normalised without the affine
part (over features for LayerNorm / RMSNorm, over channel groups for GroupNorm, over each
channel's positions for InstanceNorm). The statistics are computed within one sample, so the
affine parameters' per-sample gradients are (Opacus blog "Efficient per-sample gradient
computation for more layers", normalisation section)

    ∂ℓ_i/∂γ = Σ_{positions} b_i ⊙ â_i          shape of γ
    ∂ℓ_i/∂β = Σ_{positions} b_i

We recompute â with the functional form of the same layer without γ, β: exact, and cheaper
than keeping it in the forward pass.

Notation: n batch, a activations, â normalised activations, b backprops, γ weight, β bias.
"""

import torch
import torch.nn.functional as F
from torch import nn

from workbench.rules._rule import LayerRule, register_rule


def _sum_to(t: torch.Tensor, keep_last: int, channel_dim: bool = False) -> torch.Tensor:
    """Sum (n, ...) over every dim except batch and the parameter's dims.

    ``keep_last`` trailing dims are kept (LayerNorm, RMSNorm); with ``channel_dim`` dim 1 is
    kept instead (GroupNorm, InstanceNorm: parameters are per channel).
    """
    if channel_dim:
        dims = tuple(range(2, t.dim()))
    else:
        dims = tuple(range(1, t.dim() - keep_last))
    return t.sum(dim=dims) if dims else t  # sum(dim=()) would sum everything


def _affine_grads(layer, a_hat, b, keep_last=0, channel_dim=False):
    out = {}
    if getattr(layer, "weight", None) is not None and layer.weight.requires_grad:
        out["weight"] = _sum_to(b * a_hat, keep_last, channel_dim)  # ∂ℓ_i/∂γ
    if getattr(layer, "bias", None) is not None and layer.bias.requires_grad:
        out["bias"] = _sum_to(b, keep_last, channel_dim)  # ∂ℓ_i/∂β
    return out


def layer_norm_grad_sampler(layer, activations, backprops):
    shape = layer.normalized_shape
    a_hat = torch.layer_norm(activations[0], shape, None, None, layer.eps,
                             torch.backends.cudnn.enabled)  # F.layer_norm without its checks
    return _affine_grads(layer, a_hat, backprops, keep_last=len(shape))


def rms_norm_grad_sampler(layer, activations, backprops):
    shape = layer.normalized_shape
    a_hat = F.rms_norm(activations[0], shape, eps=layer.eps)
    return _affine_grads(layer, a_hat, backprops, keep_last=len(shape))


def group_norm_grad_sampler(layer, activations, backprops):
    a_hat = F.group_norm(activations[0], layer.num_groups, eps=layer.eps)
    return _affine_grads(layer, a_hat, backprops, channel_dim=True)


def instance_norm_grad_sampler(layer, activations, backprops):
    a = activations[0]  # (n, C, *positions): â per sample and channel over its positions,
    # which is a LayerNorm over the flattened positions (the same biased variance and eps);
    # CPU's layer_norm kernel takes about 0.6 of instance_norm's time (which runs batch_norm
    # on (1, n C, ...)): measured at n = 256, C = 256, L = 64, one thread, 5.1 ms against 8.5
    positions = a.shape[2:].numel()
    a_hat = torch.layer_norm(a.flatten(2), (positions,), None, None, layer.eps,
                             torch.backends.cudnn.enabled).view_as(a)
    return _affine_grads(layer, a_hat, backprops, channel_dim=True)


def batch_norm_grad_sampler(layer, activations, backprops):
    """BatchNorm with frozen statistics (eval mode: ``per_sample.checks.frozen_statistics``,
    checked at every pass): â = (a - μ_run) / sqrt(σ²_run + eps) per channel, each record
    alone. In training mode the layer is refused before any rule runs (a batch statistic);
    called there anyway, this refuses too rather than answer for another function."""
    if layer.training or layer.running_mean is None or layer.running_var is None:
        from workbench.errors import SampleMixingError
        raise SampleMixingError(f"{type(layer).__name__} normalises with the batch's "
                                f"statistics (training mode, or no running statistics): no "
                                f"per-sample gradient; keep it in eval mode")
    a = activations[0]  # (n, C) or (n, C, *positions)
    shape = (1, -1) + (1,) * (a.dim() - 2)
    mean = layer.running_mean.to(a.dtype).view(shape)
    scale = torch.rsqrt(layer.running_var.to(a.dtype) + layer.eps).view(shape)
    return _affine_grads(layer, (a - mean) * scale, backprops, channel_dim=True)


RULES = [register_rule(LayerRule(name, types, grad=grad, rows=rows))
         for name, types, grad, rows in (
    ("layer norm", (nn.LayerNorm,), layer_norm_grad_sampler, True),  # over the last dims: a
    ("rms norm", (nn.RMSNorm,), rms_norm_grad_sampler, True),  # row is one sample's position
    ("group norm", (nn.GroupNorm,), group_norm_grad_sampler, False),
    ("instance norm", (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
     instance_norm_grad_sampler, False),
    ("batch norm, frozen statistics", (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                                       nn.SyncBatchNorm), batch_norm_grad_sampler, False))]


__all__ = [
    "RULES", "batch_norm_grad_sampler", "group_norm_grad_sampler", "instance_norm_grad_sampler",
    "layer_norm_grad_sampler", "rms_norm_grad_sampler",
]
