"""The models a membership audit attacks: a pool of records, a recipe, and the training loop.

A ``Task`` is a pool of N records with a model factory, a per-record loss and the score φ of
``membership_stats`` (logit-scaled confidence for the digits classifier; the negative mean
token loss of a window for ``tiny_gpt``, sequence-level membership as in Carlini et al. 2021,
"Extracting Training Data from Large Language Models", arXiv 2012.07805). Each model trains on
the records of its IN mask with the same ``Recipe``.

Private training is the workbench's engine, piece by piece as ``PrivacyEngine.make_private``
assembles it (a Poisson ``DPDataLoader``, the ``DPOptimizer``, an accountant fed by its
``on_step``), with one difference that soundness needs: the sample rate q and the expected
batch size B are fixed from the pool, q = B / (N/2), for every model. ``make_private`` sets
q = B / |D|, which moves when one record is added or removed; the audit compares neighbouring
data sets, so the mechanism must not depend on |D| (the accountant's ε assumes it does not).
The loss is summed (``loss_reduction="sum"``) and the noisy sum divided by this fixed B.

Notation: N pool size, D a model's IN records, q sample rate, B = qN/2, σ, C as usual.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from workbench import accounting
from workbench.audit.membership_stats import logit_confidence
from workbench.checks import check_count, check_delta, check_max_grad_norm, check_positive
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.dpsgd.sampling import DPDataLoader


@dataclass(frozen=True)
class Recipe:
    """How every model (shadows and targets alike) is trained; ``noise_multiplier=None``: no DP."""

    epochs: int = 20
    batch_size: int = 32  # B: expected Poisson batch under DP, fixed-size batches without
    lr: float = 0.1
    optimizer: str = "sgd"  # "sgd" (momentum 0.9) or "adam"
    noise_multiplier: float | None = None
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"
    method: str = "auto"  # the DP optimizer's per-sample method

    @property
    def private(self) -> bool:
        return self.noise_multiplier is not None

    def describe(self) -> str:
        dp = (f"DP-SGD σ={self.noise_multiplier:g}, C={self.max_grad_norm:g}" if self.private
              else "non-private")
        return f"{dp}, {self.epochs} epochs, B={self.batch_size}, {self.optimizer} lr={self.lr:g}"


@dataclass(frozen=True)
class Task:
    """A pool of records and how to build, train and score a model on them."""

    name: str
    pool: TensorDataset  # N records (x, y)
    make_model: Callable[[torch.Generator], nn.Module]
    loss: Callable  # (outputs, targets) -> (n,) per-record loss
    score: Callable  # (model, x, y) -> np.ndarray (n,) φ, larger = more member-like


def _classifier_score(model, x, y) -> np.ndarray:
    with torch.no_grad():
        return logit_confidence(model(x).double().numpy(), y.numpy())  # (n,) Eq. (4)


def _digits_model(generator: torch.Generator) -> nn.Module:
    from workbench.models import digits_mlp

    with torch.random.fork_rng(devices=[]):  # digits_mlp draws from the global generator
        torch.manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator)))
        return digits_mlp()


def digits_task(pool_size: int = 500, seed: int = 0) -> Task:
    """``pool_size`` records of the digits training split (a seeded random subset), MLP model."""
    from workbench.data import load_digits

    train, _ = load_digits()
    n = check_count(pool_size, "pool_size", 8, len(train), high_name="the digits training set")
    idx = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:n]
    x, y = train.tensors
    return Task("digits_mlp", TensorDataset(x[idx], y[idx]), _digits_model,
                nn.CrossEntropyLoss(reduction="none"), _classifier_score)


def gpt_task(pool_size: int = 128, block_size: int = 16, n_layer: int = 1, n_embd: int = 32,
             n_head: int = 2, text: str = "carroll", seed: int = 0) -> Task:
    """``pool_size`` windows of ``block_size`` characters of ``text``; a small ``tiny_gpt``."""
    from workbench.lm.corpus import CharTokenizer, load_text, windows
    from workbench.lm.gpt import sequence_cross_entropy, tiny_gpt

    tok = CharTokenizer()
    data = windows(tok.encode(load_text(text)), block_size)
    n = check_count(pool_size, "pool_size", 8, len(data.tensors[0]),
                    high_name=f"the windows of {text!r}")
    idx = torch.randperm(len(data.tensors[0]), generator=torch.Generator().manual_seed(seed))[:n]
    x, y = (t[idx] for t in data.tensors)

    def make_model(generator):
        return tiny_gpt(tok.vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                        n_embd=n_embd, generator=generator)

    def score(model, xb, yb):
        with torch.no_grad():
            return -sequence_cross_entropy(model(xb), yb).double().numpy()  # (n,) −mean loss

    return Task("tiny_gpt", TensorDataset(x, y), make_model, sequence_cross_entropy, score)


def _optimizer(recipe: Recipe, params):
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(params, lr=recipe.lr, momentum=0.9)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(params, lr=recipe.lr)
    raise ValueError(f"Recipe.optimizer must be 'sgd' or 'adam'; got {recipe.optimizer!r}")


def sample_rate(recipe: Recipe, pool_size: int) -> float:
    """q = B / (N/2): the same for every model, whatever its IN mask (see the module doc)."""
    B = check_count(recipe.batch_size, "batch_size", 1, pool_size // 2,
                    note="the expected Poisson batch B = q·N/2", high_name="pool_size / 2")
    return B / (pool_size / 2)


def train_model(task: Task, members: np.ndarray, recipe: Recipe, seed: int):
    """Train a fresh model on ``task.pool[members]``; returns (model, ε or inf if not private)."""
    g = torch.Generator().manual_seed(int(seed))
    model = task.make_model(g)
    x, y = (t[torch.as_tensor(np.flatnonzero(members))] for t in task.pool.tensors)
    data = TensorDataset(x, y)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(recipe, params)
    if not recipe.private:
        loader = DataLoader(data, batch_size=recipe.batch_size, shuffle=True, generator=g)
        for _ in range(check_count(recipe.epochs, "epochs")):
            for xb, yb in loader:
                opt.zero_grad()
                task.loss(model(xb), yb).mean().backward()
                opt.step()
        return model.eval(), math.inf
    q = sample_rate(recipe, len(task.pool))
    steps = accounting.steps_from_epochs(check_positive(recipe.epochs, "epochs"), q)
    accountant = accounting.make_accountant(recipe.accountant)
    dp = DPOptimizer(opt, model, noise_multiplier=recipe.noise_multiplier,
                     max_grad_norm=check_max_grad_norm(recipe.max_grad_norm),
                     expected_batch_size=recipe.batch_size, loss_reduction="sum",
                     method=recipe.method, generator=g,
                     on_step=lambda s: accountant.step(noise_multiplier=s, sample_rate=q))
    for xb, yb in DPDataLoader(data, sample_rate=q, steps=steps, generator=g):
        dp.zero_grad()
        task.loss(model(xb), yb).sum().backward()
        dp.step()
    dp.detach()
    return model.eval(), float(accountant.get_epsilon(check_delta(recipe.delta)))


def score_pool(task: Task, model: nn.Module, batch: int = 512) -> np.ndarray:
    """φ of every pool record under ``model``: (N,)."""
    x, y = task.pool.tensors
    return np.concatenate([task.score(model, xb, yb)
                           for xb, yb in zip(x.split(batch), y.split(batch))])


__all__ = ["Recipe", "Task", "digits_task", "gpt_task", "sample_rate", "score_pool", "train_model"]
