"""A second optimizer over the private model's parameters (``dpsgd/other_optimizers.py``):
stepping it on the ordinary ``.grad`` between backward and the DP step is refused before
anything moves; after the DP step (the released gradient), after detach, over other
parameters, or as a wrapper of the DP optimizer, it steps."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import LoopError

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


# The wrapped optimizer stepped by its old name (probeL p06): every spelling of its step
# outside the DP optimizer's own is refused before anything moves, and nothing is charged.
@pytest.mark.parametrize("spelling", ["name", "bound before", "class function", "closure",
                                      "after the dp step", "wrapper of it"])
def test_the_wrapped_optimizer_stepped_outside_the_dp_step_is_refused(spelling):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, K)).double()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    bound = sgd.step  # taken before the DP optimizer exists
    wrapper = Wrapper(sgd)  # a Lookahead-style wrapper of it, built before
    charged = []
    opt = DPOptimizer(sgd, model, noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=N, on_step=charged.append)
    x, y = torch.randn(N, D, dtype=torch.float64), torch.arange(N) % K

    def closure():
        sgd.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    F.cross_entropy(model(x), y).backward()
    if spelling == "after the dp step":
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    n_charged = len(charged)
    call = {"name": lambda: opt.original_optimizer.step(), "bound before": bound,
            "class function": lambda: torch.optim.SGD.step(sgd),
            "closure": lambda: sgd.step(closure), "after the dp step": sgd.step,
            "wrapper of it": wrapper.step}[spelling]
    message = (r"Wrapper.step\(\) over the private model's parameter '0.weight'.*Step only "
               r"the DP optimizer" if spelling == "wrapper of it" else
               r"SGD.step\(\) called on the optimizer passed to make_private.*DP optimizer "
               r"make_private returned")
    with pytest.raises(LoopError, match=message):
        call()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert len(charged) == n_charged
    opt.zero_grad()  # the DP optimizer still steps it, and a scheduler over it still counts
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert len(charged) == n_charged + 1


def test_a_second_optimizer_with_a_closure_is_refused():
    model, opt, x, y = private()
    other = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        other.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LoopError, match=r"SGD.step\(closure\) over the private model's "
                                        r"parameter '0.weight'"):
        other.step(closure)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_second_optimizer_on_a_released_gradient_accumulated_into_is_refused():
    """dp.step(); loss.backward() (no zero_grad: autograd adds the ordinary gradient into the
    released .grad in place, the same tensor); other.step() stepped on it until 2026-11-30."""
    model, opt, x, y = private()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    F.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LoopError, match=r"SGD.step\(\) over the private model's parameter"):
        other.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_scheduler_and_a_wrapper_passed_in_step_with_the_dp_step():
    """The wrapped optimizer may be a wrapper (its base steps inside the DP step, on the
    released gradient) and an LR scheduler over it counts the DP step's inner step: the
    update equals plain SGD on the released gradient (float64, to 1e-12)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, K)).double()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    opt = DPOptimizer(Wrapper(sgd), model, noise_multiplier=0.0, max_grad_norm=1e6,
                      expected_batch_size=N, loss_reduction="sum")
    x, y = torch.randn(N, D, dtype=torch.float64), torch.arange(N) % K
    for lr in (0.1, 0.05):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        twin = copy.deepcopy(model)
        exact = torch.autograd.grad(F.cross_entropy(twin(x), y, reduction="sum"),
                                    list(twin.parameters()))
        F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        sched.step()
        for b, p, g in zip(before, model.parameters(), exact):
            torch.testing.assert_close(p.detach(), b - lr * g / N, rtol=0, atol=1e-12)
