"""A layer that returns one of its parameters as it is (``return self.table``).

Its output then *is* the parameter: the gradient its hook reads is the parameter's whole
gradient, which the use tracker also counts where the parameter meets the batch. At n = 1 the
output's dim 0 of size 1 passes for the batch's, so both counted it: the per-sample gradient
came out 2x (einsum, book-keeping, ghost, every optimizer mode; relative error 1.0), silently,
the self-check on. The hook now copies such an output inside the layer (``hooks.leaf_outputs``),
which every route reads once, as it reads ``self.table * 1``. Every method and optimizer mode,
check on and off, n = 1 among the sizes; a tuple holding the parameter too.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import (
    assert_agree,
    assert_clipped_sums_agree,
    assert_optimizer_matches_microbatch,
)


class Table(nn.Module):
    def __init__(self, T=4):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, T, T) / 4)

    def forward(self):
        return self.table


class Pair(nn.Module):  # (its projection of x, its gate parameter as it is)
    def __init__(self, d=3):
        super().__init__()
        self.proj, self.gate = nn.Linear(d, d), nn.Parameter(torch.randn(1, 1, d))
        self.W = nn.Parameter(torch.randn(d, d) / 2)

    def forward(self, x):
        return x @ self.W, self.gate


class Model(nn.Module):
    def __init__(self, T=4, d=3):
        super().__init__()
        self.bias, self.pair, self.head = Table(T), Pair(d), nn.Linear(d, 2)

    def forward(self, x):  # x: (n, T, d)
        h, gate = self.pair(x)
        scores = h @ x.transpose(1, 2) + self.bias()
        return self.head((scores.softmax(-1) @ x * torch.sigmoid(gate)).mean(1))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 2, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return Model().double()


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("check", [True, False])
def test_functional_methods_count_the_parameter_once(n, check):
    m = model()
    x, y = batch(n, 0)
    assert_agree(m, losses, x, y, methods=("vmap", "einsum"), check=check)
    assert_clipped_sums_agree(m, losses, x, y, 0.05, check=check)


@pytest.mark.parametrize("method", ["microbatch", "einsum", "bookkeeping", "auto"])
@pytest.mark.parametrize("verify", [True, False])
def test_optimizer_steps_count_the_parameter_once(method, verify):
    batches = [batch(n, seed) for seed, n in enumerate((1, 3, 1, 2))]
    assert_optimizer_matches_microbatch(model(), losses, batches, max_grad_norm=0.05,
                                        method=method, verify=verify)


def test_the_output_the_model_sees_is_the_same_value():
    m = model()
    x, _ = batch(2, 0)
    plain = m(x)
    from workbench.per_sample.hooks import ActivationRecorder

    with ActivationRecorder({"bias": m.bias, "pair": m.pair}):
        hooked = m(x)
    torch.testing.assert_close(hooked, plain, rtol=0, atol=0)
