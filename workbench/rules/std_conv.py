"""Weight-standardised convolutions, recognised by what they compute (BiT, ViT-hybrid, timm's
ResNetV2 ``StdConv2d``): each filter is standardised inside ``forward``, then convolved.

Weight standardisation (Qiao et al. 2019, arXiv 1903.10520, Eq. 5; Kolesnikov et al. 2020,
BiT, arXiv 1912.11370, §3.1) normalises each output channel's filter over its m = C k / G
numbers (biased variance, as ``F.batch_norm`` with ``training=True`` computes it):

    W'_o = (W_o − μ_o) / s_o,   s_o = (σ²_o + ε)^½,   o = conv(a, W') + c

W' is a function of W alone, the same for every sample, so a sample's gradient is the
convolution rule's g'_i = ∂ℓ_i/∂W' (``conv.py``) taken back through the standardisation's
Jacobian, a normalisation's backward filter by filter:

    ∂ℓ_i/∂W_o = (g'_{i,o} − mean(g'_{i,o}) − W'_o · mean(g'_{i,o} ⊙ W'_o)) / s_o      (1)

and the bias's is the convolution's own. Book-keeping's clipped sum re-runs the layer on its
stored input with c ⊙ b (``clipping/engine.py``), through the standardisation.

The norm needs no g_i. Write v = g'_{i,o} (m numbers), S = Σ v, P = W'_o · v; then (1) is
(v − (S/m) 1 − (P/m) W'_o) / s_o and, expanding the square,

    ||∂ℓ_i/∂W_o||² = (||v||² − S²/m − 2P²/m + P² ||W'_o||²/m² + 2 S P (1 · W'_o)/m²) / s_o²   (2)

Σ_o ||v||²/s_o² is the convolution's own norm rule (``conv_gram.weight_squares``: the Gram
route, Li et al. 2022, arXiv 2110.05679, §4) with each filter's backprops divided by s_o;
P = Σ_l b_{i,o,l} z_{i,o,l} with z = conv(a, W') the layer's output less its bias; and
S = Σ_l b_{i,o,l} A_{i,g,l}, A = conv(a, 1) the sum of each receptive field over its group's
channels. Two forward convolutions and the Gram route: no (n, O, m) tensor. Where the
convolution's own rule would materialise (2L² ≥ p·d: wide maps, few channels), so does this
one: g_i by the grad rule, normed.

``std_conv_eps(layer)`` is the test behind the rule (``LayerRule(matches=...)``): a Conv1d/2d/3d
subclass with only ``weight`` (and ``bias``), whose submodules hold no parameters (HF's
``DynamicPad2d``), and whose ``forward`` on a probe input equals ``conv(pad(x), W', c)`` in
float64 for one ε among the layer's own ``eps`` and the usual values, with ``pad`` the layer's
own parameter-free padding module if it has one. Anything else keeps per-layer vmap.

Notation: n batch, a activations, b backprops, W (O, C / G, *k), G groups, ε the layer's eps.
"""

import weakref

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.stateless import _reparametrize_module

from workbench.clipping.flat import sample_squares
from workbench.rules._rule import (
    MATERIALISE,
    PROBE_ERRORS,
    LayerRule,
    Route,
    probe_forward,
    register_rule,
)
from workbench.rules.conv_geometry import conv_dims
from workbench.rules.conv_grads import conv_grad_sampler
from workbench.rules.conv_gram import gram_flops, gram_scratch, weight_squares
from workbench.rules.linear import gram_is_cheaper

EPS = (1e-6, 1e-5, 1e-8, 1e-10)  # tried after the layer's own ``eps``
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TOLERANCE = 1e-10  # relative, float64 probe
CHUNK = 1 << 20  # numbers: the largest temporary of the rule's filter products


def standardised(W: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(W' (O, m), s (O, 1)): each filter centred and divided by (σ² + ε)^½."""
    w = W.reshape(W.shape[0], -1)
    var, mean = torch.var_mean(w, dim=1, unbiased=False, keepdim=True)
    s = (var + eps).sqrt()
    return (w - mean) / s, s


def padder(layer):
    """The layer's own parameter-free padding module, or None."""
    pad = getattr(layer, "pad", None)
    return pad if isinstance(pad, nn.Module) else None


def expected(layer, x: torch.Tensor, W: torch.Tensor, c, eps: float) -> torch.Tensor:
    """conv(pad(x), W', c) with the layer's geometry: what a weight-standardised layer gives."""
    pad = padder(layer)
    x = pad(x) if pad is not None else x
    Wn = standardised(W, eps)[0].reshape(W.shape)
    conv = CONVS[len(layer.kernel_size)]
    return conv(x, Wn, c, layer.stride, layer.padding, layer.dilation, layer.groups)


def candidate(layer) -> bool:
    own = dict(layer.named_parameters(recurse=False))
    return (isinstance(layer, nn.modules.conv._ConvNd) and type(layer) not in CONV_TYPES
            and not getattr(layer, "transposed", False) and set(own) <= {"weight", "bias"}
            and "weight" in own and layer.padding_mode == "zeros"
            and isinstance(layer.padding, tuple)  # "same"/"valid" strings: not probed here
            and not any(True for m in layer.children() for _ in m.parameters()))


CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_EPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def std_conv_eps(layer) -> float | None:
    """The ε for which ``layer`` computes conv(pad(x), W', c) on a float64 probe, else None
    (cached per layer, its ``eps`` attribute, its weight's shape and dtype and whether it has
    a bias: a layer whose ``eps`` is set, or a bias added, after its first call is probed
    again, its rule never keeps the old answer)."""
    w = getattr(layer, "weight", None)
    key = (getattr(layer, "eps", None), getattr(w, "shape", None), getattr(w, "dtype", None),
           getattr(layer, "bias", None) is None)
    known = _EPS.setdefault(layer, {})
    if key not in known:
        known[key] = _probe(layer) if candidate(layer) else None
    return known[key]


def _probe(layer) -> float | None:
    g = torch.Generator().manual_seed(0)
    W = layer.weight.detach()
    W64 = torch.randn(W.shape, generator=g, dtype=torch.float64).to(W.device)
    bias = getattr(layer, "bias", None)
    c64 = None if bias is None else torch.randn(bias.shape, generator=g,
                                                dtype=torch.float64).to(W.device)
    size = [7] * len(layer.kernel_size)
    x = torch.randn(2, layer.in_channels, *size, generator=g, dtype=torch.float64).to(W.device)
    params = {"weight": W64} if c64 is None else {"weight": W64, "bias": c64}
    try:
        with torch.no_grad(), _reparametrize_module(layer, params):
            out = probe_forward(layer, x)
    except PROBE_ERRORS:
        return None
    own = getattr(layer, "eps", None)
    for eps in ((own,) if isinstance(own, float) else ()) + EPS:
        try:
            with torch.no_grad():
                want = expected(layer, x, W64, c64, eps)
        except PROBE_ERRORS:
            return None
        if (out.dtype == torch.float64 and out.shape == want.shape
                and (out - want).norm() <= TOLERANCE * want.norm()):
            return eps
    return None


def std_conv_grad_sampler(layer, activations, backprops):
    """{'weight': (n, *W.shape), 'bias': (n, O)}: the convolution rule on the padded input,
    then (1) per sample."""
    eps, a = std_conv_eps(layer), activations[0]
    pad = padder(layer)
    if pad is not None:
        a = pad(a)
    out = conv_grad_sampler(layer, (a,), backprops)  # g'_i and the bias's g_i
    if "weight" in out:
        g = out["weight"]
        n, filters = g.shape[:2]
        Wn, s = standardised(layer.weight.detach().to(g.dtype), eps)  # (O, m), (O, 1)
        v = g.view(n, filters, -1)  # (1) in g's own buffer: no (n, O, m) temporary
        m = v.shape[-1]
        # mean(g' ⊙ W') for every (i, o), a few samples at a time: a temporary of at most
        # CHUNK numbers, not (n, O, m); one op for a small layer, not one per sample
        along = v.new_empty(n, filters)
        step = max(1, CHUNK // (filters * m))
        for i in range(0, n, step):
            torch.linalg.vecdot(v[i:i + step], Wn, out=along[i:i + step])
        along = along.unsqueeze(-1).div_(m)
        v.sub_(v.mean(-1, keepdim=True)).addcmul_(Wn, along, value=-1).div_(s)
    return out


def std_conv_norm_sampler(layer, activations, backprops):
    """Σ over the trainable parameters of ||g_i||² (n,): (2) for the weight, ||Σ_l b_l||² for
    the bias; float64."""
    eps, a, b = std_conv_eps(layer), activations[0], backprops
    pad = padder(layer)
    if pad is not None:
        a = pad(a)
    n, p = b.shape[:2]
    if layer.weight.requires_grad and not gram_is_cheaper(*conv_dims(layer, a)):
        grads = std_conv_grad_sampler(layer, activations, backprops)  # as MATERIALISE
        return sum(sample_squares(g) for g in grads.values())
    squares = b.new_zeros(n, dtype=torch.float64)
    B = b.reshape(n, p, -1)  # (n, p, L)
    if layer.weight.requires_grad:
        W = layer.weight.detach().to(a.dtype)
        Wn, s = standardised(W, eps)  # (p, m), (p, 1)
        m, G = Wn.shape[1], layer.groups
        squares += weight_squares(layer, a, b / s.to(b.dtype).view(1, p, *[1] * (b.dim() - 2)))
        conv = CONVS[len(layer.kernel_size)]
        geometry = (layer.stride, layer.padding, layer.dilation, G)
        z = conv(a, Wn.view(W.shape), None, *geometry).reshape(n, p, -1)
        ones = W.new_ones(G, *W.shape[1:])
        A = conv(a, ones, None, *geometry).reshape(n, G, 1, -1)  # (n, G, 1, L)
        Bz = B.to(z.dtype)
        P = torch.linalg.vecdot(Bz, z).double()  # (n, p)
        S = torch.linalg.vecdot(Bz.view(n, G, p // G, -1), A).reshape(n, p).double()
        Wd = Wn.double()
        w2, w1, inv = Wd.square().sum(1), Wd.sum(1), s.double().square().reciprocal().view(p)
        squares += ((P.square() * (w2 / m - 2) - S.square() + 2 * S * P * w1 / m)
                    * (inv / m)).sum(1)
    if layer.bias is not None and layer.bias.requires_grad:
        squares += B.sum(2).double().square().sum(1)  # ||Σ_l b_l||²
    return squares


def _std_scratch(layer, call) -> int:
    """The Gram route's, and z and A: (O + G)·L numbers per sample."""
    L = conv_dims(layer, call.args[0])[0]
    return gram_scratch(layer, call) + (layer.out_channels + layer.groups) * L


def _std_flops(layer, call) -> int:
    """The Gram route's and the forward convolution z = conv(a, W')."""
    L, p, ck = conv_dims(layer, call.args[0])
    return gram_flops(layer, call) + layer.groups * L * p * ck


STD_GRAM = Route("standardised gram", _std_scratch, flops=_std_flops)
"""(2): the convolution's norm rule on b / s, and two forward convolutions."""


def std_conv_route(layer, activations):
    """(Route, reason): (2) where the convolution's Gram route is cheaper than its per-sample
    gradient (``conv.conv_route``'s test), else the per-sample gradient, materialised."""
    if not layer.weight.requires_grad:
        return STD_GRAM, "the weight is frozen; ||Σ_l b_l||² for the bias"
    L, p, d = conv_dims(layer, activations[0])
    if gram_is_cheaper(L, p, d):
        return STD_GRAM, (f"(2) with the Gram route: 2L² = {2 * L * L} < pd = {p * d} "
                          f"(L = {L} output positions)")
    return MATERIALISE, f"2L² = {2 * L * L} >= pd = {p * d} (L = {L} output positions)"


RULE = register_rule(LayerRule("weight-standardised convolution (o = conv(a, W') + c)",
                               grad=std_conv_grad_sampler, norm=std_conv_norm_sampler,
                               route=std_conv_route, routes=(STD_GRAM, MATERIALISE),
                               matches=lambda layer: std_conv_eps(layer) is not None,
                               streams=True))


__all__ = ["RULE", "STD_GRAM", "candidate", "expected", "standardised", "std_conv_eps",
           "std_conv_grad_sampler", "std_conv_norm_sampler", "std_conv_route"]
