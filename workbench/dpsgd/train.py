"""``wb.train``: run epochs of the ordinary loop with a progress bar; one table row per epoch.

The loop is the one every PyTorch user writes (``zero_grad``; ``loss = criterion(model(x),
y)``; ``loss.backward()``; ``step()``); with a DP optimizer from ``PrivacyEngine`` it is
DP-SGD (and ``criterion``'s reduction must then be the optimizer's ``loss_reduction``;
the default criterion is ``nn.CrossEntropyLoss()``, a mean). Each epoch's row has the mean
training loss, the accuracy on ``eval_data`` (if given), the ε spent so far (at ``delta``),
the fraction of samples whose gradient was clipped, and the gradient signal-to-noise ratio
||Σ_i c_i g_i|| / (σ C √d), averaged over the epoch's steps
(Opacus paper, Yousefpour et al. 2021, arXiv 2109.12298; NanoBatch, Lee et al. 2022, discuss
how batch size moves it).

On a small, busy CPU, PyTorch's intra-op threads can slow these small steps down many times
over (measured here: 27 s with two threads against 0.7 s with one for the same 15 epochs);
``torch.set_num_threads(1)`` is worth trying there.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from workbench.checks import check_count
from workbench.dpsgd.engine import check_criterion
from workbench.per_sample.checks import evaluating

if TYPE_CHECKING:
    import pandas as pd


def accuracy(model: nn.Module, data) -> float:
    """Top-1 accuracy of ``model`` on a TensorDataset (or a (inputs, targets) pair)."""
    x, y = data.tensors if hasattr(data, "tensors") else data
    with evaluating(model), torch.no_grad():  # each module's mode back (a frozen BatchNorm)
        correct = (model(x).argmax(dim=1) == y).float().mean().item()
    return correct


def train(model, optimizer, loader, *, epochs: int, criterion=None, engine=None,
          delta: float = 1e-5, eval_data=None, progress: bool = True) -> "pd.DataFrame":
    """Train for ``epochs``; returns a DataFrame with one row per epoch (see module doc)."""
    import pandas as pd  # lazy: pandas and tqdm only where used
    from tqdm.auto import tqdm

    epochs = check_count(epochs, "epochs")
    criterion = nn.CrossEntropyLoss() if criterion is None else criterion
    if hasattr(optimizer, "loss_reduction") and hasattr(criterion, "reduction"):
        check_criterion(criterion, optimizer.loss_reduction)  # a DP optimizer: same reduction
    rows = []
    bar = tqdm(total=int(epochs) * len(loader), disable=not progress, desc="training")
    for epoch in range(1, int(epochs) + 1):
        losses, clipped, snr = [], [], []
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            last = getattr(optimizer, "last", {})
            if len(y):
                losses.append(loss.item())
            if "clip_factors" in last and len(last["clip_factors"]):
                clipped.append((last["clip_factors"] < 1).float().mean().item())
            if last.get("noise"):
                snr.append(last["signal"] / last["noise"])
            bar.update()
        row = {"epoch": epoch, "loss": sum(losses) / max(len(losses), 1)}
        if eval_data is not None:
            row["accuracy"] = accuracy(model, eval_data)
        if engine is not None:
            row["epsilon"] = engine.get_epsilon(delta)
        if clipped:
            row["fraction_clipped"] = sum(clipped) / len(clipped)
        if snr:
            row["grad_snr"] = sum(snr) / len(snr)
        rows.append(row)
        bar.set_postfix({k: round(v, 3) for k, v in row.items() if k != "epoch"})
    bar.close()
    return pd.DataFrame(rows).set_index("epoch")


__all__ = ["accuracy", "train"]
