"""A layer returning several Tensors, one computed from another inside the layer (a recurrent
cell's (h, c) with h computed from its new c; a router's logits and the top-k weights computed
from them): the gradient that arrives at the earlier output holds the later one's path through
the layer too, so a rule or per-layer vmap given every output's gradient counted that path
twice. Before ``hooks.fed_outputs`` the cell's per-sample gradients were off by 67% with
``check=False`` (and refused by the self-check with it); now each such output is copied after
the call (``hooks.apart``) and its gradient is the one from outside the layer alone; the same
value returned twice (``return h, h``) was off by 100% and is copied at each place. Exact
against micro-batching in float64, every method and optimizer mode, check on and off."""

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import (
    assert_agree,
    assert_clipped_sums_agree,
    assert_optimizer_matches_microbatch,
)
from workbench.dpsgd import MODES, DPOptimizer

D, C = 4, 0.5
State = namedtuple("State", "h c")


class Cell(nn.Module):
    """A rule-less cell: c' = tanh(x W + c U), h = 2 c' + sin(c'): h is computed from c'."""

    def __init__(self, kind=tuple):
        super().__init__()
        self.W = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.U = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.kind = kind

    def forward(self, x, c):
        c = torch.tanh(x @ self.W + c @ self.U)
        if self.kind == "twice":  # the same value as both outputs (a GRU-like cell's (h, h))
            return c, c
        h = 2.0 * c + torch.sin(c)
        return State(h, c) if self.kind is State else self.kind((h, c))


class Unrolled(nn.Module):
    def __init__(self, kind=tuple):
        super().__init__()
        self.cell, self.head = Cell(kind), nn.Linear(D, 3)

    def forward(self, x):  # (n, T, D)
        c = torch.zeros(x.shape[0], D, dtype=x.dtype)
        total = 0.0
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], c)  # c feeds the next step, h the output: both used
            total = total + h
        return self.head(total + c)


class Pair(tuple):
    """A tuple type the recorder cannot rebuild with copies: the exact fallback instead."""

    def __new__(cls, items):
        return super().__new__(cls, items)


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, D, generator=g, dtype=torch.float64), \
        torch.randint(0, 3, (n,), generator=g)


def model_of(kind=tuple):
    torch.manual_seed(0)
    return Unrolled(kind).double()


@pytest.mark.parametrize("kind", [tuple, list, State, Pair, "twice"])
@pytest.mark.parametrize("check", [True, False])
def test_outputs_computed_from_each_other_are_exact(kind, check):
    model, (x, y) = model_of(kind), batch(6)
    assert_agree(model, losses, x, y, methods=("einsum",), check=check)
    assert_clipped_sums_agree(model, losses, x, y, C, check=check)


def test_the_copy_changes_nothing_the_model_computes():
    model = model_of()
    x, y = batch(4)
    plain = losses(model(x), y)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum")
    try:
        recorded = losses(model(x), y)
        torch.testing.assert_close(recorded, plain, rtol=0, atol=0)
        h, c = model.cell(x[:, 0], torch.zeros(4, D, dtype=x.dtype))
        assert isinstance(h, torch.Tensor) and isinstance(c, torch.Tensor)
    finally:
        opt.detach()


@pytest.mark.parametrize("mode", [*MODES, "auto"])
@pytest.mark.parametrize("verify", [True, False])
def test_dp_optimizer_steps_are_exact(mode, verify):
    batches = [batch(n, seed) for seed, n in ((0, 3), (1, 5), (2, 4))]
    assert_optimizer_matches_microbatch(model_of(), losses, batches, max_grad_norm=C,
                                        method=mode, verify=verify)
