"""``nn.Linear``: the outer product of backprop and activation, its norm, and its fast sum.

Yousefpour et al. 2021 (arXiv 2109.12298), Appendix B, Eq. (4)-(5). For o = W a + c with a
sequence of T positions per sample (any number of leading dims, flattened into T):

    ∂ℓ_i/∂W = Σ_t b_{i,t} a_{i,t}ᵀ = B_iᵀ A_i     (n, p, d)   Eq. (5)     grad rule
    ∂ℓ_i/∂c = Σ_t b_{i,t}                          (n, p)

Norm rule, by the cheapest route (``linear_route``):

    T = 1:  ||g_i||² = ||b_i||² ||a_i||²                      Goodfellow 2015, arXiv 1510.01799
    else:   ||g_i||² = <A_i A_iᵀ, B_i B_iᵀ>_F  (two (T, T) Grams)  when 2T² < pd, Li, Tramèr,
            Liang, Hashimoto 2022 (arXiv 2110.05679) §4 Eq. 4; otherwise g_i materialised.

The bias gradient Σ_t b_{i,t} is always cheap: ||Σ_t b_{i,t}||². Book-keeping's clipped sum
is PyTorch's own weight gradient with c ⊙ b: Σ_i c_i B_iᵀ A_i = (c ⊙ B)ᵀ A, one matmul over
the n·T rows (Bu et al. 2023, arXiv 2210.00038, Eq. 3; ``linear_weight_grads``).

A Linear stored input-first (o = a W + c, W: (d, p), GPT-2's ``Conv1D``) has the transposed
gradient A_iᵀ B_i of the same norm, recognised by behaviour (``is_transposed_linear``).

Notation: n batch, T positions, a activations (n, T, d), b backprops (n, T, p), W (p, d).
"""

import torch
from torch import nn

from workbench.clipping.nonfinite import masked
from workbench.per_sample.memory import empty_per_sample
from workbench.rules._rule import (
    MATERIALISE,
    PROBE_ERRORS,
    LayerRule,
    Route,
    own_gradient_size,
    probe_forward,
    register_rule,
)


def positions(a: torch.Tensor) -> int:
    """T: positions per sample of an (n, ..., d) input."""
    return a[0].numel() // a.shape[-1]


NORM_PRODUCT = Route("norm product", lambda layer, call: 2,  # ||a_i||², ||b_i||²
                     flops=lambda layer, call: sum(t[0].numel() for t in (*call.args,
                                                                           call.backprops)))
GRAM = Route("gram", lambda layer, call: 2 * positions(call.args[0]) ** 2,  # 2 (T, T) Grams
             flops=lambda layer, call: positions(call.args[0]) ** 2 * (
                 call.args[0].shape[-1] + call.backprops.shape[-1] + 1))
BIAS_ONLY = Route("bias only", own_gradient_size)
ROUTES = (NORM_PRODUCT, GRAM, MATERIALISE, BIAS_ONLY)


def linear_grad_sampler(layer, activations, backprops):
    a = activations[0]
    n = a.shape[0]
    out = {}
    if layer.weight.requires_grad:
        w = empty_per_sample((n, *layer.weight.shape), like=backprops)  # (n, p, d), see memory.py
        if a.dim() == 2:  # one position per sample: a batched outer product
            torch.mul(backprops.unsqueeze(2), a.unsqueeze(1), out=w)  # b_i a_iᵀ  Eq. (5)
        else:
            A, B = sequence_view(a, backprops)  # (n, T, d), (n, T, p)
            torch.bmm(B.transpose(1, 2), A, out=w)  # B_iᵀ A_i  Eq. (5)
        out["weight"] = w
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = backprops.reshape(n, -1, backprops.shape[-1]).sum(dim=1)  # (n, p)
    return out


def gram_is_cheaper(T: int, p: int, d: int) -> bool:
    """The ghost-clipping rule: two (T, T) Grams are smaller than one (p, d) gradient."""
    return 2 * T * T < p * d


def sequence_view(a: torch.Tensor, b: torch.Tensor):
    """(n, ..., d), (n, ..., p) -> (n, T, d), (n, T, p)."""
    n = a.shape[0]
    return a.reshape(n, -1, a.shape[-1]), b.reshape(n, -1, b.shape[-1])


def sequence_route(T: int, p: int, d: int) -> tuple[Route, str]:
    """The route ``weight_squared_norms`` takes for T positions and a (p, d) weight, and why."""
    if T == 1:
        return NORM_PRODUCT, "one position per sample: ||g_i|| = ||b_i|| ||a_i|| (Goodfellow)"
    if gram_is_cheaper(T, p, d):
        return GRAM, f"2T² = {2 * T * T} < pd = {p * d}: (T, T) Grams are smaller"
    return MATERIALISE, f"2T² = {2 * T * T} >= pd = {p * d}: the (p, d) gradient is smaller"


def linear_route(layer, activations) -> tuple[Route, str]:
    if not layer.weight.requires_grad:
        return BIAS_ONLY, "the weight is frozen; ||Σ_t b_t||² for the bias"
    p, d = layer.weight.shape
    return sequence_route(positions(activations[0]), p, d)


def weight_squared_norms(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """||B_iᵀ A_i||²_F for (n, T, d), (n, T, p), by the cheaper route. Returns (n,)."""
    n, T, d = A.shape
    p = B.shape[-1]
    if T == 1:
        return A.pow(2).sum((1, 2)) * B.pow(2).sum((1, 2))  # ||a_i||² ||b_i||²
    if gram_is_cheaper(T, p, d):
        AA = torch.bmm(A, A.transpose(1, 2))  # (n, T, T)
        BB = torch.bmm(B, B.transpose(1, 2))  # (n, T, T)
        return (AA * BB).sum((1, 2))  # <A Aᵀ, B Bᵀ>  Li et al. Eq. 4
    return torch.bmm(B.transpose(1, 2), A).pow(2).sum((1, 2))  # (n, p, d), normed, dropped


def linear_norm_sampler(layer, activations, backprops):
    A, B = sequence_view(activations[0], backprops)
    squares = torch.zeros(A.shape[0], dtype=B.dtype, device=B.device)
    if layer.weight.requires_grad:
        squares += weight_squared_norms(A, B)
    if layer.bias is not None and layer.bias.requires_grad:
        squares += B.sum(1).pow(2).sum(1)  # ||Σ_t b_t||²
    return squares


def linear_weight_grads(layer, call, weighted: torch.Tensor, own: list, ok=None) -> dict:
    """nn.Linear without its graph: Σ_i c_i B_iᵀ A_i = (c ⊙ B)ᵀ A (Bu et al. 2023, Eq. 3), one
    matmul over the n·T rows, as PyTorch's own weight gradient (no forward re-run).
    ``ok`` (n,): records to keep when some are non-finite (the others' rows of A are zeroed)."""
    a = call.args[0] if call.args else call.kwargs["input"]  # (n, ..., d)
    if ok is not None:
        a = masked(a, ok)
    B = weighted.reshape(-1, weighted.shape[-1])  # (n T, p)  c_i b_{i,t}
    grads = {}
    if any(p is layer.weight for p in own):
        grads[id(layer.weight)] = B.T @ a.reshape(-1, a.shape[-1]).to(B.dtype)  # (p, d)
    if layer.bias is not None and any(p is layer.bias for p in own):
        grads[id(layer.bias)] = B.sum(0)  # (p,)
    return grads


RULE = register_rule(LayerRule(
    "linear", (nn.Linear,), grad=linear_grad_sampler, norm=linear_norm_sampler,
    route=linear_route, routes=ROUTES, weight_grads=linear_weight_grads, rows=True))


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
            out, want = probe_forward(layer, a), a @ W + (0 if c is None else c)
    except PROBE_ERRORS:
        return False
    return out.shape == want.shape and bool((out - want).norm() <= 1e-5 * want.norm())


def transposed_linear_grad_sampler(layer, activations, backprops):
    """The Linear rule for o = a W + c: ∂ℓ_i/∂W = A_iᵀ B_i (n, d, p)."""
    A, B = sequence_view(activations[0], backprops)  # (n, T, d), (n, T, p)
    out = {}
    if layer.weight.requires_grad:
        out["weight"] = torch.bmm(A.transpose(1, 2), B)  # A_iᵀ B_i
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = B.sum(dim=1)  # (n, p)
    return out


def transposed_route(layer, activations) -> tuple[Route, str]:
    if not layer.weight.requires_grad:
        return BIAS_ONLY, "the weight is frozen; ||Σ_t b_t||² for the bias"
    d, p = layer.weight.shape
    return sequence_route(positions(activations[0]), p, d)


TRANSPOSED_RULE = register_rule(LayerRule(
    "transposed linear (o = a W + c)", grad=transposed_linear_grad_sampler,
    norm=linear_norm_sampler, route=transposed_route, routes=ROUTES,
    matches=is_transposed_linear, rows=True))  # ||A_iᵀ B_i|| = ||B_iᵀ A_i||: one norm rule


__all__ = [
    "BIAS_ONLY", "GRAM", "NORM_PRODUCT", "ROUTES", "RULE", "TRANSPOSED_RULE",
    "gram_is_cheaper", "is_transposed_linear", "linear_grad_sampler", "linear_norm_sampler",
    "linear_route", "linear_weight_grads", "positions", "sequence_route", "sequence_view",
    "transposed_linear_grad_sampler", "transposed_route", "weight_squared_norms",
]
