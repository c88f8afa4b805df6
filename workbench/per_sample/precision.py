"""Mixed precision: per-sample gradients of a model trained under ``torch.autocast``.

Under ``torch.autocast(device, dtype=bfloat16 | float16)`` a layer's parameters stay in their
own dtype (float32), but the layer computes in the autocast dtype: a Linear's recorded
activations a (the output of an earlier autocast layer) and its backprops b are bfloat16 or
float16. The per-layer rules (Yousefpour et al. 2021, arXiv 2109.12298, Eq. 4-5) then read

    g_i = b_iᵀ a_i        computed here in the parameter's dtype: a and b are *widened*

(``widen``, once per call when its backprops arrive: ``hooks.LayerCall.set_backprops``), so
every per-sample gradient, norm (float64 squares, ``clipping/flat.py``), clip factor
c_i = min(1, C / ||g_i||) and clipped sum Σ_i c_i g_i is computed in float32, and the bound
||c_i g_i|| ≤ C holds in float32 arithmetic whatever the autocast dtype. The rules' own
re-runs of a layer (vmap, micro-batching, book-keeping's weight gradient of a layer that is not
a Linear) and the norm samplers' products run with autocast *off* on the widened inputs
(``full_precision``).

The exact twins that check them (``selfcheck.probe``, ``record_probe``, the whole-model
fallback) re-run the *model*, and a model is what it computes: they run under the autocast
state its recorded forward pass ran under (``state``, read in the forward pre-hook next to the
random state; ``replayed``), and the comparison's tolerance is the autocast dtype's
(``tolerance``): bfloat16 keeps 8 significant bits (relative rounding 2⁻⁸ ≈ 4e-3 per
operation), float16 11 (2⁻¹¹ ≈ 5e-4, but no loss scale inside the twins, so small gradients
lose bits to float16's range): both are compared at ``selfcheck.TOLERANCE`` 5e-2, far below
the O(1) error of a wrong row, a missed use or a mixed batch.

Why the rules do not re-run layers under autocast too: norms and clipped sums must come from
the same float32 g_i for the bound to hold in float32 (a layer re-run in bfloat16 would round
c_i b_i to 8 bits inside book-keeping's weight gradient, letting ||c_i g_i|| pass C by ~2⁻⁹).
A layer whose forward itself depends on the autocast state beyond rounding is then caught by
the twins, which do replay it. ``torch.func.vmap`` of a whole model under autocast fails for
some layers (a LayerNorm on a bfloat16 input: torch's batching rule); method='vmap' then
raises naming autocast (``functional.vmap_or_explain``), and the optimizer's whole-model
fallback falls back to micro-batching (``fallback.py``), both under the recorded state.

What stays outside the bound: a record's backprop is rounded to the autocast dtype *after* the
mean-reduced loss scaled it by 1/n (b_i / 6 and b_i / 5 round differently; the forward rows
themselves were identical in our check), so removing record j also moves the *others'*
contributions by their rounding (~2⁻⁸ relative each in bfloat16; measured 1.2e-3 C in total
with n = 6, a Conv1d model). Each record's own clipped contribution is still ≤ C;
``tests/dpsgd/test_mixed_precision.py`` bounds the rest.

Cost: the widened copies of a call's bfloat16 activations and backprops are float32 (twice
their size) while the clipping engine holds them.

Notation: n batch size, a activations, b backprops, g_i per-sample gradient, C max_grad_norm.
"""

import functools
from contextlib import ExitStack, contextmanager

import torch
from torch.utils._pytree import tree_map


def state(device: torch.device) -> torch.dtype | None:
    """The autocast dtype active for ``device`` now (bfloat16, float16), or None when off."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if not torch.is_autocast_enabled(kind):  # no new device object: a cost of every call
        return None
    return torch.get_autocast_dtype(kind)


@contextmanager
def replayed(dtype: torch.dtype | None, device: torch.device):
    """Inside: the autocast state ``dtype`` (None: off) for ``device``, whatever the caller's."""
    kind = torch.device(device).type
    with torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
        yield


def autocast_on() -> list[str]:
    """The device kinds (CPU, and CUDA where present) whose autocast is on now."""
    kinds = ["cpu"] if torch.is_autocast_enabled("cpu") else []  # the flags first: cheaper
    if torch.is_autocast_enabled("cuda") and torch.cuda.is_available():  # than is_available
        kinds.append("cuda")
    return kinds


@contextmanager
def full_precision():
    """Autocast off (CPU, and CUDA where present): the rules compute in the widened inputs'
    dtype, also when they run inside the user's autocast block (the functional API, a step
    taken inside it)."""
    kinds = autocast_on()  # entering one is slow (~100 µs), a fixed cost of every rule call:
    with ExitStack() as stack:  # only if on
        for kind in kinds:
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def in_full_precision(rule):
    """``rule`` run under ``full_precision`` (called directly when no autocast is on: the
    same computation without a context manager's fixed cost, paid by every rule call)."""
    @functools.wraps(rule)
    def run(*args, **kwargs):
        if not autocast_on():
            return rule(*args, **kwargs)
        with full_precision():
            return rule(*args, **kwargs)

    return run


def widen(tree, dtype: torch.dtype | None):
    """Every floating Tensor of ``tree`` narrower than ``dtype`` cast to it; others as they are
    (integer indices, Tensors already as wide). ``dtype`` None: ``tree`` unchanged."""
    if dtype is None:
        return tree

    def up(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype \
                and torch.finfo(t.dtype).bits < torch.finfo(dtype).bits:
            return t.detach().to(dtype)
        return t

    return tree_map(up, tree)


def layer_dtype(layer) -> torch.dtype | None:
    """The dtype a layer's rules compute in: its first floating parameter's."""
    for p in layer.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


# relative tolerance of the self-checks' comparisons: float64 methods agree to ~1e-13; float32
# to ~1e-5; a wrong row, a missed use or a mixed batch is off by O(1). Under autocast the
# tolerance is the autocast dtype's (bfloat16 rounds at 2^-8 per operation), and float32 work
# that the device rounds to TF32's ten mantissa bits (``reduced_float32``) is compared as
# float16 is: the same ten bits.
TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-3, torch.float16: 5e-2,
             torch.bfloat16: 5e-2}
REDUCED_FLOAT32 = TOLERANCE[torch.float16]


def reduced_float32(device) -> str | None:
    """Why float32 products on ``device`` round coarser than float32, or None: CUDA's TF32
    (ten mantissa bits, rounding ~5e-4 per product; PyTorch runs cuDNN convolutions in TF32 by
    default, ``torch.backends.cudnn.allow_tf32``), or a float32 matmul precision below
    "highest" (TF32 or bfloat16 inside float32 products, any device). Measured on an H200
    (2026-11-30): the CIFAR-10 CNN's per-sample gradients off their exact twins by 3.2e-3
    relative in float32 under the default flags, past float32's tolerance, no wrong rule."""
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        return f"torch.get_float32_matmul_precision() is {precision!r}"
    if getattr(device, "type", device) == "cuda":
        if torch.backends.cuda.matmul.allow_tf32:
            return "torch.backends.cuda.matmul.allow_tf32 is True"
        if torch.backends.cudnn.allow_tf32:
            return ("torch.backends.cudnn.allow_tf32 is True, PyTorch's default: convolutions "
                    "round to TF32")
    return None


def tolerance_of(dtype: torch.dtype, device=None) -> float:
    """The relative tolerance of a comparison of ``dtype`` results computed on ``device``."""
    if dtype == torch.float32 and device is not None and reduced_float32(device):
        return REDUCED_FLOAT32
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def tolerance(rec) -> float:
    """The relative tolerance of a check of the recording ``rec`` (``compared_dtype``, and the
    device's TF32)."""
    return tolerance_of(compared_dtype(rec), getattr(rec, "device", None))


def described(rec) -> str:
    """The precision a check of ``rec`` compared at, in words (for its error message)."""
    dtype = compared_dtype(rec)
    why = reduced_float32(getattr(rec, "device", None)) if dtype == torch.float32 else None
    return f"{dtype}" if why is None else (
        f"{dtype} at TF32's precision ({why}; in a deep or ill-conditioned model TF32's "
        f"rounding alone can pass this tolerance: with torch.backends.cudnn.allow_tf32 = "
        f"False and torch.backends.cuda.matmul.allow_tf32 = False the check compares at "
        f"float32's)")


NARROW = (torch.bfloat16, torch.float16, torch.float32)


def value_dtype(t: torch.Tensor) -> torch.dtype:
    """The narrowest float dtype that holds every finite value of ``t`` exactly: the dtype a
    result was rounded to last, whatever it is returned as (a float32 step's update cast to
    float64 is float32's, a bfloat16 one bfloat16's; a float64 computation's is float64). A
    comparison of such results takes ``tolerance_of`` that dtype. Of several results, the
    widest decides (``widest``): a zero or a small integer fits any dtype. Empty, or not
    floating: ``t.dtype``."""
    if not t.is_floating_point():
        return t.dtype
    x = t.detach()
    x = x[torch.isfinite(x)]
    if x.numel() == 0:
        return t.dtype
    for dtype in NARROW:
        if torch.finfo(dtype).bits >= torch.finfo(t.dtype).bits:
            break
        if torch.equal(x.to(dtype).to(x.dtype), x):
            return dtype
    return t.dtype


def lowered_by(args, result) -> torch.dtype | None:
    """The dtype an op rounded a wider float input to (its float result narrower than its
    first float argument: Hugging Face's RMSNorm computing in ``x.to(torch.float32)`` inside a
    float64 model, ``F.softmax(x, -1, dtype=torch.float32)``), or None: a pass with such an
    op computes partly at that dtype's precision, so its checks take that tolerance."""
    x = args[0] if args else None
    if (isinstance(result, torch.Tensor) and isinstance(x, torch.Tensor)
            and result.dtype is not x.dtype and x.is_floating_point()
            and result.is_floating_point() and result.dtype.itemsize < x.dtype.itemsize):
        return result.dtype
    return None


class Lowering(torch.overrides.TorchFunctionMode):
    """Around a pass with no recording: ``lowered``, the narrowest dtype an op of the pass
    rounded a wider float to (``lowered_by``), or None."""

    def __init__(self):
        super().__init__()
        self.lowered: torch.dtype | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        dtype = lowered_by(args, result)
        if dtype is not None and (self.lowered is None
                                  or dtype.itemsize < self.lowered.itemsize):
            self.lowered = dtype
        return result


def unit_roundoff(dtype: torch.dtype) -> float:
    """The relative error of one rounding to ``dtype``: half its machine epsilon (2^-9 for
    bfloat16, 2^-24 for float32, 2^-53 for float64). The tolerance of a check of one stored
    result against its exact value (a σ = 0 step's update, ``audit/mechanism.py``,
    ``audit/report_suites.check_clipping``), where ``TOLERANCE`` is that of two computations
    of many operations each compared (bfloat16's 5e-2 there would pass a clip norm 10% high
    in a sum of ~30 clipped records)."""
    return float(torch.finfo(dtype).eps) / 2


def widest(dtypes) -> torch.dtype:
    """The dtype of the most bits among ``dtypes`` (float64 if none)."""
    return max(dtypes, key=lambda d: torch.finfo(d).bits, default=torch.float64)


def compared_dtype(rec) -> torch.dtype:
    """The dtype whose tolerance a check of ``rec`` uses: the autocast dtype of its forward
    pass if it ran under autocast, else the narrowest of the parameters' and any float dtype
    the forward pass cast to (``uses.UseTracker._cast``: an RMSNorm computing in float32
    inside a float64 model rounds at float32's precision)."""
    autocast = getattr(rec, "autocast", None)
    if autocast is not None:
        return autocast
    lowered = getattr(rec, "lowered", None)
    if lowered is not None and lowered.itemsize < rec.dtype.itemsize:
        return lowered
    return rec.dtype


__all__ = [
    "NARROW", "REDUCED_FLOAT32", "TOLERANCE", "Lowering", "autocast_on", "compared_dtype",
    "described", "lowered_by",
    "full_precision", "in_full_precision", "layer_dtype", "reduced_float32", "replayed", "state",
    "tolerance", "tolerance_of", "unit_roundoff", "value_dtype", "widen", "widest",
]
