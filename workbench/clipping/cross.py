"""A weight used in several calls, normed from its calls' (a, b) with cross terms.

A tied language-model head uses the token embedding E twice: as the Embedding's table and as
the head's weight (Press & Wolf 2017, arXiv 1608.05859; ``per_sample.tied``). ALBERT calls one
layer at every depth. Such a weight's per-sample gradient is the sum over its calls k, and
each call's part is a product of two per-sample factors (the Linear rule of Yousefpour et al.
2021, arXiv 2109.12298, Eq. 5):

    g_i = Σ_k L_{k,i}ᵀ R_{k,i}          L_{k,i} (T_k, P), R_{k,i} (T_k, D)
    ||g_i||² = Σ_k Σ_l <L_{k,i} L_{l,i}ᵀ, R_{k,i} R_{l,i}ᵀ>_F       (T_k, T_l) Grams      (1)

(1) is ghost clipping's Gram identity (Li, Tramèr, Liang, Hashimoto 2022, arXiv 2110.05679,
§4 Eq. 4) with the cross terms k ≠ l of the norm of a sum, which Li et al. (§4.1) use for the
tied embedding of their language models. The factors per call:

- ``nn.Linear`` weight W (P, D), o = a Wᵀ + c: L = b (n, T, P), R = a (n, T, D);
- a Linear stored input-first (GPT-2's ``Conv1D``), o = a W + c, W (D, P): L = a, R = b;
- ``nn.Embedding`` table E (V, D), o = E[x]: L the one-hot rows of x (never built:
  (L_k L_lᵀ)[t, s] = [x_{k,t} = x_{l,s}], and against a dense L_l it is L_l[s, x_{k,t}], a
  gather), R = b with the padding index's rows zeroed, as PyTorch's own backward does.

A weight takes this route ("gram (shared)") when every recorded call of it is one of these, on
the rule's own weight and without an option whose gradient differs (``sparse``, ``max_norm``,
``scale_grad_by_freq``, a parametrization), and when the Grams are smaller than the gradient
they replace: 2 (Σ_k T_k)² < P D, as for one call (``rules/linear.gram_is_cheaper``). Otherwise
the calls are materialised and summed before the norm, as before. The clipped sum is then each
call's ordinary reweighted weight gradient, summed over calls (``engine.clipped_sum``): the
sum needs no cross terms. Biases of such layers are (n, P) and materialised per call.

Float32 Grams overflow where a float64 norm does not: a weight whose (1) comes out NaN or inf
for some record is normed again from the same factors in float64 (a record non-finite there is
non-finite). Each Gram is taken in the factors' dtype (float16 and bfloat16 widened to float32).

Notation: n batch, T_k positions of call k, P and D the weight's two dims, a activations,
b backprops, x indices.
"""

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from workbench.per_sample.precision import widen
from workbench.rules import embedding, linear
from workbench.rules._rule import find_layer_rule


class Factors:
    """One call's (L, R) for a shared weight: ``index`` (n, T) long when L is one-hot rows,
    else ``left`` (n, T, P); ``right`` (n, T, D)."""

    def __init__(self, right, left=None, index=None):
        self.right, self.left, self.index = right, left, index

    def to(self, dtype):
        return Factors(self.right.to(dtype), None if self.left is None else self.left.to(dtype),
                       self.index)

    def materialise(self, P: int) -> torch.Tensor:
        """L_iᵀ R_i (n, P, D): what the call adds to g_i."""
        if self.left is not None:
            return torch.bmm(self.left.transpose(1, 2), self.right)
        n, T, D = self.right.shape
        keys = (torch.arange(n, device=self.index.device).unsqueeze(1) * P
                + self.index).reshape(-1)  # row (i, x_it) of the stacked (n P, D)
        out = self.right.new_zeros(n * P, D)
        return out.index_add_(0, keys, self.right.reshape(-1, D)).view(n, P, D)


def _input(call):
    return call.args[0] if call.args else call.kwargs.get("input")


def kind(layer, p) -> str | None:
    """"linear", "transposed" or "embedding": how ``layer``'s calls use ``p`` as a product of
    two factors (module docstring), or None (the calls are materialised)."""
    if is_parametrized(layer) or getattr(layer, "weight", None) is not p or p.dim() != 2:
        return None
    rule = find_layer_rule(layer)
    if rule is linear.RULE:
        return "linear"
    if rule is linear.TRANSPOSED_RULE:
        return "transposed"
    if rule is embedding.RULE and not (layer.sparse or layer.scale_grad_by_freq
                                       or layer.max_norm is not None):
        return "embedding"
    return None


def positions(layer, call) -> int | None:
    """T of one recorded call (from its inputs, known before the backward pass), or None."""
    x = _input(call)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] == 0:
        return None
    if isinstance(layer, nn.Embedding):
        return x[0].numel()
    return linear.positions(x) if x.dim() >= 2 else None


def plan(rec, shared: set[int]) -> dict:
    """{id: weight} of the ``shared`` weights that take the cross-Gram route (module
    docstring): every recorded call a product of two factors, and the Grams smaller than the
    gradient."""
    if not shared:
        return {}  # the usual model: nothing to plan, no walk over its calls (every step)
    calls: dict[int, list] = {}
    params = {}
    for path, layer in rec.layers.items():
        for call in rec.recorder.calls[path]:
            for _, p in rec.own(layer):
                if id(p) in shared:
                    calls.setdefault(id(p), []).append((layer, call))
                    params[id(p)] = p
    chosen = {}
    for key, uses in calls.items():
        p = params[key]
        if any(kind(layer, p) is None for layer, _ in uses):
            continue
        Ts = [positions(layer, call) for layer, call in uses]
        if None in Ts:
            continue
        if linear.gram_is_cheaper(sum(Ts), *p.shape):
            chosen[key] = p
    return chosen


def factors(layer, call, p) -> Factors | None:
    """(L, R) of one call for the weight ``p``, widened to at least float32; None when the
    call is not what ``plan`` saw (the caller materialises the weight instead)."""
    how, x, b = kind(layer, p), _input(call), call.backprops
    if how is None or not isinstance(x, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    n = b.shape[0]
    if x.shape[0] != n:
        return None
    b = widen(b, torch.float32).reshape(n, -1, b.shape[-1])  # (n, T, out)
    if how == "embedding":
        ids = x.reshape(n, -1)  # (n, T)
        if ids.shape[1] != b.shape[1] or ids.is_floating_point():
            return None
        if layer.padding_idx is not None:  # the padding row gets no gradient
            b = b.masked_fill((ids == layer.padding_idx).unsqueeze(-1), 0.0)
        return Factors(b, index=ids)
    a = widen(x, b.dtype).reshape(n, -1, x.shape[-1])  # (n, T, in)
    if a.shape[1] != b.shape[1]:
        return None
    return Factors(a, left=b) if how == "linear" else Factors(b, left=a)


def _left_gram(f: Factors, g: Factors, dtype) -> torch.Tensor:
    """(n, T_f, T_g): L_f L_gᵀ."""
    if f.left is not None and g.left is not None:
        return torch.bmm(f.left, g.left.transpose(1, 2))
    if f.left is None and g.left is None:
        return (f.index.unsqueeze(2) == g.index.unsqueeze(1)).to(dtype)  # [x_t = x_s]
    if f.left is None:
        return _left_gram(g, f, dtype).transpose(1, 2)
    n, T_f = f.left.shape[:2]  # (L_f L_gᵀ)[t, s] = L_f[t, x_{g,s}]
    return f.left.gather(2, g.index.unsqueeze(1).expand(n, T_f, g.index.shape[1]))


def pair(f: Factors, g: Factors) -> torch.Tensor:
    """(n,) <L_f L_gᵀ, R_f R_gᵀ>_F: one term of (1)."""
    right = torch.bmm(f.right, g.right.transpose(1, 2))  # (n, T_f, T_g)
    return (_left_gram(f, g, right.dtype) * right).sum((1, 2))


class CrossNorm:
    """||g_i||² of one shared weight, its calls' terms added as their b arrive (each new call
    paired with itself and with every earlier call; the factors are kept until ``square``)."""

    def __init__(self, p):
        self.p, self.seen, self.value = p, [], None

    def add(self, f: Factors) -> None:
        term = pair(f, f)
        for g in self.seen:
            term = term + 2 * pair(f, g.to(f.right.dtype) if g.right.dtype != f.right.dtype
                                   else g)
        self.value = term if self.value is None else self.value + term.to(self.value)
        self.seen.append(f)

    def square(self) -> torch.Tensor:
        """(n,) float64; re-normed in float64 when the Grams overflowed (module docstring)."""
        value = self.value.double()
        if not bool(torch.isfinite(value).all()) and value.dtype != self.value.dtype:
            wide = [f.to(torch.float64) for f in self.seen]
            value = sum(pair(f, g) * (1 if j == k else 2)
                        for k, f in enumerate(wide) for j, g in enumerate(wide[:k + 1]))
        self.seen = []
        return value

    def materialise(self) -> torch.Tensor | None:
        """Σ_k L_kᵀ R_k (n, P, D) of the calls seen so far (a later call could not be
        factored), or None before any; the factors are dropped."""
        P = self.p.shape[0]
        total = None
        for f in self.seen:
            g = f.materialise(P)
            total = g if total is None else total + g
        self.seen, self.value = [], None
        return total


def bias_grads(layer, call, rest: dict) -> dict | None:
    """{name: g_i} of a cross-normed layer's other parameters when they are only its Linear
    bias (Σ_t b_t, (n, P)), else None (the caller samples the layer)."""
    if set(rest) != {"bias"} or kind(layer, layer.weight) not in ("linear", "transposed"):
        return None
    b = call.backprops
    return {"bias": b.reshape(b.shape[0], -1, b.shape[-1]).sum(1)}


__all__ = ["CrossNorm", "Factors", "bias_grads", "factors", "kind", "pair", "plan",
           "positions"]
