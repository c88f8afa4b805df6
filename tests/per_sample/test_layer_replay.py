"""A layer without a rule whose recorded call cannot be run again on its own: vmap cannot run
its ``autograd.Function`` (no ``setup_context``), and record by record its forward reshapes
to a row count the model sets on it before the call (the batch's, not one record's). The
per-layer route used to surface torch's own error (a shape mismatch); it is now an
``UnsupportedLayerError`` naming the layer, both failures and the exact methods. (A layer
whose forward reads state that the pass changes, RecurrentGemma's RG-LRU, takes the exact
whole-model fallback instead: ``test_stateful_layers.py``.)"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.errors import UnsupportedLayerError


class Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Rows(nn.Module):
    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 4) / 2)
        self.rows = None  # set by the model before each call: the batch's row count

    def forward(self, x):
        return Doubled.apply(x.reshape(self.rows, -1) @ self.W)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell, self.head = Rows(), nn.Linear(4, 2)

    def forward(self, x):
        self.cell.rows = len(x)
        return self.head(self.cell(self.cell(x)))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def test_a_call_that_cannot_be_replayed_is_a_clear_error():
    torch.manual_seed(0)
    model = Model().double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 0])
    exact = wb.per_sample_gradients(model, losses, x, y, method="microbatch")  # the way out
    assert set(exact) == {"cell.W", "head.weight", "head.bias"}
    for check in (True, False):  # until 2026-11-29 the first checked call was exact only by
        # accident: the self-check's probe (one record) left ``rows = 1`` on the layer, which
        # the replay then read; re-runs now leave the state as the batch's pass left it
        # (state_replay.py), so the checked call is the same clear error
        with warnings.catch_warnings(), pytest.raises(
                UnsupportedLayerError, match=r"Rows has no rule.*cannot be run again.*vmap.*"
                                             r"record by record.*method='microbatch'"):
            warnings.simplefilter("ignore")  # vmap's failure: warned once per layer type
            wb.per_sample_gradients(model, losses, x, y, method="einsum", check=check)
        assert model.cell.rows == 3  # the batch's pass's, not the probe's
