"""The loss window never outlives its optimizer step or its model (``dpsgd/lifetime.py``):
a refused step, a refused loss, an abandoned loop, an error inside the forward pass and a
garbage-collected engine each leave no window that takes a later, unrelated loss for its
own. The two orders of a refused step and an unrelated ``check_separable`` (the pair of test
files that failed together) are run here in one process."""

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from workbench.dpsgd.lifetime import Weak, stale
from workbench.dpsgd.loss_watch import LossWatch
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import LossCouplingError
from workbench.per_sample.loss import check_separable

N, D, K = 6, 4, 3


def private(mean: bool = True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, K)).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=N,
                      loss_reduction="mean" if mean else "sum")
    x = torch.randn(N, D, dtype=torch.float64)
    return model, opt, x, torch.arange(N) % K


def refused_step():  # a window left by a step that raised (GradScaler's unscale_)
    model, opt, x, y = private()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(nn.CrossEntropyLoss()(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(ValueError, match="unscale_"):
        scaler.step(opt)


def refused_loss():  # a window left by a coupled loss refused at backward
    model, opt, x, y = private()
    out = model(x)
    with pytest.raises(LossCouplingError):
        nn.functional.cross_entropy(out - out.mean(0), y).backward()


def abandoned_loop():  # forward and loss, then the user's own code fails: no step
    model, opt, x, y = private()
    nn.CrossEntropyLoss()(model(x), y)
    return model, opt  # kept alive: the window is open, but only for this model's losses


def error_in_forward():
    model, opt, x, y = private()
    with pytest.raises(RuntimeError):
        model(torch.randn(N, D + 1, dtype=torch.float64))


def unrelated_sum_loss():  # another computation: a summed loss, no engine
    z = torch.randn(N, K, dtype=torch.float64)
    f = check_separable(nn.CrossEntropyLoss(reduction="sum"), z, (torch.arange(N) % K,), N,
                        "sum", 1e-9)
    assert torch.equal(f, torch.ones(N, dtype=torch.float64))
    loss = nn.CrossEntropyLoss(reduction="sum")(z.requires_grad_(), torch.arange(N) % K)
    loss.backward()  # the backward of another graph: not tested for this model's coupling


LEFT = {"refused step": refused_step, "refused loss": refused_loss,
        "abandoned loop": abandoned_loop, "error in forward": error_in_forward}


@pytest.mark.parametrize("order", ["window first", "unrelated first"])
@pytest.mark.parametrize("left", sorted(LEFT))
def test_a_left_window_does_not_take_a_later_loss(left, order):
    if order == "unrelated first":
        unrelated_sum_loss()
    kept = LEFT[left]()
    unrelated_sum_loss()
    del kept


def test_a_refused_step_closes_its_window():
    refused_step()
    assert LossWatch._open() is None


def test_the_window_keeps_its_own_model_s_losses_after_an_unrelated_one():
    model, opt, x, y = private(mean=False)
    out = model(x)
    unrelated_sum_loss()  # between the forward pass and this model's loss
    with pytest.raises(ValueError, match="loss_reduction='mean'"):
        nn.CrossEntropyLoss()(out, y)  # a mean under loss_reduction="sum": still refused


def weak_hooks() -> int:
    tables = (module_hooks._global_forward_hooks, module_hooks._global_forward_pre_hooks)
    return sum(isinstance(h, Weak) for table in tables for h in table.values())


def modes() -> list:
    return [torch._C._get_function_stack_at(i)
            for i in range(torch._C._len_torch_function_stack())]


def test_a_garbage_collected_engine_leaves_no_hook_and_no_live_mode():
    """A collected engine leaves no global hook, and its modes (the batch follower zero_grad
    started) pass calls through until the next window sweeps them. (An abandoned
    forward pass keeps its engine alive: the recorded activations' autograd hooks hold it
    through C++, until zero_grad, step or detach; its window then only sees its own model's
    losses, and the next window closes it.)"""
    gc.collect()
    before = weak_hooks()
    model, opt, x, y = private()
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    model(x).sum()  # a window opened (and a batch follower before it)
    first = weakref.ref(opt)
    assert weak_hooks() == before + 2
    opt.zero_grad()  # the recorded pass is dropped: nothing but the cycle holds the engine
    del model, opt
    gc.collect()
    assert first() is None and weak_hooks() == before
    assert all(stale(m) for m in modes())  # pass-through until the next window sweeps them
    model, opt, x, y = private()
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    assert not any(stale(m) for m in modes())


def test_a_user_mode_ending_while_the_follower_is_on_pops_its_own():
    from torch.overrides import TorchFunctionMode

    class Mine(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model, opt, x, y = private()
    with Mine() as mine:  # the step starts a follower inside the user's block
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        model(x)  # and a loss window
    assert mine not in modes() and len(modes()) >= 1
    opt.detach()
    assert not modes()
