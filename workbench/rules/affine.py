"""Elementwise-affine layers, recognised by what they compute: the RMSNorm / LayerNorm family.

Many layers compute, position by position,

    o = A(a) + B(a) ⊙ w  (+ β)                      w: weight, β: bias, same shape

where A and B do not depend on w or β: Hugging Face's ``LlamaRMSNorm`` and its copies
(Mistral, Qwen2/3, Mamba: w ⊙ â, â computed in float32), Gemma's (1 + w) ⊙ â (A = B = â),
``T5LayerNorm``, timm's ``LayerNorm`` subclass and channels-first ``LayerNorm2d``. For all of
them (the normalisation rule of ``norms.py``, Opacus blog "Efficient per-sample gradient
computation for more layers")

    ∂ℓ_i/∂w = Σ_{positions} b_i ⊙ B(a_i),      ∂ℓ_i/∂β = Σ_{positions} b_i

and B(a) = o(w = 1, β = 0) − o(w = 0, β = 0): two passes of the layer's *own* forward with its
parameters swapped, so whatever it does inside (a float32 upcast, a (1 + w) scale, permutes)
is reproduced exactly, and no name or class is trusted.

``affine_layout(layer)`` is the test behind the rule (``LayerRule(matches=...)``): on probe
inputs, o(w', β') must equal A + B ⊙ w' + β' for random w', β' with w on the last dims
("last": (n, ..., *w.shape)) or on dim 1 ("channel": (n, C, ...), LayerNorm2d); a layer for
which neither holds keeps per-layer vmap.

The probe's tolerance is that of the dtype the layer *computes* in (``compute_dtype``): Gemma's
RMSNorm multiplies by (1 + w) in float32 even in a float64 model, so its output is affine in w
only up to float32 rounding. Its autograd gradient carries the same rounding (Σ_t b ⊙ â summed
in float32), so b ⊙ B(a) in float64 differs from it by float32 rounding, never more: the
layer itself is no more exact than that. A float64 output holding only float32 values is how
the probe knows (a float64 computation fills the low bits).

Notation: n batch, a activations, b backprops, w weight, β bias, â normalised input.
"""

import weakref

import torch
from torch.nn.utils.stateless import _reparametrize_module

from workbench.errors import UnsupportedLayerError
from workbench.rules._rule import PROBE_ERRORS, LayerRule, probe_forward, register_rule
from workbench.rules.conv_chunks import in_chunks

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}  # relative, per probe, by compute dtype


def compute_dtype(out: torch.Tensor) -> torch.dtype:
    """The dtype a layer computed its output in: float32 where a float64 output holds only
    float32 values (Gemma's ``(x.float() * (1 + w.float())).type_as(x)``), else its own."""
    if out.dtype == torch.float64 and torch.equal(out.float().double(), out):
        return torch.float32
    return out.dtype


def run(layer, a, weight, bias=None):
    """The layer's own forward with weight (and bias) swapped; no hooks run."""
    params = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
    with _reparametrize_module(layer, params):
        return probe_forward(layer, a)


def parts(layer, a):
    """(A(a), B(a)) of o = A + B ⊙ w + β, by two forward passes."""
    w, bias = layer.weight, getattr(layer, "bias", None)
    zero_b = None if bias is None else torch.zeros_like(bias)
    A = run(layer, a, torch.zeros_like(w), zero_b)
    return A, run(layer, a, torch.ones_like(w), zero_b) - A


def aligned(t: torch.Tensor, out: torch.Tensor, layout: str) -> torch.Tensor:
    """A parameter-shaped tensor viewed to broadcast against the output ``out``."""
    if layout == "channel":
        return t.reshape(1, -1, *[1] * (out.dim() - 2))
    return t


def candidate(layer) -> bool:
    own = dict(layer.named_parameters(recurse=False))
    w, bias = own.get("weight"), own.get("bias")
    return (w is not None and w.dim() >= 1 and set(own) <= {"weight", "bias"}
            and (bias is None or bias.shape == w.shape)
            and not any(True for _ in layer.children()))


def probe_inputs(w: torch.Tensor):
    g = torch.Generator().manual_seed(0)
    yield "last", torch.randn(2, 3, *w.shape, generator=g, dtype=w.dtype)
    if w.dim() == 1:
        yield "channel", torch.randn(2, w.shape[0], 3, 3, generator=g, dtype=w.dtype)


def affine_layout(layer) -> str | None:
    """"last" or "channel" where the layer is o = A + B ⊙ w (+ β) on the probes, else None."""
    if not candidate(layer) or layer.weight.dtype not in TOLERANCE:
        return None
    w, bias = layer.weight.detach(), getattr(layer, "bias", None)
    g = torch.Generator().manual_seed(1)  # the probe's own values: no global draw
    for layout, a in probe_inputs(w):
        try:
            with torch.no_grad():
                A, B = parts(layer, a.to(w.device))
                w2 = torch.randn(w.shape, generator=g, dtype=w.dtype).to(w.device)
                b2 = None if bias is None else torch.randn(
                    bias.shape, generator=g, dtype=bias.dtype).to(bias.device)
                out = run(layer, a.to(w.device), w2, b2)
                want = A + B * aligned(w2, out, layout)
                if b2 is not None:
                    want = want + aligned(b2, out, layout)
        except PROBE_ERRORS:
            continue
        tol = TOLERANCE.get(compute_dtype(out), TOLERANCE[w.dtype])
        if out.shape == want.shape and (out - want).norm() <= tol * want.norm():
            return layout
    return None


def sum_to_parameter(t: torch.Tensor, layout: str, shape: tuple) -> torch.Tensor:
    """(n, *shape): t (n, ...), o's shape, summed over every dim along which the parameter
    (of ``shape``) was broadcast. "last": the parameter is right-aligned with o, so a size-1
    dim of it (ConvNeXt-V2's GRN weight (1, 1, 1, C) on (n, H, W, C); a (C, 1, 1) scale on
    (n, C, H, W)) is summed too, and a leading dim of it that reaches o's batch dim must be 1
    (one parameter for every sample)."""
    n, rest = t.shape[0], t.dim() - 1
    if layout == "channel":
        return t.sum(dim=tuple(range(2, t.dim()))) if t.dim() > 2 else t  # (n, C)
    inner = tuple(shape[max(0, len(shape) - rest):])  # the parameter's dims within a sample
    if any(s != 1 for s in shape[:len(shape) - len(inner)]):
        raise UnsupportedLayerError(
            f"a parameter of shape {tuple(shape)} is broadcast against an output of shape "
            f"{tuple(t.shape)}: its dim {len(shape) - len(inner) - 1} reaches the batch dim 0, "
            f"so each sample would use another slice of it; the elementwise-affine rule "
            f"(rules/affine.py) needs one parameter for every sample")
    return t.sum_to_size(n, *[1] * (rest - len(inner)), *inner).reshape(n, *shape)


_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layout_of(layer) -> str | None:
    """``affine_layout(layer)``, cached per layer and weight shape and dtype: its probe runs
    the layer's forward three times per layout, once, not on every recorded call."""
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    key = (tuple(w.shape), w.dtype, w.device)
    known = _LAYOUTS.setdefault(layer, {})
    if key not in known:
        known[key] = affine_layout(layer)
    return known[key]


def still_affine(layer, a, A, B, layout: str) -> None:
    """The probe's verdict on *this* call's input: the layer's own forward at a weight and
    bias near its own (w + δ, β + ε) must be A + B ⊙ (w + δ) + β + ε row by row, else
    ``UnsupportedLayerError``. The probe's inputs are a few random rows; a subclass that
    clamps its output (``super().forward(x).clamp(-L, L)``) or branches on the data
    (``where(x.abs() > 4, w², w)``) is affine on them and not on a batch that reaches the
    clamp or the branch: b ⊙ B(a) was then the wrong gradient (3.7e-2 of the clipped sum,
    silently, for the records the self-check does not compare, until 2026-11-30). One more
    forward pass of the layer per call."""
    w, bias = layer.weight.detach(), getattr(layer, "bias", None)
    g = torch.Generator().manual_seed(2)
    w2 = w + 0.1 * (w.abs() + 1) * torch.randn(w.shape, generator=g, dtype=w.dtype).to(w.device)
    b2 = None if bias is None else bias.detach() + 0.1 * torch.randn(
        bias.shape, generator=g, dtype=bias.dtype).to(bias.device)
    out = run(layer, a, w2, b2)
    if out.shape != A.shape or out.dtype != A.dtype:
        worst = 0
    else:  # out - (A + B ⊙ w' + β'), in out's own buffer: no activation-sized temporary
        tol = TOLERANCE.get(compute_dtype(out), TOLERANCE.get(w.dtype, 1e-4))
        n = out.shape[0] if out.dim() else 1
        scale = torch.linalg.vector_norm(out.reshape(n, -1), dim=1)
        out.sub_(A).addcmul_(B, aligned(w2, out, layout), value=-1)
        if b2 is not None:
            out.sub_(aligned(b2, out, layout))
        diff = torch.linalg.vector_norm(out.reshape(n, -1), dim=1)
        if bool((diff <= tol * (scale + diff) + 1e-30).all()):
            return
        worst = int((diff / scale.clamp_min(1e-300)).argmax())
    raise UnsupportedLayerError(
        f"{type(layer).__name__} computed o = A(a) + B(a) ⊙ weight + bias on the probe's "
        f"inputs, so it took the elementwise-affine rule (rules/affine.py), but not on this "
        f"batch (record {worst}: its forward clamps its output, or branches on the data or "
        f"the weight's values, where the probe did not reach): its per-sample gradient is not "
        f"b ⊙ B(a) here. Register a rule for it (wb.register_grad_sampler), or use "
        f"method='vmap' or 'microbatch', which differentiate the layer as it runs")


SCRATCH = 4  # A, B, the output near w (``still_affine``) and b ⊙ B: numbers per input number


def affine_grad_sampler(layer, activations, backprops):
    """{'weight': Σ b ⊙ B(a), 'bias': Σ b} (n, *w.shape), over the batch in chunks whose
    scratch (``SCRATCH`` times their input) is bounded by the call's a and b
    (``conv_chunks.in_chunks``), so book-keeping streams it (``LayerRule.streams``)."""
    a = activations[0]
    return in_chunks(_affine_grads, layer, a, backprops,
                     SCRATCH * (a[0].numel() if a.dim() and a.shape[0] else 0))


def _affine_grads(layer, activations, backprops):
    layout, a = layout_of(layer), activations[0]
    shape = tuple(layer.weight.shape)
    out = {}
    with torch.no_grad():
        A, B = parts(layer, a.detach())
        still_affine(layer, a.detach(), A, B, layout)
    del A
    if layer.weight.requires_grad:
        out["weight"] = sum_to_parameter(backprops * B, layout, shape)  # Σ b ⊙ B(a)
    bias = getattr(layer, "bias", None)
    if bias is not None and bias.requires_grad:
        out["bias"] = sum_to_parameter(backprops, layout, shape)  # Σ b
    return out


_ROW_WISE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def row_wise(layer) -> bool:
    """Does the layer work row by row ("last" layout, and on a probe each row of its output
    depends on that row alone and the leading dims do not matter)? Then it may be called on
    batch-flattened rows (``per_sample/flat_rows.py``); cached per layer."""
    if layer not in _ROW_WISE:
        _ROW_WISE[layer] = layout_of(layer) == "last" and rows_independent(layer)
    return _ROW_WISE[layer]


def rows_independent(layer) -> bool:
    w = layer.weight.detach()
    a = torch.randn(4, *w.shape, generator=torch.Generator().manual_seed(1),
                    dtype=w.dtype).to(w.device)
    try:
        with torch.no_grad():
            rows, one = probe_forward(layer, a), probe_forward(layer, a[1:2])
            grid = probe_forward(layer, a.reshape(2, 2, *w.shape)).reshape(rows.shape)
    except PROBE_ERRORS:
        return False
    tol = TOLERANCE.get(compute_dtype(rows), TOLERANCE.get(w.dtype, 1e-4))
    return all(x.shape == y.shape and (x - y).norm() <= tol * y.norm()
               for x, y in ((rows[1:2], one), (grid, rows)))


RULE = register_rule(LayerRule("elementwise affine (o = A(a) + B(a) ⊙ w + β)",
                               grad=affine_grad_sampler, rows=row_wise,
                               matches=lambda layer: layout_of(layer) is not None,
                               streams=True))


__all__ = [
    "RULE", "SCRATCH", "TOLERANCE", "affine_grad_sampler", "affine_layout", "aligned", "candidate",
    "layout_of", "parts", "probe_inputs", "row_wise", "rows_independent", "run",
    "still_affine", "sum_to_parameter",
]
