"""A second optimizer over the private model's parameters (``dpsgd/other_optimizers.py``):
stepping it on the ordinary ``.grad`` between backward and the DP step is refused before
anything moves; after the DP step (the released gradient), after detach, over other
parameters, or as a wrapper of the DP optimizer, it steps."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.dpsgd.optimizer import DPOptimizer

N, D, K = 6, 4, 3


def private():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, K)).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=N)
    x, y = torch.randn(N, D, dtype=torch.float64), torch.arange(N) % K
    return model, opt, x, y


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("params", ["all", "one layer"])
def test_a_second_optimizer_on_the_ordinary_gradient_is_refused(kind, params):
    model, opt, x, y = private()
    other = kind(model.parameters() if params == "all" else model[2].parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="ordinary .unclipped, noiseless. gradient"):
        other.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


class Wrapper(torch.optim.Optimizer):  # Lookahead-style: holds the DP optimizer
    def __init__(self, base):
        self.base_optimizer = base
        super().__init__(base.param_groups, {})

    def step(self, closure=None):
        return self.base_optimizer.step()


def test_after_the_dp_step_after_detach_and_wrappers_step():
    model, opt, x, y = private()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    other.step()  # on the released gradient: post-processing
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    Wrapper(opt).step()
    opt.detach()
    F.cross_entropy(model(x), y).backward()
    other.step()  # the model is no longer private
