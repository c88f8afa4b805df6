"""User-level clipping: one clip factor per *user*, from the norm of the user's summed gradient.

User-level DP (McMahan, Ramage, Talwar, Zhang 2018, arXiv 1710.06963, §2 and Algorithm 1,
"DP-FedAvg" with per-user clipping; Opacus issue #366): the unit of privacy is a user u who
owns several records R_u. A sampled user's contribution is

    G_u = Σ_{i ∈ R_u} g_i                 (``reduction="sum"``; or G_u / |R_u| for ``"mean"``)

and DP-SGD clips *that*:  c_u = min(1, C / ||G_u||),  Σ_u c_u G_u = Σ_i c_{u(i)} g_i.
The last identity is why the clipping engine needs no new sum: each record gets its user's
factor (times 1/|R_u| for the mean), and the existing paths (``engine.clipped_sum``:
materialised tensordot, or ghost / book-keeping's reweighted backprops) give Σ_u c_u G_u.
Removing one user removes one term of norm <= C: the sensitivity is C, as for records.

What changes is the norm. Per layer, ||G_u^{layer}||²:

- materialising modes (microbatch, vmap, einsum): ``index_add`` of the (n, *shape) per-record
  gradients over users, then the squared norms of the (U, *shape) sums;
- ghost / book-keeping, ``nn.Linear``: a user's records are one long sequence of rows
  r = (i, t), and the ghost norm of a sum is (Li et al. 2022, arXiv 2110.05679, §4.1)

      ||Σ_r b_r a_rᵀ||² = Σ_{r,s ∈ u} (a_r·a_s)(b_r·b_s),   bias: Σ_{r,s ∈ u} b_r·b_s

  or, when the user's rows m_u exceed what a (p, d) weight costs (m_u² > p d), the user's
  weight gradient B_uᵀ A_u itself (one matmul for the user, never per record);
- ghost / book-keeping, ``nn.Embedding``: the same with the kernel [x_r = x_s] for (a_r·a_s);
- any other layer, parameters the engine materialised (exact fallback), and a parameter
  used in several calls (a tied head's weight): the per-record gradients of that layer are
  materialised (summed over a parameter's calls) and summed per user, as above.

Norms are computed in float64. Notation: n records in the batch, U users in it, u(i) the user
of record i, R_u its records, a activations, b backprops, C max_grad_norm.
"""

import torch
from torch import nn

from workbench.clipping.flat import clip_factors, sample_squares
from workbench.per_sample.einsum import sample_layer

__all__ = ["BatchUsers", "user_clipped_sum_microbatch", "user_factors",
           "user_squares_from_grads", "user_squares_ghost"]


def user_clipped_sum_microbatch(model, loss_fn, inputs, targets, user_ids, max_grad_norm,
                                reduction: str = "sum") -> dict[str, torch.Tensor]:
    """The slow twin: {name: Σ_u c_u G_u}, one backward pass per user of Σ_{i ∈ R_u} ℓ_i
    (÷ |R_u| for ``"mean"``), clipped to C and summed. ``loss_fn`` returns (n,) losses."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    total = {k: torch.zeros_like(p) for k, p in params.items()}
    ids = torch.as_tensor(user_ids)
    for u in torch.unique(ids).tolist():
        i = torch.nonzero(ids == u).flatten()  # R_u
        loss = loss_fn(model(inputs[i]), targets[i]).sum()
        if reduction == "mean":
            loss = loss / len(i)
        g = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        g = [torch.zeros_like(p) if x is None else x for x, p in zip(g, params.values())]
        norm = torch.sqrt(sum(x.double().pow(2).sum() for x in g))  # ||G_u||
        c = min(1.0, max_grad_norm / float(norm)) if float(norm) > 0 else 1.0
        for k, x in zip(params, g):
            total[k] += c * x.detach()
    return total


class BatchUsers:
    """The users of one recorded batch: ``index`` (n,) long in [0, U), the user of each record
    (in the batch's own numbering), and ``reduction`` "sum" or "mean"."""

    def __init__(self, index: torch.Tensor, reduction: str = "sum"):
        self.index = index.long()
        self.U = int(self.index.max()) + 1 if self.index.numel() else 0
        self.counts = torch.bincount(self.index, minlength=self.U)  # (U,) |R_u|
        self.reduction = reduction

    def per_user(self, g: torch.Tensor) -> torch.Tensor:
        """(U, *shape): Σ_{i ∈ R_u} g_i, by one index_add over the records."""
        out = torch.zeros((self.U, *g.shape[1:]), dtype=g.dtype, device=g.device)
        return out.index_add_(0, self.index.to(g.device), g)

    def rows(self, u: int, T: int) -> torch.Tensor:
        """The flattened (n T) row indices of user u's records."""
        i = torch.nonzero(self.index == u).flatten()  # (|R_u|,)
        return (i[:, None] * T + torch.arange(T)).flatten()


def user_squares_from_grads(grads: dict, users: BatchUsers, zeros: torch.Tensor):
    """||G_u||² (U,) float64 summed over materialised {id: (n, *shape)} gradients."""
    for g in grads.values():
        zeros = zeros + sample_squares(users.per_user(g))
    return zeros


def _gram_square(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """||Bᵀ A||² for one user's rows, A (m, d), B (m, p): the Gram form or the matmul."""
    m, d, p = A.shape[0], A.shape[1], B.shape[1]
    if m * m <= d * p:
        return ((A @ A.T) * (B @ B.T)).sum()  # Σ_{r,s} (a_r·a_s)(b_r·b_s)
    return (B.T @ A).square().sum()  # (p, d): the user's weight gradient, not per record


def _layer_user_squares(layer, call, own: dict, users: BatchUsers):
    """||G_u^{layer}||² (U,) for a Linear or Embedding call without per-record gradients, or
    None for another layer (the caller materialises it)."""
    b = call.backprops
    if isinstance(b, tuple) or b is None:
        return None
    arg = call.args[0] if call.args else call.kwargs.get("input")
    n = b.shape[0]
    B = b.reshape(n, -1, b.shape[-1]).double()  # (n, T, p)
    T = B.shape[1]
    B = B.reshape(n * T, -1)  # (n T, p) rows r = (i, t)
    out = torch.zeros(users.U, dtype=torch.float64, device=b.device)
    if type(layer) is nn.Linear and set(own.values()) <= {layer.weight, layer.bias}:
        A = arg.reshape(n * T, -1).double()  # (n T, d)
        for u in range(users.U):
            r = users.rows(u, T).to(b.device)
            if any(p is layer.weight for p in own.values()):
                out[u] += _gram_square(A[r], B[r])
            if layer.bias is not None and any(p is layer.bias for p in own.values()):
                out[u] += B[r].sum(0).square().sum()  # ||Σ_r b_r||²
        return out
    if type(layer) is nn.Embedding and not (layer.sparse or layer.scale_grad_by_freq
                                            or layer.max_norm is not None):
        ids = arg.reshape(-1)  # (n T,)
        if layer.padding_idx is not None:  # the padding row's gradient is zeroed
            B = B * (ids != layer.padding_idx).to(B.dtype)[:, None]
        for u in range(users.U):
            r = users.rows(u, T).to(b.device)
            same = (ids[r][:, None] == ids[r][None, :]).to(B.dtype)  # [x_r = x_s]
            out[u] = (same * (B[r] @ B[r].T)).sum()
        return out
    return None


def user_squares_ghost(rec, users: BatchUsers, materialised: dict, zeros: torch.Tensor):
    """||G_u||² (U,) from the recorded (a, b) of every call (module docstring), before the
    reweighting frees the backprops; ``materialised`` {id: (n, *shape)}: the engine's."""
    squares = user_squares_from_grads(materialised, users, zeros)
    shared = rec.shared_ids() - set(materialised)  # normed by cross terms (ghost's cross.py)
    summed: dict = {}  # {id: Σ over its calls of g_i}: a norm of a sum, never a sum of norms
    with torch.no_grad():
        for _, layer, call in list(rec.calls()):
            own = {name: p for name, p in rec.own(layer) if id(p) not in materialised}
            mine = {name: p for name, p in own.items() if id(p) in shared}
            if mine:
                for name, g in sample_layer(layer, call, keep=mine).items():
                    key = id(mine[name])
                    summed[key] = g if key not in summed else summed[key] + g
                own = {name: p for name, p in own.items() if id(p) not in shared}
            if not own:
                continue
            value = _layer_user_squares(layer, call, own, users)
            if value is None:  # no user ghost rule: this layer's g_i, summed per user
                local = sample_layer(layer, call, keep=own)
                value = user_squares_from_grads(
                    {k: g for k, g in local.items() if k in own}, users, zeros)
            squares = squares + value
    return user_squares_from_grads(summed, users, squares)


def user_factors(squares: torch.Tensor, users: BatchUsers, C: float):
    """(c_i (n,), ok (n,) bool): each record's factor c_{u(i)} (÷ |R_u| for the mean), and
    False for the records of a user whose norm is NaN or inf (masked out by the engine)."""
    norms = squares.sqrt()  # (U,) ||G_u||
    k = users.counts.to(norms)
    if users.reduction == "mean":  # clip G_u / |R_u| to C: c_u = min(1, C k / ||G_u||) / k
        c_user = clip_factors(norms / k, C) / k
    else:
        c_user = clip_factors(norms, C)  # (U,)
    ok = torch.isfinite(norms)[users.index]
    return c_user[users.index], ok
