"""Opacus side by side in the benchmarks, when it is installed (``pip install opacus``).

``gsm_step`` runs what the Opacus paper measures per layer (Yousefpour et al. 2021, arXiv
2109.12298, §3.2, Tables 2-3, "GSM(module)"): one forward and backward pass of the layer
wrapped in ``opacus.GradSampleModule`` (hooks mode), which leaves the per-sample gradients in
``p.grad_sample`` and the batch gradient in ``p.grad``. No clipping: the clipped sum is the
DPOptimizer's later step. For the recurrent and attention layers the wrapped module is
Opacus' own DP layer (``opacus.layers``), as in the paper.
"""

import importlib.util
import warnings

from torch import nn

from workbench.models import RNNOutput, SelfAttention


def available() -> bool:
    return importlib.util.find_spec("opacus") is not None


def opacus_layer(name: str, width: int, ours: nn.Module) -> nn.Module:
    """The module Opacus wraps for layer ``name``: a copy of ours, or Opacus' DP twin."""
    import copy

    from opacus import layers

    heads = 4
    twins = {"rnn": lambda: nn.Sequential(layers.DPRNN(width, width, batch_first=True),
                                          RNNOutput()),
             "gru": lambda: nn.Sequential(layers.DPGRU(width, width, batch_first=True),
                                          RNNOutput()),
             "lstm": lambda: nn.Sequential(layers.DPLSTM(width, width, batch_first=True),
                                           RNNOutput()),
             "mha": lambda: SelfAttention(layers.DPMultiheadAttention(width, heads,
                                                                      batch_first=True))}
    return twins[name]() if name in twins else copy.deepcopy(ours)


def gsm_step(module: nn.Module, loss_fn, x, t):
    """A callable: one GradSampleModule forward + backward of Σ_i loss_fn(...)_i.

    Gradients and per-sample gradients are cleared before and after each call, so calls
    start from the same state; the call returns nothing (what it held is freed).
    """
    from opacus import GradSampleModule

    gsm = GradSampleModule(module, batch_first=True, loss_reduction="sum")

    def clear():
        for p in gsm.parameters():
            p.grad = None
            p.grad_sample = None

    def step():
        clear()
        with warnings.catch_warnings():  # inputs need no gradient: Opacus' hooks say so
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss_fn(gsm(x), t).sum().backward()
        grads = [p.grad_sample for p in gsm.parameters() if p.requires_grad]
        assert all(g is not None for g in grads), "Opacus left a parameter without grad_sample"
        clear()

    return step


OPACUS_MODES = ("hooks", "ghost")  # Opacus' per-sample and fast-gradient-clipping modes


def opacus_training_step(make_model, x, y, mode: str, lr: float = 0.01, criterion=None):
    """A callable: one step of Opacus' own private training loop (its PrivacyEngine in
    ``grad_sample_mode=mode``, noise_multiplier 1, C = 1) on the fixed batch (x, y).

    ``mode="ghost"`` is Opacus' fast gradient clipping: its loss wrapper runs the two backward
    passes (seed 004, the Opacus blog on ghost clipping). The model is a fresh copy;
    ``criterion`` defaults to cross-entropy.
    """
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    criterion = nn.CrossEntropyLoss() if criterion is None else criterion
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
            poisson_sampling=False)
    model, optimizer = made[0], made[1]
    criterion = made[2] if mode == "ghost" else criterion

    def step():
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            criterion(model(x), y).backward()
        optimizer.step()

    return step


__all__ = ["OPACUS_MODES", "available", "gsm_step", "opacus_layer", "opacus_training_step"]
