"""The independent reference of the real-architecture table: one sample at a time.

    g_i = ∂ ℓ(f(x_i; θ), y_i) / ∂θ            one forward and backward pass per sample

written with ``torch.autograd.grad`` alone (none of the library's engines, not even its
micro-batching), then the DP-SGD clipped sum Σ_i min(1, C / ||g_i||) g_i (Abadi et al. 2016,
Algorithm 1). ``verdict`` compares any method's answer with it.
"""

import torch

RTOL, ATOL = 1e-9, 1e-12  # float64: summation order only; ATOL x the whole gradient's norm
RTOL_FLOAT32_INSIDE = 1e-5  # a float64 model that computes parts in float32 (HF's RMSNorm)


def one_at_a_time(model, loss_fn, x, y) -> dict[str, torch.Tensor]:
    """{name: (n, *shape)} for the trainable parameters; zeros where one is unused."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g
                     for p, g in zip(params.values(), grads)])
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def norms_of(per_sample: dict) -> torch.Tensor:
    """||g_i|| over all parameters, (n,). (``reshape``, not ``flatten(1)``: a 0-d parameter's
    g is (n,), which ``flatten(1)`` refuses.)"""
    return torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in per_sample.values()))


def clipped_sum(per_sample: dict, C: float) -> dict[str, torch.Tensor]:
    """Σ_i min(1, C / ||g_i||) g_i per parameter."""
    factors = (C / norms_of(per_sample)).clamp(max=1.0)
    return {k: torch.einsum("n,n...->...", factors, g) for k, g in per_sample.items()}


def scale(per_sample: dict) -> float:
    return float(torch.sqrt(sum(g.pow(2).sum() for g in per_sample.values())))


def error(got: torch.Tensor, want: torch.Tensor, size: float, rtol: float = RTOL) -> float:
    """||got - want|| over the tolerance rtol (||want|| + ATOL / RTOL size): <= 1 is exact
    (an all-zero reference, a model whose gradients all vanish: exact only if got is 0)."""
    diff, bound = float((got - want).norm()), rtol * (float(want.norm()) + ATOL / RTOL * size)
    return diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))


def verdict(got: dict, want: dict, size: float, rtol: float = RTOL) -> str:
    """"exact", or "wrong: <parameter> rel. error <e>" for the worst parameter."""
    missing = set(want) - set(got)
    if missing:
        return f"wrong: no gradient for {sorted(missing)[0]}"
    worst = max(want, key=lambda k: error(got[k].to(want[k]), want[k], size, rtol))
    if error(got[worst].to(want[worst]), want[worst], size, rtol) <= 1:
        return "exact"
    rel = float((got[worst] - want[worst]).norm() / want[worst].norm().clamp_min(1e-300))
    return f"wrong: {worst} rel. error {rel:.1e}"


__all__ = [
    "RTOL_FLOAT32_INSIDE", "clipped_sum", "error", "norms_of", "one_at_a_time", "scale", "verdict",
]
