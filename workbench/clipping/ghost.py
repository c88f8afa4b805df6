"""Ghost clipping: per-sample gradient norms from activations and backprops alone.

DP-SGD needs only ||g_i|| and Σ_i c_i g_i, never the n per-sample gradients themselves.
Ghost clipping (Goodfellow 2015, arXiv 1510.01799; Li, Tramèr, Liang, Hashimoto 2022,
arXiv 2110.05679, §4) gets both with two backward passes over one forward pass:

1. a backward pass of Σ_i ℓ_i that keeps each layer's backprops b; each layer's
   *norm sampler* turns (a, b) into ||g_i^{layer}||², and ||g_i||² = Σ_layers ||g_i^{layer}||²;
2. c_i = min(1, C / ||g_i||) (``flat.clip_factors``), then an ordinary backward pass of
   Σ_i c_i ℓ_i, whose parameter gradient is Σ_i c_i g_i: the clipped sum.

Layers without a norm sampler (normalisation layers, custom layers) get "fast gradient
clipping" (Opacus blog on fast gradient clipping and ghost clipping, seed 004): their
per-sample gradients are materialised, normed and dropped immediately.

A parameter used in more than one call (a module called twice, tied weights) has the *sum*
of several layers' gradients as its per-sample gradient; the norm of a sum has cross terms,
so such parameters are materialised per call and summed before taking the norm.

Notation: n batch, a activations, b backprops, c clip factors, C max_grad_norm.
"""

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from workbench.clipping.flat import clip_factors, sample_squares
from workbench.clipping.registry import find_norm_sampler
from workbench.per_sample.checks import (
    check_batch,
    check_losses,
    check_no_sample_mixing,
    forward,
    trainable_parameters,
)
from workbench.per_sample.einsum import (
    check_layers,
    check_recorded,
    layers_with_parameters,
    sample_layer,
    warn_fallbacks,
)
from workbench.per_sample.hooks import ActivationRecorder


@dataclass
class LayerCalls:
    """Every recorded layer call of one batch, with its (a, b): what the norms are read from."""

    n: int
    layers: dict[str, nn.Module]
    recorder: ActivationRecorder
    dtype: torch.dtype
    device: torch.device

    def calls(self):
        """(path, layer, call) for every call whose output reached the loss."""
        for path, layer in self.layers.items():
            for call in self.recorder.calls[path]:
                if call.backprops is not None:
                    yield path, layer, call

    def shared_ids(self) -> set[int]:
        """ids of parameters used in more than one call (their norms need cross terms)."""
        uses = Counter(id(p) for _, layer, _ in self.calls()
                       for p in layer.parameters(recurse=False) if p.requires_grad)
        return {key for key, count in uses.items() if count > 1}


@dataclass
class Recording(LayerCalls):
    """One forward pass and one backward pass of Σ_i ℓ_i (``record``), and the losses."""

    losses: torch.Tensor | None = None  # (n,), still attached to the graph when retained
    params: dict[str, nn.Parameter] | None = None


def record(model, loss_fn, inputs, targets, retain_graph: bool) -> Recording:
    """Forward, then one backward pass collecting backprops (no parameter gradients)."""
    check_no_sample_mixing(model)
    n = check_batch(inputs, targets)
    layers = layers_with_parameters(model)
    covered = lambda layer: find_norm_sampler(layer) is not None  # noqa: E731
    check_layers(layers, strict=False, covered=covered)
    with ActivationRecorder(layers) as recorder:
        losses = loss_fn(forward(model, inputs), targets)  # (n,)
        check_losses(losses, n)
    check_recorded(layers, recorder)
    warn_fallbacks(layers, recorder, covered)
    recorder.backward(losses.sum(), retain_graph=retain_graph)
    return Recording(n, layers, recorder, losses.dtype, losses.device, losses,
                     trainable_parameters(model))


def squared_norms(rec: LayerCalls):
    """(||g_i||² (n,), {id(param): (n, *shape) materialised per-sample grads of shared params})."""
    squares, materialised = squared_norms_by(rec, group_of=lambda p: None)
    return squares.get(None, torch.zeros(rec.n, dtype=rec.dtype, device=rec.device)), \
        materialised


def squared_norms_by(rec: LayerCalls, group_of):
    """Like ``squared_norms``, with ||g_i||² split by ``group_of(param)`` (per-layer clipping).

    Returns ({group: (n,)}, materialised). A norm sampler gives one number per layer, so a
    layer whose trainable parameters lie in different groups is materialised instead.
    """
    shared = rec.shared_ids()
    squares: dict = {}
    materialised: dict[int, torch.Tensor] = {}

    def add(group, value):
        squares[group] = value if group not in squares else squares[group] + value

    with torch.no_grad():
        for _, layer, call in rec.calls():
            sampler = find_norm_sampler(layer)
            own = [p for p in layer.parameters(recurse=False) if p.requires_grad]
            groups = {group_of(p) for p in own}
            if sampler is not None and len(groups) == 1 and not any(id(p) in shared for p in own):
                add(groups.pop(), sampler(layer, call.args, call.backprops))  # ghost norm
                continue
            for name, g in sample_layer(layer, call).items():  # fast gradient clipping
                p = getattr(layer, name)
                if not p.requires_grad:
                    continue
                if id(p) in shared:  # summed over its uses before the norm
                    materialised[id(p)] = materialised.get(id(p), 0) + g
                else:
                    add(group_of(p), sample_squares(g))  # normed, then dropped
    params = {id(p): p for _, layer, _ in rec.calls() for p in layer.parameters(recurse=False)}
    for key, g in materialised.items():
        add(group_of(params[key]), sample_squares(g))
    return squares, materialised


def ghost_norms(model, loss_fn, inputs, targets) -> torch.Tensor:
    """||g_i|| (n,) from one forward and one backward pass."""
    rec = record(model, loss_fn, inputs, targets, retain_graph=False)
    return squared_norms(rec)[0].sqrt()


def ghost_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm):
    """{name: Σ_i c_i g_i} by a second backward pass of Σ_i c_i ℓ_i."""
    rec = record(model, loss_fn, inputs, targets, retain_graph=True)
    c = clip_factors(squared_norms(rec)[0].sqrt(), max_grad_norm)  # (n,)
    for call in rec.recorder.all_calls():
        call.backprops = None  # not needed by the second pass: free them before it runs
    params = list(rec.params.values())
    grads = torch.autograd.grad((c.detach() * rec.losses).sum(), params, allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g
            for (name, p), g in zip(rec.params.items(), grads)}
