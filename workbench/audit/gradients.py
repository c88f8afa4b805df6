"""Gradient audit: do a method's per-sample gradients equal micro-batching's?

Micro-batching (one forward and backward pass per sample) is the obviously-correct
per-sample gradient; Opacus validates every grad sampler against it (Yousefpour et al. 2021,
"Opacus: User-Friendly Differential Privacy Library in PyTorch", arXiv 2109.12298,
Appendix A). ``audit_gradients`` runs the reference and each method on a copy of the model
cast to ``dtype`` and compares, per parameter p and per sample i:

    err(m, p)  = max_{i,k} |g^m_{i,p,k} - g^ref_{i,p,k}| / max_{i,k} |g^ref_{i,p,k}|
    err_i(m)   = max_p max_k |g^m_{i,p,k} - g^ref_{i,p,k}| / max_{i,k} |g^ref_{i,p,k}|
    norm(m)    = max_i | ||g^m_i|| - ||g^ref_i|| | / max_i ||g^ref_i||

so max_i err_i(m) = max_p err(m, p), and err_i names the samples that disagree.

Ghost-style methods materialise no g_i and are audited on what they produce: "ghost" on its
per-sample norms ||g_i|| and both on the clipped sum Σ_i min(1, C/||g_i||) g_i at C = the
median reference norm (so some samples are clipped and some are not).

Tolerance (relative): float64 1e-9, float32 1e-4. Correct methods differ from the reference
only by summation order: ~1e-14 in float64, ~1e-6 in float32 (eps 1.2e-7 times sums of up
to ~1e3 terms); a real bug (a wrong sampler, a 1/n, a swapped sample) is far above both.

Notation: n batch size, g_i per-sample gradient, C clip norm, m method, p parameter.
"""

import copy
import math
from dataclasses import dataclass

import pandas as pd
import torch

from workbench.audit.result import AuditResult
from workbench.clipping import clipped_grad_sum, per_sample_grad_norms
from workbench.clipping.flat import clip_factors, grad_norms, weighted_sum
from workbench.per_sample import METHODS, per_sample_gradients
from workbench.per_sample.checks import forward
from workbench.per_sample.leaves import leaves
from workbench.per_sample.selfcheck import halves_differ
from workbench.per_sample.uses import advanced, generator_states
from workbench.viz.audit import plot_gradient_audit

GHOST_METHODS = ("ghost", "bookkeeping")
TOLERANCES = {
    torch.float64: (1e-9, "float64: methods differ by summation order, 1e-9"),
    torch.float32: (1e-4, "float32: eps 1.2e-7 x sums of ~1e3 terms, 1e-4"),
}


@dataclass
class GradientAudit(AuditResult):
    """The verdict of ``audit_gradients``: one table row per (method, parameter).

    ``table`` columns: method, parameter, layer, quantity, max_abs_error, max_rel_error,
    norm_rel_error, tolerance, tolerance_reason, passed, error. ``per_sample_errors``: one
    column per method, one row per sample i: err_i (for "ghost": its norm error; NaN where
    a method gives no per-sample quantity or failed).
    """

    table: pd.DataFrame
    per_sample_errors: pd.DataFrame
    reference: str
    dtype: torch.dtype
    tolerance: float
    max_grad_norm: float

    @property
    def passed(self) -> bool:
        return bool(self.table["passed"].all())

    def worst(self) -> pd.Series:
        """Max relative error per method (per-sample grads, clipped sums and norms)."""
        errs = self.table[["max_rel_error", "norm_rel_error"]].max(axis=1, skipna=True)
        return errs.groupby(self.table["method"], sort=False).max()

    def failed_methods(self) -> list[str]:
        return list(dict.fromkeys(self.table.loc[~self.table["passed"], "method"]))

    def verdict(self) -> str:
        versus = f"{self.reference} ({str(self.dtype).removeprefix('torch.')}, " \
                 f"tolerance {self.tolerance:.0e})"
        if self.passed:
            return f"PASSED: {', '.join(self.worst().index)} agree with {versus}"
        return f"FAILED: {', '.join(self.failed_methods())} disagree with {versus}"

    @property
    def summary(self) -> str:
        return self.verdict()

    float_format = "{:.2e}"

    def plot(self, ax):
        """``workbench.viz.audit.plot_gradient_audit``: worst error per method; artists."""
        return plot_gradient_audit(ax, self)


def _cast(x, dtype):
    """Floating tensors (also inside tuples) to ``dtype``; integer ones untouched."""
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def _check_choices(methods, reference, providers, dtype):
    if reference not in METHODS:
        raise ValueError(f"reference must be one of {METHODS}; got {reference!r}")
    valid = (*METHODS, *GHOST_METHODS, *providers)
    unknown = [m for m in methods if m not in valid]
    if unknown:
        raise ValueError(f"methods {unknown} unknown; valid choices are {valid} "
                         f"(pass other implementations as providers={{name: callable}})")
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype must be one of {tuple(TOLERANCES)}; got {dtype!r}")


# A parameter's error is relative to max(its own largest entry, FLOOR x the model's largest
# entry). Without the floor, a parameter whose true gradient is zero (the key bias of attention:
# softmax ignores a shift shared by all keys) is judged on its rounding noise alone, 1e-21 / 1e-21.
# With it, a parameter that small can hide an error of at most FLOOR x tolerance of the model's
# scale, far below anything that moves a per-sample norm or a clipping decision.
FLOOR = 1e-3


def relative_error(g: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |g - ref| / max(max |ref|, floor) (the absolute error when both are zero)."""
    scale = max(ref.abs().max().item(), floor)
    err = (g - ref).abs().max().item()
    return err / scale if scale > 0 else err


def model_floor(ref: dict) -> float:
    """FLOOR x the largest |entry| of any reference gradient: the scale a zero gradient meets."""
    return FLOOR * max((r.abs().max().item() for r in ref.values() if r.numel()), default=0.0)


def _per_sample_relative(g, ref, floor=0.0):
    """(n,) max_k |g_i - ref_i| / max(max |ref|, floor): which samples disagree on one parameter."""
    scale = max(ref.abs().max().item(), floor) or 1.0
    return (g - ref).reshape(g.shape[0], -1).abs().amax(1) / scale  # (n,); 0-dim params too


def _layer_types(model):
    """param name -> class name of the module that owns it ("Conv2d", "Embedding", ...)."""
    owners = {}
    for module_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            owners[f"{module_name}.{p_name}" if module_name else p_name] = type(module).__name__
    return owners


def _row(method, name, layer, quantity, err, abs_err, norm_err, tol):
    errors = [e for e in (err, norm_err) if not math.isnan(e)]
    passed = bool(errors) and max(errors) <= tol[0]
    return dict(method=method, parameter=name, layer=layer, quantity=quantity,
                max_abs_error=abs_err, max_rel_error=err, norm_rel_error=norm_err,
                tolerance=tol[0], tolerance_reason=tol[1], passed=passed, error="")


def _failed_row(method, message, tol, name="", layer=""):
    nan = float("nan")
    row = _row(method, name, layer, "per-sample grads", nan, nan, nan, tol)
    row["error"] = message
    return row


def _audit_per_sample(method, grads, ref, layers, tol):
    """Rows per parameter and the (n,) per-sample errors of materialised per-sample grads."""
    missing = sorted(set(ref) - set(grads))
    if missing:
        return [_failed_row(method, f"missing parameters {missing}", tol)], None
    rows_match = all(grads[k].shape[:1] == r.shape[:1] for k, r in ref.items())
    norm_err = relative_error(grad_norms({k: grads[k] for k in ref}), grad_norms(ref)) \
        if rows_match else float("nan")  # a wrong number of rows: no per-sample norm
    floor = model_floor(ref)
    rows, per_sample = [], []
    for name, r in ref.items():
        g = grads[name]
        if g.shape != r.shape:
            msg = f"shape {tuple(g.shape)}, expected {tuple(r.shape)}"
            rows.append(_failed_row(method, msg, tol, name, layers[name]))
            continue
        g = g.to(r.dtype)
        per_sample.append(_per_sample_relative(g, r, floor))  # (n,)
        abs_err = (g - r).abs().max().item()
        rows.append(_row(method, name, layers[name], "per-sample grads",
                         relative_error(g, r, floor), abs_err, norm_err, tol))
    errs = torch.stack(per_sample).amax(0) if per_sample else None  # (n,)
    return rows, errs


def _audit_ghost(method, make_model, loss_fn, inputs, targets, ref_sum, ref_norms, C, layers,
                 tol):
    """Rows of a ghost-style method: clipped sums per parameter, norms (ghost only)."""
    norms, norm_err, errs = None, float("nan"), None
    if method == "ghost":
        norms = per_sample_grad_norms(make_model(), loss_fn, inputs, targets, method="ghost")
        norm_err = relative_error(norms, ref_norms)
        errs = (norms - ref_norms).abs() / (ref_norms.abs().max().item() or 1.0)  # (n,)
    got = clipped_grad_sum(make_model(), loss_fn, inputs, targets, C, method=method)
    rows, floor = [], model_floor(ref_sum)
    for name, r in ref_sum.items():
        g = got[name]
        rows.append(_row(method, name, layers[name], f"clipped sum (C={C:.3g})",
                         relative_error(g, r, floor), (g - r).abs().max().item(), norm_err, tol))
    return rows, errs


def _audit_norms(method, norms, ref_norms, tol):
    """One row for a provider that returns per-sample norms ||g_i|| (n,) only."""
    norms = norms.to(ref_norms.dtype).reshape(-1)
    if norms.shape != ref_norms.shape:
        return [_failed_row(method, f"norms of shape {tuple(norms.shape)}, expected "
                                    f"{tuple(ref_norms.shape)}", tol)], None
    err = relative_error(norms, ref_norms)
    errs = (norms - ref_norms).abs() / (ref_norms.abs().max().item() or 1.0)  # (n,)
    return [_row(method, "(all)", "", "per-sample norms", float("nan"),
                 (norms - ref_norms).abs().max().item(), err, tol)], errs


def audit_gradients(model, loss_fn, inputs, targets, methods=("einsum", "vmap", "ghost"),
                    reference="microbatch", providers=None, dtype=torch.float64):
    """Compare every method (and provider) with ``reference``; returns a :class:`GradientAudit`.

    Args:
        model, loss_fn, inputs, targets: as for ``wb.per_sample_gradients``. The model is
            not changed: each method runs on its own copy cast to ``dtype``.
        methods: names from ``wb.METHODS``, ``"ghost"``, ``"bookkeeping"`` or ``providers``.
        reference: the per-sample method trusted as truth (micro-batching by default).
        providers: ``{name: callable(model, loss_fn, inputs, targets) -> {name: (n, ...)}}``;
            every provider is audited (whether or not it is listed in ``methods``).
        dtype: torch.float64 (tolerance 1e-9) or torch.float32 (1e-4).

    A method that raises gives a failed row carrying its error message; the audit goes on.
    """
    providers = dict(providers or {})
    methods = tuple(dict.fromkeys((*methods, *providers)))
    _check_choices(methods, reference, providers, dtype)
    tol = TOLERANCES[dtype]
    inputs, targets = _cast(inputs, dtype), _cast(targets, dtype)

    def make_model():
        return copy.deepcopy(model).to(dtype)

    coupled = _coupling(make_model(), inputs, tol[0])  # before any method runs
    ref = per_sample_gradients(make_model(), loss_fn, inputs, targets, method=reference,
                               check=False)  # the records alone: coupling is the "model" row's
    if not ref:
        raise ValueError("model has no trainable parameters (requires_grad=True): nothing to audit")
    ref_norms = grad_norms(ref)  # (n,)
    C = float(ref_norms.median()) or 1.0  # some samples clipped, some not
    ref_sum = weighted_sum(ref, clip_factors(ref_norms, C))  # {name: (*shape)}
    layers = _layer_types(model)
    rows, per_sample = ([] if coupled is None else [_failed_row("model", coupled, tol)]), {}
    for method in methods:
        try:
            if method in GHOST_METHODS:
                new, errs = _audit_ghost(method, make_model, loss_fn, inputs, targets, ref_sum,
                                         ref_norms, C, layers, tol)
            else:
                run = providers.get(method) or _builtin(method)
                grads = run(make_model(), loss_fn, inputs, targets)
                if isinstance(grads, torch.Tensor):  # a provider of per-sample norms (n,)
                    new, errs = _audit_norms(method, grads, ref_norms, tol)
                else:
                    new, errs = _audit_per_sample(method, grads, ref, layers, tol)
        except Exception as exc:  # noqa: BLE001  (any failure of the audited code is a finding)
            new, errs = [_failed_row(method, f"{type(exc).__name__}: {exc}", tol)], None
        rows += new
        per_sample[method] = float("nan") if errs is None else errs.detach().cpu().numpy()
    n = len(ref_norms)
    return GradientAudit(table=pd.DataFrame(rows),
                         per_sample_errors=pd.DataFrame(per_sample, index=pd.RangeIndex(n)),
                         reference=reference, dtype=dtype, tolerance=tol[0], max_grad_norm=C)


def _coupling(model, inputs, tol: float) -> str | None:
    """Why no per-sample gradient describes the model's training, or None: the model's
    outputs for each half of the batch, run on that half alone, must be the batch's
    (``selfcheck.halves_differ``). A model that centres or scales by a statistic of the
    batch (x - x.mean(0)) has no per-record gradient: the reference runs each record alone,
    and a method that does too (vmap) agreed with it, "passed", until 2026-11-30.
    A forward pass drawing random numbers (dropout in training mode) is refused: every
    method and the reference would draw other masks (each row failed, relative error ~1,
    with no word of why)."""
    n = next((int(t.shape[0]) for t in leaves(inputs)
              if isinstance(t, torch.Tensor) and t.dim()), 0)
    with torch.no_grad(), torch.random.fork_rng():
        before = generator_states()
        try:
            forward(model, inputs)
        except Exception:  # noqa: BLE001  (the methods' rows say why it cannot run)
            return None
        drew = advanced(before)
    if drew:
        raise ValueError(
            "the model draws random numbers in its forward pass (dropout in training mode, "
            "a random augmentation inside it): every method, and the reference, would draw "
            "other numbers, so no per-sample gradient can be compared. Audit the model in "
            "evaluation mode (model.eval()) or with its dropout probabilities set to 0")
    if n < 2:
        return None
    found = halves_differ(model, inputs, n, tol, 1e-12 if tol < 1e-6 else 1e-6)
    if found is None:
        return None
    part, off = found
    return (f"the model couples the records: its outputs for records {part.start}.."
            f"{part.stop - 1} change (their sums by up to {off:.3g}) when it runs on them "
            f"alone instead of the whole batch of {n} (a statistic of the batch in its "
            f"forward: x - x.mean(0), a BatchNorm in training mode), so no per-sample "
            f"gradient is the gradient its training computes: the reference and any method "
            f"that runs records alone agree with each other and with nothing else")


def _builtin(method):
    def run(model, loss_fn, inputs, targets):
        return per_sample_gradients(model, loss_fn, inputs, targets, method=method)

    return run


__all__ = [
    "FLOOR", "GHOST_METHODS", "TOLERANCES", "GradientAudit", "audit_gradients", "model_floor",
    "relative_error",
]
