"""The precision a pass computed in, wherever it was chosen, and what has no real gradient.

Found by a probing helper on 2026-11-30 (scripts in its report): an autocast block opened
inside the model's own ``forward`` (the pre-hook reads the autocast state before it opens)
made a correct bfloat16 pass fail the float32-tolerance check; a complex parameter reached
PyTorch's "grad can be implicitly created only for real scalar outputs" in the optimizer and
a misleading sampler error in einsum; a C of 1e-26 let a record's squares underflow, released
unclipped.
"""

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.dpsgd import DPOptimizer
from workbench.errors import UnsupportedLayerError


class AutocastInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 16), nn.Linear(16, 3)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.b(torch.tanh(self.a(x))).float()


LOSS = nn.CrossEntropyLoss(reduction="none")


def batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("seed", range(3))
def test_autocast_opened_inside_forward_is_checked_at_its_precision(seed):
    torch.manual_seed(seed)
    model = AutocastInside()
    x, y = batch(seed)
    ref = wb.per_sample_gradients(model, LOSS, x, y, method="microbatch")
    got = wb.per_sample_gradients(model, LOSS, x, y, method="einsum")  # was refused
    for k in ref:  # bfloat16's rounding: both sides round, differently
        assert (got[k] - ref[k]).norm() <= 2e-2 * ref[k].norm()
    wb.clipped_grad_sum(model, LOSS, x, y, 0.5, method="bookkeeping")


@pytest.mark.parametrize("method", ["auto", "bookkeeping"])
def test_the_optimizer_checks_it_at_its_precision_too(method):
    torch.manual_seed(0)
    model = AutocastInside()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=6, loss_reduction="sum",
                      method=method)
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        LOSS(model(x), y).sum().backward()
        opt.step()  # was PerSampleCheckError at float32's tolerance


def test_a_complex_parameter_is_refused_by_name():
    model = nn.Linear(3, 2, dtype=torch.cfloat)
    x = torch.randn(4, 3, dtype=torch.cfloat)
    loss = lambda out, _: out.abs().pow(2).sum(1)  # noqa: E731
    for call in (lambda: wb.per_sample_gradients(model, loss, x, None, method="einsum"),
                 lambda: wb.clipped_grad_sum(model, loss, x, None, 1.0, method="ghost"),
                 lambda: DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                     noise_multiplier=1.0, max_grad_norm=1.0,
                                     expected_batch_size=4)):
        with pytest.raises(UnsupportedLayerError, match=r"parameter weight is complex"):
            call()


def test_a_clip_norm_whose_squares_underflow_is_refused():
    model = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="max_grad_norm.*underflow"):
        wb.clipped_grad_sum(model, lambda o, _: o.sum(1) * 1e-25, x, None, 1e-26)
