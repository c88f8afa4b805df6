"""A layer without a rule whose recorded call cannot be run again on its own: vmap cannot run
its ``autograd.Function`` (no ``setup_context``), and record by record its forward reads state
its previous call left on the module (a recurrent state, as RecurrentGemma's RG-LRU keeps),
not one of its inputs. The per-layer route used to surface torch's own error ("Trying to
backward through the graph a second time", a shape mismatch); it is now an
``UnsupportedLayerError`` naming the layer, both failures and the exact methods."""

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


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 4) / 2)
        self.state = None

    def forward(self, x):
        out = Doubled.apply(x @ self.W)
        if self.state is not None:
            out = out + self.state  # the previous call's output, row by row: not an input
        self.state = out
        return out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell, self.head = Stateful(), nn.Linear(4, 2)

    def forward(self, x):
        self.cell.state = None
        return self.head(self.cell(self.cell(x)))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("check", [True, False])
def test_a_call_that_cannot_be_replayed_is_a_clear_error(check):
    torch.manual_seed(0)
    model = Model().double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 0])
    exact = wb.per_sample_gradients(model, losses, x, y, method="microbatch")  # the way out
    assert set(exact) == {"cell.W", "head.weight", "head.bias"}
    with warnings.catch_warnings(), pytest.raises(
            UnsupportedLayerError, match=r"Stateful has no rule.*cannot be run again.*vmap.*"
                                         r"record by record.*method='microbatch'"):
        warnings.simplefilter("ignore")  # vmap's failure: warned once per layer type
        wb.per_sample_gradients(model, losses, x, y, method="einsum", check=check)
