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

and the bias's is the convolution's own. The norm materialises g_i (no Gram identity survives
the Jacobian); book-keeping's clipped sum re-runs the layer on its stored input with c ⊙ b
(``clipping/engine.py``), through the standardisation.

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

from workbench.rules._rule import PROBE_ERRORS, LayerRule, probe_forward, register_rule
from workbench.rules.conv_grads import conv_grad_sampler

EPS = (1e-6, 1e-5, 1e-8, 1e-10)  # tried after the layer's own ``eps``
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TOLERANCE = 1e-10  # relative, float64 probe


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
    (cached per layer, its ``eps`` attribute and its weight's shape and dtype: a layer whose
    ``eps`` is set after its first call is probed again, its rule never keeps the old ε)."""
    w = getattr(layer, "weight", None)
    key = (getattr(layer, "eps", None), getattr(w, "shape", None), getattr(w, "dtype", None))
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
        along = v.new_empty(n, filters, 1)  # mean(g' ⊙ W'), one sample's product at a time
        for i in range(n):
            torch.sum(v[i] * Wn, dim=-1, keepdim=True, out=along[i])
        along.div_(m)
        v.sub_(v.mean(-1, keepdim=True)).addcmul_(Wn, along, value=-1).div_(s)
    return out


RULE = register_rule(LayerRule("weight-standardised convolution (o = conv(a, W') + c)",
                               grad=std_conv_grad_sampler,
                               matches=lambda layer: std_conv_eps(layer) is not None))


__all__ = ["RULE", "candidate", "expected", "standardised", "std_conv_eps",
           "std_conv_grad_sampler"]
