"""Grad sampler for ``nn.Linear``: the outer product of backprop and activation.

Yousefpour et al. 2021 (arXiv 2109.12298), Appendix B, Eq. (4)-(5). For o = W a + c with a
sequence of T positions per sample (any number of leading dims, flattened into T):

    ∂ℓ_i/∂W = Σ_t b_{i,t} a_{i,t}ᵀ = B_iᵀ A_i     (n, p, d)   Eq. (5)
    ∂ℓ_i/∂c = Σ_t b_{i,t}                          (n, p)

Notation: n batch, T positions, a activations (n, T, d), b backprops (n, T, p), W (p, d).
"""

import torch
from torch import nn

from workbench.per_sample.memory import empty_per_sample
from workbench.per_sample.registry import register_grad_sampler


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
