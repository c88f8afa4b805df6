"""Training loops for the character language model: non-private pretraining and DP-SGD.

DP-SGD as in Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1, with Poisson sampling and the
expected batch size B = qN in the denominator (see ``dpsgd/optimizer.py`` for why):

    batch   = {j : u_j < q},  u_j ~ U(0, 1)                        Poisson sampling
    ḡ       = (Σ_{i ∈ batch} min(1, C / ||g_i||) g_i + N(0, σ² C² I)) / (q N)
    θ       ← Adam(θ, ḡ)                                            post-processing of ḡ

The loop is the ordinary one under ``wb.PrivacyEngine``, so every ``method`` can
drive it (all are exact on tiny_gpt, tied head and ``arange`` positions included; the
default is book-keeping). σ is calibrated with ``accounting.get_noise_multiplier`` for
``target_epsilon`` over the planned steps (RDP).

A sample is one window of T characters (``corpus.windows``): the guarantee is per window.

Notation: N windows, q sample rate, B = qN, C max_grad_norm, σ noise multiplier.
"""

import math
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from workbench import accounting
from workbench.checks import check_count
from workbench.dpsgd.engine import PrivacyEngine
from workbench.lm.gpt import sequence_cross_entropy
from workbench.per_sample.checks import evaluating


@torch.no_grad()
def perplexity(model, data, batch_size: int = 256) -> float:
    """exp(mean next-character cross-entropy) over every token of ``data`` (x, y windows)."""
    x, y = data.tensors
    with evaluating(model):  # each module's mode back after
        total = sum(sequence_cross_entropy(model(xb), yb, reduction="sum").sum().item()
                    for xb, yb in zip(x.split(batch_size), y.split(batch_size)))
    return math.exp(total / y.numel())


def train_lm(model, data, *, steps: int, batch_size: int, lr: float,
             generator: torch.Generator) -> list[float]:
    """Non-private AdamW on uniformly drawn batches; returns the loss of each step."""
    x, y = data.tensors
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(int(steps)):
        idx = torch.randint(0, len(x), (batch_size,), generator=generator)  # (b,)
        loss = sequence_cross_entropy(model(x[idx]), y[idx]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@dataclass
class DPRun:
    """What a DP fine-tuning run spent and saw."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    epsilon: float
    delta: float
    losses: list[float] = field(default_factory=list)  # mean loss of each Poisson batch


def dp_train_lm(model, data, *, target_epsilon: float, delta: float, steps: int,
                batch_size: int, max_grad_norm: float, lr: float, method: str = "bookkeeping",
                generator: torch.Generator, noise_generator: torch.Generator,
                user_ids=None) -> DPRun:
    """DP-SGD (Adam on the noised mean) at (target_epsilon, delta) over ``steps`` steps.

    The ordinary loop under ``wb.PrivacyEngine`` (Poisson batches of expected size
    ``batch_size``, ``method=method``). ``target_epsilon=math.inf`` runs the same
    loop with σ = 0 (clipping only), the non-private twin. ``user_ids`` (one per window):
    user-level DP (``dpsgd/user_level.py``): users sampled at q = batch_size / N, each user's
    summed gradient clipped, ε per user.
    """
    x, _ = data.tensors
    N = len(x)
    q = accounting_rate(batch_size, N)
    sigma = 0.0 if math.isinf(target_epsilon) else accounting.get_noise_multiplier(
        target_epsilon, delta, q, steps=steps)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.Adam(params, lr=lr),
        data_loader=DataLoader(data, batch_size=batch_size), noise_multiplier=sigma,
        max_grad_norm=max_grad_norm, method=method, loss_reduction="sum",
        noise_generator=noise_generator, sampling_generator=generator,
        **({} if user_ids is None else {"privacy_unit": "user", "user_ids": user_ids}))
    run = DPRun(sigma, q, int(steps), math.inf, delta)
    while len(engine.accountant) < steps:
        for xb, yb in loader:
            opt.zero_grad()
            losses = sequence_cross_entropy(model(xb), yb)  # (n,)
            losses.sum().backward()
            opt.step()
            if len(xb):
                run.losses.append(losses.mean().item())
            if len(engine.accountant) >= steps:
                break
    opt.detach()
    if sigma > 0:
        run.epsilon = engine.get_epsilon(delta)
    return run


def accounting_rate(batch_size: int, N: int) -> float:
    """q = batch_size / N, checked: the expected batch must fit in the data set."""
    return check_count(batch_size, "batch_size", 1, N, note="the expected Poisson batch size",
                       high_name="N") / N


__all__ = ["DPRun", "accounting_rate", "dp_train_lm", "perplexity", "train_lm"]
