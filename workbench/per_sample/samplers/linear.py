"""Grad sampler for ``nn.Linear``: the outer product of backprop and activation.

Yousefpour et al. 2021 (arXiv 2109.12298), Appendix B, Eq. (4)-(5). For o = W a + c with a
sequence of T positions per sample (any number of leading dims, flattened into T):

    ∂ℓ_i/∂W = Σ_t b_{i,t} a_{i,t}ᵀ = B_iᵀ A_i     (n, p, d)   Eq. (5)
    ∂ℓ_i/∂c = Σ_t b_{i,t}                          (n, p)

The same rule covers a Linear stored input-first, o = a W + c with W: (d, p) (GPT-2's
``Conv1D``): ∂ℓ_i/∂W = A_iᵀ B_i, recognised by behaviour (``is_transposed_linear``).

Notation: n batch, T positions, a activations (n, T, d), b backprops (n, T, p), W (p, d).
"""

import torch
from torch import nn

from workbench.per_sample.memory import empty_per_sample
from workbench.per_sample.registry import register_by_behaviour, register_grad_sampler


@register_grad_sampler(nn.Linear)
def linear_grad_sampler(layer, activations, backprops):
    a = activations[0]
    n = a.shape[0]
    out = {}
    if layer.weight.requires_grad:
        w = empty_per_sample((n, *layer.weight.shape), like=backprops)  # (n, p, d), see memory.py
        if a.dim() == 2:  # one position per sample: a batched outer product
            torch.mul(backprops.unsqueeze(2), a.unsqueeze(1), out=w)  # b_i a_iᵀ  Eq. (5)
        else:
            A = a.reshape(n, -1, a.shape[-1])  # (n, T, d)
            B = backprops.reshape(n, -1, backprops.shape[-1])  # (n, T, p)
            torch.bmm(B.transpose(1, 2), A, out=w)  # B_iᵀ A_i  Eq. (5)
        out["weight"] = w
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = backprops.reshape(n, -1, backprops.shape[-1]).sum(dim=1)  # (n, p)
    return out


def is_transposed_linear(layer) -> bool:
    """True where the layer computes o = a W + c with W: (d, p) stored input-first (GPT-2's
    ``Conv1D`` in Hugging Face transformers): checked on a probe input, never by name."""
    own = dict(layer.named_parameters(recurse=False))
    W, c = own.get("weight"), own.get("bias")
    if (W is None or W.dim() != 2 or set(own) - {"weight", "bias"} or any(layer.children())
            or (c is not None and c.shape != W.shape[1:])):
        return False
    a = torch.randn(2, 3, W.shape[0], generator=torch.Generator().manual_seed(0),
                    dtype=W.dtype).to(W.device)
    try:
        with torch.no_grad():
            out, want = layer.forward(a), a @ W + (0 if c is None else c)
    except (RuntimeError, TypeError, ValueError):
        return False
    return out.shape == want.shape and bool((out - want).norm() <= 1e-5 * want.norm())


@register_by_behaviour(is_transposed_linear)
def transposed_linear_grad_sampler(layer, activations, backprops):
    """The Linear rule for o = a W + c: ∂ℓ_i/∂W = A_iᵀ B_i (n, d, p)."""
    a, n = activations[0], backprops.shape[0]
    A = a.reshape(n, -1, a.shape[-1])  # (n, T, d)
    B = backprops.reshape(n, -1, backprops.shape[-1])  # (n, T, p)
    out = {}
    if layer.weight.requires_grad:
        out["weight"] = torch.bmm(A.transpose(1, 2), B)  # A_iᵀ B_i
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = B.sum(dim=1)  # (n, p)
    return out


__all__ = ["is_transposed_linear", "linear_grad_sampler", "transposed_linear_grad_sampler"]
