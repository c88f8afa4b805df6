"""Book-keeping's streamed backward pass: Linear calls materialised on arrival stay exact."""

import torch
from torch import nn

import workbench as wb
from tests.helpers import relative_error
from workbench.clipping.bookkeeping import record_streamed


class Sequence(nn.Module):
    """Linear layers on (n, T, d): at T = 8 their g_i are smaller than (a, b)."""

    def __init__(self, width=4):
        super().__init__()
        self.up, self.down = nn.Linear(3, width), nn.Linear(width, 2)

    def forward(self, x):  # (n, T, 3)
        return self.down(torch.tanh(self.up(x))).sum(1)  # (n, 2)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def test_materialised_calls_give_the_exact_clipped_sum():
    torch.manual_seed(0)
    model = Sequence().double()
    x, y = torch.randn(5, 8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    rec, materialised = record_streamed(model, loss_fn, x, y, check=False)
    assert {id(p) for p in model.parameters()} == set(materialised)  # both layers
    assert all(call.backprops is None and all(a.device.type == "meta" for a in call.args)
               for call in rec.recorder.all_calls())  # a freed, its shape kept
    got = wb.clipped_grad_sum(model, loss_fn, x, y, 0.3, method="bookkeeping")
    want = wb.clipped_grad_sum(model, loss_fn, x, y, 0.3, method="microbatch")
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-10, name


def test_wide_layers_at_one_position_keep_their_backprops():
    torch.manual_seed(0)
    model = Sequence(width=64).double()
    x, y = torch.randn(5, 1, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    rec, materialised = record_streamed(model, loss_fn, x, y, check=False)
    assert not materialised  # g_i (64 x 3) larger than a and b (3 + 64) at T = 1
    assert all(call.backprops is not None for call in rec.recorder.all_calls())
