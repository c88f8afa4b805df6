"""A forward pass that writes a buffer (or a parameter) from the batch's values is refused in
private training.

A custom running statistic (``self.running_mean.mul_(0.9).add_(0.1 * h.mean(0))``, a buffer
rebound to a statistic of the batch, ``F.batch_norm`` called with ``training=True`` on the
layer's own buffers, a parameter initialised from the first batch as Glow's ActNorm) stores an
unclipped, un-noised function of the records in the model that DP-SGD releases, and later
steps read it: before this check the optimizer stepped on and the buffer held the data's mean,
silently outside every (ε, δ). The type check knew BatchNorm and InstanceNorm only; this one
knows any layer by what its forward did (``derived.Taint``: whether the written tensor was
computed from the model's inputs). Buffers written without the batch's values (a step counter,
a cache rebuilt from the input's shape) and statistics kept only outside training are fine;
the functional API (no release) is unchanged. A parameter rebound to a new ``nn.Parameter``
made from the batch, and ``t.data = v`` with v from the batch, were stepped on silently until
2026-11-29 (the new parameter is another tensor object, made where no mode sees it): now
``nn.Parameter`` taints what it wraps during a tracked pass (``derived.follow_parameters``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import assert_optimizer_matches_microbatch
from workbench.dpsgd import DPOptimizer
from workbench.errors import SampleMixingError

D = 4


class Running(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin, self.how = nn.Linear(D, D), how
        self.register_buffer("running_mean", torch.zeros(D))
        self.register_buffer("running_var", torch.ones(D))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("positions", torch.arange(3))

    def forward(self, x):
        h = self.lin(x)
        if self.how == "in place":
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * h.mean(0))
        elif self.how == "rebound":
            self.running_mean = 0.9 * self.running_mean + 0.1 * h.detach().mean(0)
        elif self.how == "lerp":
            self.running_mean.lerp_(h.detach().mean(0), 0.1)
        elif self.how == "batch_norm":  # F.batch_norm writes them in C++
            F.batch_norm(h.detach(), self.running_mean, self.running_var, training=True)
        elif self.how == "through data":  # an alias of the buffer: another tensor object
            self.running_mean.data.mul_(0.9).add_(0.1 * h.detach().mean(0))
        elif self.how == "data init through data":
            self.lin.bias.data.copy_(-h.detach().mean(0))
        elif self.how == "out":  # an op told to write its result there
            torch.add(0.9 * self.running_mean, 0.1 * h.detach().mean(0), out=self.running_mean)
        elif self.how == "data init":  # Glow's ActNorm: a parameter set from the batch
            with torch.no_grad():
                self.lin.bias.copy_(-h.mean(0))
        elif self.how == "eval only" and not self.training:
            self.running_mean.copy_(h.detach().mean(0))
        elif self.how == "counters":  # no value of the batch: a count, a shape
            self.steps += 1
            self.positions = torch.arange(x.shape[0])
        elif self.how == "parameter rebound":  # a new Parameter on the statistic's storage
            self.shift = nn.Parameter(h.detach().mean(0), requires_grad=False)
        elif self.how == "parameter registered":
            self.register_parameter("shift", nn.Parameter(h.detach().mean(0).clone(),
                                                          requires_grad=False))
        elif self.how == "data set":  # .data = v: v's storage under the buffer
            self.running_mean.data = h.detach().mean(0)
        elif self.how == "parameter data set":
            self.lin.bias.data = -h.detach().mean(0)
        elif self.how == "fresh parameter":  # made during the pass, not from the batch
            self.shift = nn.Parameter(torch.zeros(x.shape[1], dtype=x.dtype),
                                      requires_grad=False)
            self.running_var.data = torch.ones(D, dtype=x.dtype)
        return h


class Model(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.body, self.head = Running(how), nn.Linear(D, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def mse(out, y):
    return (out - y).pow(2).sum(1)


def problem(how, n=3):
    torch.manual_seed(0)
    model = Model(how).double()
    g = torch.Generator().manual_seed(n)
    return model, torch.randn(n, D, generator=g, dtype=torch.float64), \
        torch.randn(n, 2, generator=g, dtype=torch.float64)


WRITTEN = {"in place": "Running at body wrote its buffer 'running_mean'",
           "rebound": "Running at body wrote its buffer 'running_mean'",
           "lerp": "Running at body wrote its buffer 'running_mean'",
           "batch_norm": "Running at body wrote its buffer 'running_mean'",
           "through data": "Running at body wrote its buffer 'running_mean'",
           "out": "Running at body wrote its buffer 'running_mean'",
           "data init": "Linear at body.lin wrote its parameter 'bias'",
           "data init through data": "Linear at body.lin wrote its parameter 'bias'",
           "parameter rebound": "Running at body wrote its parameter 'shift'",
           "parameter registered": "Running at body wrote its parameter 'shift'",
           "data set": "Running at body wrote its buffer 'running_mean'",
           "parameter data set": "Linear at body.lin wrote its parameter 'bias'"}


@pytest.mark.parametrize("how", list(WRITTEN))
@pytest.mark.parametrize("mode", ["bookkeeping", "einsum", "microbatch", "auto"])
def test_a_buffer_written_from_the_batch_is_refused_before_any_step(how, mode):
    model, x, y = problem(how)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=3.0, method=mode)
    reached = []
    try:
        with pytest.raises(SampleMixingError, match=WRITTEN[how] + " from the batch"):
            opt.zero_grad()
            out = model(x)
            reached.append("backward")  # not reached: refused at the end of the forward pass
            mse(out, y).sum().backward()
            opt.step()
    finally:
        opt.detach()
    assert reached == []


def test_make_private_refuses_it_too():
    model, x, y = problem("in place")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)
    model, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=data,
        noise_multiplier=1.0, max_grad_norm=1.0)
    try:
        with pytest.raises(SampleMixingError, match="running_mean"):
            for xb, yb in loader:
                if len(xb):
                    opt.zero_grad()
                    mse(model(xb), yb).sum().backward()
                    opt.step()
    finally:
        opt.detach()


@pytest.mark.parametrize("how", ["counters", "eval only", "fresh parameter"])
def test_buffers_written_without_the_batch_values_train_as_before(how):
    model, _, _ = problem(how)
    batches = [problem(how, n)[1:] for n in (3, 1, 2)]
    assert_optimizer_matches_microbatch(model, mse, batches, max_grad_norm=0.5,
                                        method="bookkeeping")


def test_the_functional_api_releases_nothing_and_is_unchanged():
    """Per-sample gradients of a model keeping a running mean are what they are: exact."""
    model, x, y = problem("in place")
    want = wb.clipped_grad_sum(model, mse, x, y, 0.5, method="microbatch")
    got = wb.clipped_grad_sum(model, mse, x, y, 0.5, method="bookkeeping")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


class Converted(nn.Module):
    """A buffer converted to the input's dtype and device, ``self.P.to(x)`` (peft's BOFT): the
    same tensor when nothing changes, and nothing of x goes into it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("P", torch.eye(D), persistent=False)

    def forward(self, x):
        return self.lin(x) @ self.P.to(x)


def test_a_buffer_returned_by_a_no_op_conversion_is_not_written():
    torch.manual_seed(0)
    model = nn.Sequential(Converted(), nn.Linear(D, 2)).double()
    model[0].P = model[0].P.double()
    batches = [problem("counters", n)[1:] for n in (3, 1)]
    assert_optimizer_matches_microbatch(model, mse, batches, max_grad_norm=0.5,
                                        method="bookkeeping")


def test_nn_parameter_is_itself_again_after_each_pass_and_a_refusal():
    """``nn.Parameter.__new__`` passes the taint on only while a pass is tracked: after the
    pass, and after a refused one, the class holds its own ``__new__`` again (the same
    staticmethod object), and parameters made outside a pass are plain."""
    original = nn.Parameter.__dict__["__new__"]
    for how in ("counters", "parameter rebound"):
        model, x, y = problem(how)
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=3.0,
                          loss_reduction="sum")
        opt.zero_grad()
        try:
            mse(model(x), y).sum().backward()
            opt.step()
        except SampleMixingError:
            assert how == "parameter rebound"
        finally:
            opt.detach()
        assert nn.Parameter.__dict__["__new__"] is original
    assert type(nn.Parameter(torch.zeros(2))) is nn.Parameter
