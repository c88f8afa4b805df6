"""The workbench's own DPOptimizer as a ``step_fn(G) -> Tensor(d)`` for ``audit_dp_step``.

A model whose per-sample gradients *are* the rows of G: o = W x + b with inputs x = 0, so
o_i = b and the per-sample loss ℓ_i = <g_i, o_i> has ∂ℓ_i/∂b = g_i and ∂ℓ_i/∂W = g_i x_iᵀ = 0.
The real hooks, grad sampler, clipping and noise of ``workbench.dpsgd.DPOptimizer`` (Abadi et
al. 2016, arXiv 1607.00133, Algorithm 1) then run end to end, and b.grad is the step's output.
"""

import torch

from workbench.deprecation import Default, keyword
from workbench.dpsgd import DPOptimizer


def workbench_step(C, sigma, B, generator=None, method: str = Default("einsum"), **renamed):
    """step_fn(G (n, d)) -> b.grad (d,) after one DPOptimizer step (loss_reduction="sum").
    ``grad_sample_mode``: the old name of ``method`` (deprecated)."""
    method = keyword(method, renamed, "method", "grad_sample_mode", "workbench_step")
    model: dict = {}

    def step(G: torch.Tensor) -> torch.Tensor:
        n, d = G.shape
        if "opt" not in model:  # built on first call, once d is known
            layer = torch.nn.Linear(1, d, dtype=G.dtype)
            sgd = torch.optim.SGD(layer.parameters(), lr=0.0)
            model["layer"] = layer
            model["opt"] = DPOptimizer(sgd, layer, noise_multiplier=sigma, max_grad_norm=C,
                                       expected_batch_size=B, loss_reduction="sum",
                                       method=method, generator=generator)
        layer, opt = model["layer"], model["opt"]
        opt.zero_grad()
        o = layer(torch.zeros(n, 1, dtype=G.dtype))  # (n, d), every row = b
        (o * G).sum().backward()  # Σ_i <g_i, o_i>
        opt.step()
        return layer.bias.grad.detach().clone()  # (d,)
    return step


__all__ = ["workbench_step"]
