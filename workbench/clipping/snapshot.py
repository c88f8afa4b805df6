"""A snapshot of per-sample gradient norms, and what clipping them at C does to the mean.

The clipping explorer's compute step (ARCHITECTURE.md, style item 7). DP-SGD (Abadi et al. 2016,
arXiv:1607.00133, Algorithm 1, "clip gradient") scales each sample's gradient g_i by
c_i = min(1, C / ||g_i||) before averaging, so the update direction is

    m̃(C) = 1/n Σ_i c_i g_i        instead of        m = 1/n Σ_i g_i                    (1)

Samples whose norm exceeds C are shrunk to norm C, so m̃ leans towards the samples with small
gradients: a biased estimate of m, and not only by a scale factor. The cosine

    cos(m̃, m) = <m̃, m> / (||m̃|| ||m||)                                                 (2)

measures that bias: 1 when nothing is clipped (C >= max ||g_i||) or all norms are equal, lower
the more clipping reweights the samples. A small C trades this bias for less noise (the noise
std is σC; ``accounting.snr`` shows that side).

Flat clipping uses the norm over all parameters; per layer (parameters grouped by module path,
``fc1.weight`` and ``fc1.bias`` -> ``fc1``) the squares add up, ||g_i||² = Σ_l ||g_{i,l}||²  (3),
and so do the inner products in (2): <m̃, m> = Σ_l <m̃_l, m_l>.

**Why a C slider costs nothing.** Sort the samples by norm, largest first. At any C the clipped
samples are the first k = #{i : ||g_i|| > C}, so with unit vectors u_i = g_i / ||g_i||,

    m̃(C) = (C U_k + S_k) / n,      U_k = Σ_{j<k} u_(j),   S_k = Σ_{j>=k} g_(j)           (4)

and ||m̃||² = (C² ||U_k||² + 2C <U_k, S_k> + ||S_k||²) / n², <m̃, m> = (C <U_k, m> + <S_k, m>) / n.
``per_sample_snapshot`` runs the one backward pass (``per_sample_gradients(method="einsum")``)
and tabulates these five inner products for k = 0..n, per layer, in float64: O(n d) work, a
block of columns at a time; the gradients are then dropped and the snapshot keeps O(n L)
numbers. ``clip_at(snapshot, C)`` reads row k: O(n + L) work, independent of d, with no model
call (and no torch threads to wake, which on a busy machine cost more than the arithmetic).
``direct_clip_at(grads, C)`` is the slow twin: Eq. (1) and (2) straight from the gradients.

Notation: n batch size, d trainable parameters, d_l those of layer l, L layers, g_i per-sample
gradient, c_i clip factor, C max_grad_norm, m mean gradient, m̃ mean clipped gradient.
"""

from dataclasses import dataclass

import numpy as np
import torch

from workbench.checks import check_max_grad_norm
from workbench.clipping.flat import clip_factors, grad_norms, sample_norms, weighted_sum
from workbench.per_sample import per_sample_gradients

ROOT = "(root)"  # layer name for parameters registered on the model itself, e.g. nn.Linear
# Elements in one (n + 1, columns) block of the tables' work: small enough to stay in cache and
# at torch's threading grain (32768), so each op runs on one thread. Larger blocks, run on two
# threads of a busy 2-core machine, were measured 10-100x slower (waiting for the 2nd thread).
BLOCK = 2**15


def layer_of(param_name: str) -> str:
    """The module path of a parameter: ``"features.0.weight"`` -> ``"features.0"``."""
    return param_name.rpartition(".")[0] or ROOT


@dataclass(frozen=True, eq=False)
class PerSampleSnapshot:
    """Per-sample norms at one model state and the Eq. (4) tables (numpy float64)."""

    layers: tuple[str, ...]  # (L,) module paths, in parameter order
    num_params: int  # d
    norms: np.ndarray  # (n,) ||g_i||, Eq. (3)
    layer_norms: np.ndarray  # (n, L) ||g_{i,l}||
    tables: np.ndarray  # (5, L, n + 1): ||U_k||², <U_k, S_k>, ||S_k||², <U_k, m>, <S_k, m>


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


def _by_layer(grads):
    """{layer: (n, d_l) float64} from {param_name: (n, *shape)}, in parameter order."""
    if not grads:
        raise ValueError("model has no trainable parameters (requires_grad=False on all of "
                         "them): there are no gradients to clip")
    groups: dict[str, list[torch.Tensor]] = {}
    for name, g in grads.items():
        groups.setdefault(layer_of(name), []).append(g.detach().reshape(len(g), -1).double())
    return {layer: torch.cat(parts, dim=1) for layer, parts in groups.items()}


def _tables(g, norms, order):
    """(5, n + 1) inner products of Eq. (4) for one layer's g (n, d_l), samples in ``order``."""
    n, d = g.shape
    inv = torch.where(norms > 0, 1 / norms, 0.0).to(g.dtype)[order, None]  # (n, 1); 0: g_i = 0
    g, out = g[order], g.new_zeros(5, n + 1)  # g sorted, largest norm first
    step = max(1, BLOCK // (n + 1))
    for j in range(0, d, step):
        gs = g[:, j:j + step]  # (n, b)
        U = torch.cat([gs.new_zeros(1, gs.shape[1]), (gs * inv).cumsum(0)])  # (n+1, b) U_k
        S = torch.cat([gs.flip(0).cumsum(0).flip(0), gs.new_zeros(1, gs.shape[1])])  # S_k
        m = S[0] / n  # (b,)
        out += torch.stack([(U * U).sum(1), (U * S).sum(1), (S * S).sum(1), U @ m, S @ m])
    return out


def per_sample_snapshot(model, loss_fn, inputs, targets) -> PerSampleSnapshot:
    """The expensive step: per-sample gradients (einsum) once, reduced to Eq. (4) tables."""
    flat = _by_layer(per_sample_gradients(model, loss_fn, inputs, targets, method="einsum"))
    layer_norms = torch.stack([sample_norms(g) for g in flat.values()], dim=1)  # (n, L) f64
    norms = layer_norms.square().sum(1).sqrt()  # (n,)  Eq. (3)
    order = torch.argsort(norms, descending=True, stable=True)  # (n,)
    tables = torch.stack([_tables(g, norms, order) for g in flat.values()], dim=1)
    return PerSampleSnapshot(layers=tuple(flat), num_params=sum(g.shape[1] for g in flat.values()),
                             norms=norms.numpy(), layer_norms=layer_norms.numpy(),
                             tables=tables.numpy())  # (5, L, n + 1)


def _cosine(dot, sq_a, sq_b):
    """dot / sqrt(sq_a sq_b), elementwise; nan where a norm is 0, clipped into [-1, 1]."""
    dot, denom = np.asarray(dot), np.sqrt(np.asarray(sq_a) * np.asarray(sq_b))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.clip(np.where(denom > 0, dot / denom, np.nan), -1.0, 1.0)


def _result(C, layers, num_params, norms, layer_norms, dots, sq_m, sq_mc):
    """ClippingResult from per-layer <m̃_l, m_l>, ||m_l||², ||m̃_l||² (each (L,))."""
    return ClippingResult(
        max_grad_norm=C, layers=layers, num_params=num_params, norms=norms,
        layer_norms=layer_norms, clip_factors=clip_factors(torch.from_numpy(norms), C).numpy(),
        fraction_clipped=float(np.mean(norms > C)), mean_norm=float(np.sqrt(sq_m.sum())),
        clipped_mean_norm=float(np.sqrt(sq_mc.sum())),
        cosine=float(_cosine(dots.sum(), sq_m.sum(), sq_mc.sum())),  # Eq. (2)
        layer_cosine=_cosine(dots, sq_m, sq_mc),
    )


def clip_at(snapshot: PerSampleSnapshot, max_grad_norm) -> ClippingResult:
    """The cheap step: clip factors, fraction clipped and the bias cosine at C, by Eq. (4)."""
    C, s = check_max_grad_norm(max_grad_norm), snapshot
    n, k = len(s.norms), int(np.count_nonzero(s.norms > C))  # the first k (sorted) are clipped
    UU, US, SS, Um, Sm = s.tables[:, :, k]  # each (L,)
    sq_mc = np.maximum(C * C * UU + 2 * C * US + SS, 0.0) / n**2  # (L,) ||m̃_l||²  Eq. (4)
    return _result(C, s.layers, s.num_params, s.norms, s.layer_norms,
                   dots=(C * Um + Sm) / n, sq_m=s.tables[2, :, 0] / n**2, sq_mc=sq_mc)


def direct_clip_at(grads, max_grad_norm) -> ClippingResult:
    """The slow twin of ``clip_at``: Eq. (1)-(3) from per-sample gradients {name: (n, ...)}."""
    C = check_max_grad_norm(max_grad_norm)
    flat = _by_layer(grads)
    n = next(iter(flat.values())).shape[0]
    c = clip_factors(grad_norms(flat), C)  # (n,)
    m = {layer: g.mean(0) for layer, g in flat.items()}  # (d_l,) each
    mc = {layer: s / n for layer, s in weighted_sum(flat, c).items()}  # (d_l,)  Eq. (1)
    layer_norms = torch.stack([sample_norms(g) for g in flat.values()], dim=1)  # (n, L)
    return _result(C, tuple(flat), sum(g.shape[1] for g in flat.values()),
                   grad_norms(flat).numpy(), layer_norms.numpy(),
                   dots=np.array([float(m[k] @ mc[k]) for k in flat]),
                   sq_m=np.array([float(v @ v) for v in m.values()]),
                   sq_mc=np.array([float(v @ v) for v in mc.values()]))


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


__all__ = [
    "BLOCK", "ROOT", "ClippingResult", "PerSampleSnapshot", "clip_at", "clipping_snapshot",
    "direct_clip_at", "layer_of", "per_sample_snapshot",
]
