"""``method="auto"``: einsum or book-keeping, chosen per batch by a cost model of shapes.

Both modes give the same clipped sum Σ_i c_i g_i (exact, see ``engine.py``), so the choice
only ever costs time. They do the same work on most layer calls:

- a call whose per-sample gradients take less memory than its stored a and b (a
  transformer's projections and LayerNorms at T >= 2, a CNN's wide-image convolutions) is
  materialised in both modes while the backward pass runs (``bookkeeping.materialise_call``,
  ``dpsgd/streamed.py``);
- a call without a cheap ghost norm (shared parameters other than the cross-normed weights
  of ``cross.py``, the exact fallback, a route whose ``Route.materialises`` is set, no norm
  rule) is materialised in both modes.

They differ only on the other calls, the *cheaply normed* ones, which einsum materialises
and book-keeping (Bu et al. 2023, arXiv 2210.00038, §3) norms from (a, b) by its rule's
route, then weights by one ordinary weight gradient. Per such call of n samples, with P
trainable parameters, s bytes per number, a_i, b_i the numbers per sample of its input and
backprop, m_i the multiply-adds per sample of its gradient (P·T for a layer applied at T
positions, P·b_i/p with p output channels; an Embedding's T·d scattered rows) and r_i the
route's multiply-adds per sample (``Route.flops``: ``rules/``):

    einsum      = n·m_i / SAMPLE  +  3·n·P·s / BANDWIDTH          (1)
    bookkeeping = n·(r_i + m_i) / GEMM  +  n·(a_i + 2·b_i)·s / BANDWIDTH  +  FIXED     (2)

(1): n small per-sample products (inner dimension T, so slow per multiply-add), and the
n·P per-sample gradients written once and read twice (the norm, then Σ_i c_i g_i).
(2): the ghost norm and one large weight gradient over n·T rows (fast per multiply-add:
PyTorch's GEMM or convolution kernel), a and b read, c ⊙ b written and read, and a fixed
cost per call: about ten more small tensor ops than einsum's three (the Grams or sums of the
route, the widening and finiteness test of its norm, c ⊙ b, the weight gradient). A route
that declares no ``flops`` is costed as materialising (no saving assumed). The batch takes
"bookkeeping" when the sum of (2) over the differing calls is below the sum of (1), else
"einsum" (also when no call differs). No timing at run time: the choice is a function of
shapes and routes.

Constants (2-core AMD EPYC shared by five processes, 2026-11-25, one thread, CPU time;
the rates are those of a busy machine, consistently, so only their ratios matter):
SAMPLE = 2e9 and GEMM = 10e9 multiply-adds/s and BANDWIDTH = 4e9 bytes/s, from per-call
times of the zoo's differing calls (``sample_layer`` + norm + weighted sum against the norm
sampler + ``reweighted_weight_grads``, median of 7): book-keeping took 0.6-10 ms against
einsum's 3.8-325 ms on the MNIST CNN's fc1, the embedding models' Embedding and the CIFAR-10
CNN's conv5-7; near-ties (within a factor 2 either way) on MNIST conv2, CIFAR-10 conv8 and
tiny_gpt's position embedding. FIXED = 1 ms, the median of (measured book-keeping - einsum
step + modelled einsum - modelled book-keeping) / differing calls over six models of the
real-architecture table at n = 16, T = 8 (GPT-2, ViT, BERT, timm ResNet-GN, Llama, OPT: 0.3
to 1.8 ms; einsum's step was 2-18 ms faster on each, 21 interleaved steps). With these the
choice is book-keeping on every zoo model at b = 64 and 256 (the embedding models, the CNNs:
(1) is 2-35x (2)), einsum on tiny_gpt (only its position embedding differs: every
projection and LayerNorm is materialised in both modes, and the modes' steps differed by
less than the timing noise) and on the real table's small transformers and CNNs.
``choose_mode`` returns the choice and the numbers behind it, and ``DPOptimizer.last["mode"]``
keeps it for every step.

Notation: n batch, P trainable parameters of a layer call, T positions, p output channels,
c clip factors, a activations, b backprops, s bytes per number.
"""

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from workbench.clipping import cross
from workbench.clipping.bookkeeping import smaller_materialised
from workbench.clipping.registry import find_norm_sampler
from workbench.per_sample.recording import own_parameters
from workbench.rules._rule import norm_route

SAMPLE = 2e9  # multiply-adds/s of n per-sample products (inner dimension T)
GEMM = 10e9  # multiply-adds/s of one weight gradient over n·T rows
BANDWIDTH = 4e9  # bytes/s, through memory
FIXED = 1e-3  # s per book-keeping call: ~10 more small tensor ops than einsum (docstring)


def cheaply_normed(rec, layer, call, shared: set[int], crossed=()) -> bool:
    """Whether book-keeping norms this call from (a, b) without materialising it: by its
    rule's route, or, for a shared weight, by cross Grams (``crossed``: ``cross.plan``)."""
    own = rec.own(layer)
    if any(id(p) in crossed for _, p in own):
        return all(id(p) in crossed or name == "bias" for name, p in own)
    if (is_parametrized(layer) or find_norm_sampler(layer) is None
            or len(own) != len(own_parameters(layer))
            or any(id(p) in shared or id(p) in rec.fallback for _, p in own)):
        return False
    route = norm_route(layer, call.args)  # (Route, reason): the route says if it materialises
    return route is None or not route[0].materialises


def _first(t):
    """The first of a call's inputs or backprops; None for a call given none (a layer called
    without arguments, such as a relative-position bias table: it has no (a, b) to norm)."""
    if isinstance(t, (tuple, list)):
        return t[0] if t else None
    return t


def gradient_macs(layer, a: torch.Tensor, b: torch.Tensor, P: int) -> int:
    """m_i: multiply-adds per sample of the layer's gradient from (a_i, b_i): an Embedding
    scatters its T·d backprop numbers; any other layer is a product over its positions,
    P·T with T = b_i / p (p output channels: dim 1 of a convolution's b, else the last)."""
    if isinstance(layer, nn.Embedding):
        return b[0].numel()
    p = b.shape[1] if isinstance(layer, nn.modules.conv._ConvNd) else b.shape[-1]
    return P * max(b[0].numel() // max(p, 1), 1)


def call_costs(rec, layer, call, P: int, pairs: int = 0) -> tuple[float, float]:
    """(einsum, bookkeeping) seconds of one cheaply normed call, Eq. (1) and (2); ``pairs``:
    for a call of a cross-normed weight (``cross.py``), T times the positions of all its
    calls, the Gram entries its pairs add (each of P + D multiply-adds)."""
    n, s = rec.n, rec.dtype.itemsize
    a, b = _first(call.args), _first(call.backprops)
    m = gradient_macs(layer, a, b, P)
    einsum = n * m / SAMPLE + 3 * n * P * s / BANDWIDTH  # (1)
    if pairs:
        r = pairs * sum(layer.weight.shape)
        moved = (a[0].numel() + 2 * b[0].numel()) * s
        return einsum, n * (r + m) / GEMM + n * moved / BANDWIDTH + FIXED  # (2)
    route = norm_route(layer, call.args)
    if route is not None and route[0].flops is None:
        return einsum, einsum  # cost not declared: no saving assumed
    r = route[0].flops(layer, call) if route is not None else 0
    moved = (a[0].numel() + 2 * b[0].numel()) * s
    return einsum, n * (r + m) / GEMM + n * moved / BANDWIDTH + FIXED  # (2)


def differs(rec, layer, call, own: list, shared: set[int], crossed=()) -> bool:
    """A call the two modes treat differently: cheaply normed, with its a and b (not
    materialised during the backward pass, ``smaller_materialised``)."""
    b = call.backprops
    if not isinstance(_first(call.args), torch.Tensor) or not isinstance(_first(b), torch.Tensor):
        return False
    if isinstance(b, torch.Tensor) and smaller_materialised(layer, call, dict(own), shared,
                                                             rec.n):
        return False
    return cheaply_normed(rec, layer, call, shared, crossed)


def choose_mode(rec) -> tuple[str, dict]:
    """("einsum" or "bookkeeping", numbers): the mode of the smaller modelled cost.

    numbers: "einsum_s" and "bookkeeping_s" (Eq. 1 and 2 summed over the calls where the
    modes differ), "avoided" (n·P of those calls: what book-keeping does not materialise)
    and "materialised" (n·P of every recorded call)."""
    shared = rec.shared_ids()
    crossed = cross.plan(rec, shared)
    total: dict[int, int] = {}  # Σ_k T_k of each cross-normed weight's calls
    for _, layer, call in rec.calls():
        for _, p in rec.own(layer):
            if id(p) in crossed:
                total[id(p)] = total.get(id(p), 0) + (cross.positions(layer, call) or 0)
    avoided = materialised = 0
    einsum = bookkeeping = 0.0
    for _, layer, call in rec.calls():
        own = rec.own(layer)
        P = sum(p.numel() for _, p in own)
        materialised += rec.n * P
        if P and differs(rec, layer, call, own, shared, crossed):
            avoided += rec.n * P
            mine = [id(p) for _, p in own if id(p) in crossed]
            pairs = (cross.positions(layer, call) or 0) * total[mine[0]] if mine else 0
            e, k = call_costs(rec, layer, call, P, pairs)
            einsum, bookkeeping = einsum + e, bookkeeping + k
    mode = "bookkeeping" if bookkeeping < einsum else "einsum"
    return mode, {"einsum_s": einsum, "bookkeeping_s": bookkeeping, "avoided": avoided,
                  "materialised": materialised}


__all__ = ["BANDWIDTH", "FIXED", "GEMM", "SAMPLE", "call_costs", "cheaply_normed",
           "choose_mode", "gradient_macs"]
