"""A model or loss that cannot run on one record alone couples the records: every exact
per-record gradient runs each record on its own (micro-batching, the self-check's probe, the
whole-model fallback), so such a model is refused by name (``checks.alone``), not with the
raw error it raised alone ("not enough values to unpack", "Expected input batch_size (0)"),
until 2026-11-29."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.dpsgd.test_invariant import ALL_MODES, C, batch
from workbench.dpsgd import DPOptimizer
from workbench.errors import SampleMixingError, UnsupportedLayerError

X, Y = batch(n=6)


class Halves(nn.Module):
    """The batch's first half through one layer, its second through another."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        x1, x2 = x.chunk(2)
        return torch.cat([self.a(x1), self.b(x2)])


class FirstTwo(nn.Module):
    """A layer on the batch's first two rows, padded back to n."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        return self.a(x) + F.pad(self.b(x[:2]), (0, 0, 0, x.shape[0] - 2))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("method", wb.METHODS)
@pytest.mark.parametrize("cls", [Halves, FirstTwo])
def test_functional_api_refuses_a_model_that_needs_its_batch(cls, method):
    with pytest.raises((SampleMixingError, UnsupportedLayerError),
                       match="one record alone|cannot run this model"):
        wb.per_sample_gradients(cls().double(), losses, X, Y, method=method)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("cls", [Halves, FirstTwo])
def test_optimizer_refuses_a_model_that_needs_its_batch(cls, mode):
    m = cls().double()
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.zero_grad()
            F.cross_entropy(m(X), Y, reduction="sum").backward()
            with pytest.raises(SampleMixingError, match="one record alone"):
                opt.step()
    finally:
        opt.detach()
