"""A snapshot of per-sample gradient norms, and what clipping them at C does to the mean.

The clipping explorer's compute step (DESIGN.md, style item 7). DP-SGD (Abadi et al. 2016,
arXiv:1607.00133, Algorithm 1, "clip gradient") scales each sample's gradient g_i by
c_i = min(1, C / ||g_i||) before averaging, so the update direction is

    m̃(C) = 1/n Σ_i c_i g_i        instead of        m = 1/n Σ_i g_i                    (1)

Samples whose norm exceeds C are shrunk to norm C, so m̃ leans towards the samples with small
gradients: it is a biased estimate of m, and not only by a scale. The cosine

    cos(m̃, m) = <m̃, m> / (||m̃|| ||m||)                                                 (2)

measures that bias: 1 when nothing is clipped (C >= max ||g_i||) or when every norm is equal,
smaller the more clipping reorders the samples' weights. A small C trades bias for less noise
(the noise std is σC); ``accounting.snr`` shows the noise side.

Flat clipping uses the norm over all parameters; per layer (parameters grouped by module
path, ``fc1.weight`` and ``fc1.bias`` -> ``fc1``) the squares add up:

    ||g_i||² = Σ_l ||g_{i,l}||²                                                          (3)

so the per-layer norms show which layers make a sample's norm large.

**Two steps, so a C slider is cheap.** ``per_sample_snapshot`` runs the one backward pass
(``per_sample_gradients(method="einsum")``) and keeps the gradients flattened per layer, in
float64 so that Eq. (2) is accurate to ~1e-15 (twice the memory of float32 gradients: this is
a teaching tool for small models and batches). ``clip_at(snapshot, C)`` then costs one (n,) x
(n, d) product, with no model call. ``clipping_snapshot`` does both.

Notation: n batch size, d number of trainable parameters, d_l those of layer l, L layers,
g_i per-sample gradient, c_i clip factor, C max_grad_norm, m mean gradient.
"""

from dataclasses import dataclass

import numpy as np
import torch

from workbench.clipping.flat import check_max_grad_norm, clip_factors
from workbench.per_sample import per_sample_gradients

ROOT = "(root)"  # layer name for parameters registered on the model itself, e.g. nn.Linear


def layer_of(param_name: str) -> str:
    """The module path of a parameter: ``"features.0.weight"`` -> ``"features.0"``."""
    return param_name.rpartition(".")[0] or ROOT


@dataclass(frozen=True, eq=False)
class PerSampleSnapshot:
    """Per-sample gradients at one model state, flattened per layer (float64)."""

    layers: tuple[str, ...]  # (L,) module paths, in parameter order
    grads: tuple[torch.Tensor, ...]  # L tensors (n, d_l): g_{i,l}
    means: tuple[torch.Tensor, ...]  # L tensors (d_l,): m_l, the unclipped mean
    layer_norms: torch.Tensor  # (n, L) ||g_{i,l}||
    norms: torch.Tensor  # (n,) ||g_i||, Eq. (3)

    @property
    def num_samples(self) -> int:
        return self.norms.shape[0]

    @property
    def num_params(self) -> int:
        return sum(g.shape[1] for g in self.grads)


@dataclass(frozen=True, eq=False)
class ClippingResult:
    """Per-sample norms and the effect of clipping them at C (numpy arrays, float64)."""

    max_grad_norm: float  # C
    layers: tuple[str, ...]  # (L,)
    num_params: int  # d
    norms: np.ndarray  # (n,) ||g_i||
    layer_norms: np.ndarray  # (n, L) ||g_{i,l}||
    clip_factors: np.ndarray  # (n,) c_i = min(1, C / ||g_i||)
    fraction_clipped: float  # share of samples with ||g_i|| > C
    mean_norm: float  # ||m||
    clipped_mean_norm: float  # ||m̃(C)||: the "signal" of accounting.snr
    cosine: float  # Eq. (2); nan if m or m̃ is 0
    layer_cosine: np.ndarray  # (L,) Eq. (2) restricted to each layer's parameters

    @property
    def num_samples(self) -> int:
        return self.norms.shape[0]


def per_sample_snapshot(model, loss_fn, inputs, targets) -> PerSampleSnapshot:
    """The expensive step: per-sample gradients (einsum), grouped and flattened per layer."""
    grads = per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")
    if not grads:
        raise ValueError("model has no trainable parameters (requires_grad=False on all of "
                         "them): there are no gradients to clip")
    groups: dict[str, list[torch.Tensor]] = {}
    for name, g in grads.items():  # g: (n, *param.shape)
        groups.setdefault(layer_of(name), []).append(g.detach().flatten(1).double())
    flat = tuple(torch.cat(parts, dim=1) for parts in groups.values())  # each (n, d_l)
    layer_norms = torch.stack([g.norm(dim=1) for g in flat], dim=1)  # (n, L)
    return PerSampleSnapshot(
        layers=tuple(groups), grads=flat, means=tuple(g.mean(0) for g in flat),
        layer_norms=layer_norms, norms=layer_norms.pow(2).sum(1).sqrt(),  # (n,)  Eq. (3)
    )


def _cosine(dot, sq_a, sq_b):
    """dot / sqrt(sq_a sq_b), elementwise; nan where a norm is 0, clipped into [-1, 1]."""
    dot, denom = np.asarray(dot), np.sqrt(np.asarray(sq_a) * np.asarray(sq_b))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.clip(np.where(denom > 0, dot / denom, np.nan), -1.0, 1.0)


def clip_at(snapshot: PerSampleSnapshot, max_grad_norm) -> ClippingResult:
    """The cheap step: clip factors, fraction clipped and the bias cosine at C."""
    C = check_max_grad_norm(max_grad_norm)
    s, n = snapshot, snapshot.num_samples
    c = clip_factors(s.norms, C)  # (n,)
    clipped = [c @ g / n for g in s.grads]  # L tensors (d_l,): m̃_l  Eq. (1)
    dots = np.array([float(m @ mc) for m, mc in zip(s.means, clipped)])  # (L,)
    sq_m = np.array([float(m @ m) for m in s.means])  # (L,) ||m_l||²
    sq_mc = np.array([float(mc @ mc) for mc in clipped])  # (L,) ||m̃_l||²
    return ClippingResult(
        max_grad_norm=C, layers=s.layers, num_params=s.num_params,
        norms=s.norms.numpy(), layer_norms=s.layer_norms.numpy(), clip_factors=c.numpy(),
        fraction_clipped=float((s.norms > C).double().mean()),
        mean_norm=float(np.sqrt(sq_m.sum())), clipped_mean_norm=float(np.sqrt(sq_mc.sum())),
        cosine=float(_cosine(dots.sum(), sq_m.sum(), sq_mc.sum())),  # Eq. (2)
        layer_cosine=_cosine(dots, sq_m, sq_mc),
    )


def clipping_snapshot(model, loss_fn, inputs, targets, max_grad_norm) -> ClippingResult:
    """Per-sample norms at the model's current state, total and per layer, clipped at C.

    >>> import torch
    >>> from torch import nn
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    >>> r = clipping_snapshot(model, nn.CrossEntropyLoss(reduction="none"), x, y, 1e9)
    >>> r.layers, r.layer_norms.shape, r.fraction_clipped, round(r.cosine, 12)
    (('0', '2'), (8, 2), 0.0, 1.0)
    """
    check_max_grad_norm(max_grad_norm)  # fail before the backward pass
    return clip_at(per_sample_snapshot(model, loss_fn, inputs, targets), max_grad_norm)
