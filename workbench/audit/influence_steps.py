"""Noiseless released sums for ``audit_record_influence``: the engine, a naive step, a --step.

Each adapter returns ``released_sum(idx) -> Tensor`` over a pool of n + 1 records
(``workbench.audit.influence``):

- ``engine_released_sum``: the workbench's ``DPOptimizer`` on the model and the loss, σ = 0,
  expected batch size 1, so ``p.grad`` is Σ_i clip_C(g_i) (Abadi et al. 2016, Alg. 1). A loss
  of shape (n,) is summed (``loss_reduction="sum"``); a scalar loss is the user's mean
  (``loss_reduction="mean"``). A float64 copy of the model and one optimizer with lr = 0
  serve every call.
- ``naive_released_sum``: a plain DP step without the engine: the per-record terms ℓ_i of the
  loss (shape (n,)), one backward per record through the *batch's* forward, each gradient
  clipped to C, summed. Exactly right when ℓ_i depends on record i alone, and exactly as wrong
  as the loss's coupling otherwise: the yardstick ``bug_zoo_coupling`` is measured on.
- ``step_released_sum``: a ``--step`` factory (``bug_zoo``'s interface) built with σ = 0 and
  a re-seeded generator per call, on rows of G: S = step(G[idx]) · B.

Notation: n batch size, C max_grad_norm, B expected batch size, ℓ_i record i's loss term.
"""

import copy

import torch

from workbench.deprecation import Default, keyword
from workbench.dpsgd import DPOptimizer
from workbench.per_sample.checks import train_keeping_frozen


def _float64(model):
    return copy.deepcopy(model).to(torch.float64)


def _cast(x):
    return x.to(torch.float64) if x.is_floating_point() else x


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters() if p.requires_grad])


def engine_released_sum(model, loss_fn, inputs, targets, max_grad_norm,
                        method: str = Default("auto"), **renamed):
    """released_sum(idx) of the workbench's DPOptimizer (σ = 0) on ``model`` and ``loss_fn``.
    ``grad_sample_mode``: the old name of ``method`` (deprecated)."""
    method = keyword(method, renamed, "method", "grad_sample_mode", "engine_released_sum")
    m, x, y = train_keeping_frozen(_float64(model)), _cast(inputs), _cast(targets)
    built: dict = {}

    def released_sum(idx):
        if not built:  # lr = 0: the parameters never move, one optimizer serves every call
            with torch.no_grad(), torch.random.fork_rng():  # this look draws no dropout mask
                reduction = "sum" if loss_fn(m(x[idx]), y[idx]).dim() == 1 else "mean"
            built["opt"] = DPOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                max_grad_norm=max_grad_norm, expected_batch_size=1.0,
                loss_reduction=reduction, method=method)
        opt = built["opt"]
        opt.zero_grad()
        loss = loss_fn(m(x[idx]), y[idx])
        (loss.sum() if loss.dim() == 1 else loss).backward()
        opt.step()
        return _flat_grads(m)
    return released_sum


def naive_released_sum(model, loss_fn, inputs, targets, max_grad_norm):
    """released_sum(idx) = Σ_i clip_C(∂ℓ_i/∂θ), ℓ = loss_fn(model(x[idx]), y[idx]) of shape (n,)."""
    m, x, y = train_keeping_frozen(_float64(model)), _cast(inputs), _cast(targets)
    C = float(max_grad_norm)

    def released_sum(idx):
        params = [p for p in m.parameters() if p.requires_grad]
        terms = loss_fn(m(x[idx]), y[idx])  # (n,) per-record terms, possibly coupled
        if terms.shape != (len(idx),):
            raise ValueError(f"the naive step needs one loss term per record, shape "
                             f"({len(idx)},); got {tuple(terms.shape)}")
        total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
        for k in range(len(idx)):
            g = torch.cat([gi.reshape(-1) for gi in torch.autograd.grad(
                terms[k], params, retain_graph=True, allow_unused=False)])  # (d,)
            total += g * min(1.0, C / max(float(g.norm()), 1e-300))
        return total
    return released_sum


def step_released_sum(factory, G, max_grad_norm, batch_size):
    """released_sum(idx) = step(G[idx]) · B for step = factory(C, 0, B, re-seeded generator)."""
    G = G.to(torch.float64)

    def released_sum(idx):
        step = factory(max_grad_norm, 0.0, batch_size, torch.Generator().manual_seed(0))
        return step(G[idx].clone()) * batch_size
    return released_sum


def median_norm(model, loss_fn, inputs, targets) -> float:
    """The median norm of the per-record terms' gradients ∂ℓ_i/∂θ through the batch's forward
    (float64): a C at which some records are clipped and some not, where coupling is easiest
    to see (with every gradient far below C, a coupled step can stay within the bound)."""
    m, x, y = train_keeping_frozen(_float64(model)), _cast(inputs), _cast(targets)
    params = [p for p in m.parameters() if p.requires_grad]
    terms = loss_fn(m(x), y)  # (n,)
    norms = [float(torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        terms[k], params, retain_graph=True)]).norm()) for k in range(len(terms))]
    median = float(torch.tensor(norms).median())
    if not median > 0:
        raise ValueError("every per-record gradient is zero: no C to audit at")
    return median


def influence_pool(n: int, dim: int, max_grad_norm: float, generator=None) -> torch.Tensor:
    """(n + 1, dim) per-record gradients with norms from C/2 to 3C (some clipped, some not),
    random directions: the pool a ``--step`` is audited on."""
    G = torch.randn(n + 1, dim, dtype=torch.float64, generator=generator)
    norms = torch.linspace(0.5, 3.0, n + 1, dtype=torch.float64) * max_grad_norm
    return G / G.norm(dim=1, keepdim=True) * norms[:, None]


__all__ = [
    "engine_released_sum", "influence_pool", "median_norm", "naive_released_sum",
    "step_released_sum",
]
