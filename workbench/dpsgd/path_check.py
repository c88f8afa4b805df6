"""The user's ``.grad`` against Σ_i g_i, one parameter at a time (the optimizer's path check).

What it checks (``DPOptimizer``'s docstring): every gradient of the loss reaches the
parameters through the model's output, so ``.grad`` (autograd's gradient of the whole loss)
is the sum of the per-record gradients g_i that the rules recover from the recording. A
term outside the output (an L2 penalty, a loss reading a parameter directly) breaks it,
and DP-SGD could neither clip it per record nor drop it silently: the optimizer raises
``UnattributedGradientError``.

``.grad`` rescaled as a whole after the backward pass (``clip_grad_norm_``, a GradScaler's
``unscale_``) is harmless (DP-SGD never reads it), so the comparison allows one common
factor α over all parameters u_p = ``.grad`` and o_p = Σ_i g_i (their path gradient):

    min_α Σ_p ||u_p − α o_p||²  ≤  (tol · max_p max(||u_p||, |α| ||o_p||))²

**Without holding the sums.** Keeping every o_p until α is known costs one copy of the
parameters at the step's peak (the first, self-checked step's: the user's ``.grad`` is
alive too). Each parameter's own quadratic in α has its minimum r_p at α_p = ⟨u_p, o_p⟩ /
||o_p||² and curvature ||o_p||², so

    ||u_p − α o_p||² = r_p + (α − α_p)² ||o_p||²        (exactly)

and four numbers per parameter (r_p, α_p, ||o_p||², ||u_p||²) give every term at any α,
the best α = Σ_p α_p ||o_p||² / Σ_p ||o_p||² included. Both terms are non-negative and r_p
is computed from the tensors themselves (||u_p − α_p o_p||², in float64): the sum has no
cancellation, unlike the expansion Σ ||u||² − 2α⟨u, o⟩ + α²||o||², whose rounding (1e-16 of
||u||²) is a difference of 1e-8 ||u||, above float64's tolerance of 1e-7 relative once a
hundred parameters add up. So each o_p is compared as soon as it is complete and let go;
only a step of several backward passes (``.grad`` sums them) holds the sums until the last.
The float64 work goes over chunks of ``CHUNK`` entries: a vocabulary's embedding is not
copied whole in double.
"""

import math

import torch

from workbench.errors import (
    LoopError,
    NonFiniteGradientError,
    SampleMixingError,
    UnattributedGradientError,
)
from workbench.per_sample.fallback import alone_differs
from workbench.per_sample.recording import NOT_THE_BATCH

CHUNK = 1 << 14  # entries per float64 chunk (128 KiB each for u and o)


def _chunks(*tensors):
    flat = [t.reshape(-1) for t in tensors]
    for start in range(0, flat[0].numel(), CHUNK):
        yield [t[start:start + CHUNK].double() for t in flat]


def stats(u, o: torch.Tensor) -> tuple[float, float, float, float]:
    """(r_p, α_p, ||o_p||², ||u_p||²) of one parameter (module docstring); α_p = 0 where
    o_p = 0 (then r_p = ||u_p||² and the curvature is 0: α_p does not matter). ``u``: None
    for a parameter whose ``.grad`` is None (zero)."""
    uu = oo = uo = 0.0
    with torch.no_grad():
        if u is None:
            oo = sum(float(b.dot(b)) for b, in _chunks(o))
            return 0.0, 0.0, oo, 0.0
        for a, b in _chunks(u, o):
            uu += float(a.dot(a))
            oo += float(b.dot(b))
            uo += float(a.dot(b))
        alpha = uo / oo if oo > 0 else 0.0
        r = 0.0
        if oo > 0:
            for a, b in _chunks(u, o):
                r += float((a - alpha * b).pow(2).sum())
        else:
            r = uu
    return r, alpha, oo, uu


def grad_mark(p: torch.Tensor):
    """(identity, version) of ``p.grad``, None without one: equal marks, the same ``.grad``
    unchanged (an in-place edit bumps the version; a new tensor has another identity)."""
    g = p.grad
    return None if g is None else (id(g), g._version)


class PathCheck:
    """Collects each parameter's path gradient o_p and compares it with its ``.grad`` as it
    arrives (``add``), or, with ``hold`` (several backward passes in the step: ``.grad`` is
    their sum), sums them first; ``verdict`` then raises or returns. ``params``: {name: p}.
    ``free``: a compared ``.grad`` is let go (set to None; the optimizer's step replaces
    it), so the clipped sums that follow do not sit beside it."""

    def __init__(self, params: dict, hold: bool = False, free: bool = False,
                 marks: dict | None = None):
        self.marks, self.edited = marks or {}, []  # (grad_mark) after the backward pass;
        # names of parameters whose .grad changed since
        self.names = {}  # id -> name, each parameter once (a tied one under its first name)
        for name, p in params.items():
            self.names.setdefault(id(p), name)
        self.params = {key: params[name] for key, name in self.names.items()}
        self.hold, self.free, self.held, self.stats = hold, free, {}, {}

    def add(self, key: int, g: torch.Tensor) -> None:
        if key not in self.names:
            return
        if self.hold:
            self.held[key] = g if key not in self.held else self.held[key] + g
        elif key in self.stats:  # compared (and maybe let go) already: a part would be lost
            raise RuntimeError(f"internal error: a second part of the path gradient of "
                               f"{self.names[key]} arrived after it was compared; please "
                               f"report it")
        else:
            self._compare(key, g)

    def _compare(self, key: int, g: torch.Tensor) -> None:
        p = self.params[key]
        self._edited(key, p)
        user = None if p.grad is None else p.grad.detach()
        self.stats[key] = stats(user, g if user is None else g.to(user.dtype))
        if self.free:
            p.grad = None

    def _edited(self, key: int, p: torch.Tensor) -> None:
        if key in self.marks and self.marks[key] != grad_mark(p):
            self.edited.append(self.names[key])

    def verdict(self, tol: float, unchecked=frozenset(), fallback=None,
                cpu_amp: bool = False) -> None:
        """Raise ``UnattributedGradientError`` when no common factor α brings ``.grad``
        within ``tol`` of Σ_i g_i; ``unchecked``: ids of parameters not compared;
        ``fallback``: {id: why} of the parameters whose g_i the whole-model fallback computed,
        one record alone: where the parameter most off is one whose layer was called off the
        batch's rows, the record alone is not the record in the batch
        (``SampleMixingError``). ``cpu_amp``: a pass ran under autocast on the CPU, where
        PyTorch's own backward is known to leave garbage in a convolution's .grad (said)."""
        for key in list(self.held):
            self._compare(key, self.held.pop(key))
        rows = {}
        for key, p in self.params.items():
            if key in unchecked:
                continue
            if key not in self.stats:  # no path reached it: Σ_i g_i = 0
                self._edited(key, p)
                uu = 0.0 if p.grad is None else float(p.grad.detach().double().pow(2).sum())
                self.stats[key] = (uu, 0.0, 0.0, uu)
            rows[self.names[key]] = self.stats[key]
        if not rows:
            return
        bad = [name for name, row in rows.items() if not all(map(math.isfinite, row))]
        if bad:  # NaN or inf in .grad: α and every difference would be NaN, which compared
            # as "within tolerance" (inf) or left no parameter to name (NaN: an IndexError)
            # until 2026-11-30
            raise NonFiniteGradientError(
                f"the loss's gradient in .grad of {', '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''} holds NaN or inf after the backward pass, "
                f"while the per-record gradients the optimizer computed are finite: the "
                f"backward pass itself went wrong there. A known cause: PyTorch's CPU "
                f"(oneDNN) bfloat16 convolution backward leaves the weight gradient of "
                f"kernel taps that see only padding unwritten (a 3x3 stride-2 convolution on "
                f"a 1x1 input, under torch.autocast('cpu', torch.bfloat16)); run that model "
                f"in float32 on the CPU, or with torch.backends.mkldnn.flags(enabled=False)")
        curvature = sum(oo for _, _, oo, _ in rows.values())
        alpha = (sum(a * oo for _, a, oo, _ in rows.values()) / curvature
                 if curvature > 0 else 1.0)
        diffs = [(math.sqrt(max(r + (alpha - a) ** 2 * oo, 0.0)), name)
                 for name, (r, a, oo, _) in rows.items()]
        total = math.sqrt(sum(d * d for d, _ in diffs))
        scale = max(max(math.sqrt(uu), abs(alpha) * math.sqrt(oo))
                    for _, _, oo, uu in rows.values())
        if total <= tol * scale + 1e-12:
            return
        worst = [name for d, name in sorted(diffs, reverse=True)[:3] if d > 0]
        first = next((key for key, name in self.names.items() if name == worst[0]), None)
        why = (fallback or {}).get(first)
        if why is not None and NOT_THE_BATCH in why:  # the largest part: computed alone
            raise SampleMixingError(alone_differs(total, total / max(scale, 1e-300), worst,
                                                  why))
        if self.edited:  # the user's .grad is not the backward pass's any more
            edited = ", ".join(self.edited[:3]) + (" ..." if len(self.edited) > 3 else "")
            raise LoopError(
                f"the .grad of {edited} was changed between loss.backward() and "
                f"optimizer.step() (clip_grad_value_, p.grad.add_(...), a hand-written edit): "
                f"it differs from the sum of the per-record gradients by {total:.3g} "
                f"(relative {total / max(scale, 1e-300):.3g}), mostly in {', '.join(worst)}. "
                f"The DP step never reads .grad: it clips each record's gradient to "
                f"max_grad_norm and adds noise itself, so the edit would be dropped silently. "
                f"Remove it: clipping is max_grad_norm's (per record); a data-independent "
                f"change of the update belongs to the optimizer (weight_decay) or after "
                f"step(). (A common rescale of every .grad, clip_grad_norm_ or a GradScaler's "
                f"unscale_, is harmless and accepted)")
        raise UnattributedGradientError(
            f"the gradient of the loss in .grad differs from the sum of the per-record "
            f"gradients by {total:.3g} (relative {total / max(scale, 1e-300):.3g}), mostly "
            f"in {', '.join(worst)}: a term of the loss reaches these parameters outside the "
            f"model's output (an L2 penalty lambda * ||theta||^2, a loss reading a parameter "
            f"directly), and DP-SGD can neither clip it per record nor drop it silently. For "
            f"an L2 penalty use the optimizer's weight_decay (= 2 lambda for SGD; "
            f"data-independent, it is applied outside the noise); move any other "
            f"parameter-dependent term into the model's forward" + (
                ". This pass ran under torch.autocast on the CPU, where PyTorch's oneDNN "
                "bfloat16 convolution backward leaves the weight gradient of kernel taps "
                "that see only padding unwritten (a 3x3 stride-2 convolution on a 1x1 "
                "input): if the loss has no such term, that is the cause (the per-record "
                "gradients are computed in float32); run the model in float32, or under "
                "torch.backends.mkldnn.flags(enabled=False)" if cpu_amp else ""))


__all__ = ["CHUNK", "PathCheck", "grad_mark", "stats"]
