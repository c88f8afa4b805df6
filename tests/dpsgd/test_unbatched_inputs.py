"""A model input without the batch on dim 0, passed positionally (position ids of shape (1, T)
beside the (n, T, d) batch): the optimizer's probe and fallback pass it whole to each record's
pass, as they do for one given by keyword; its one row is broadcast to every row, which keeps
the flattened rows' proof (``flat_rows.py``). It used to be sliced per record to an empty
tensor, and the first step crashed inside the self-check. Exact against a loop over records,
every optimizer mode, float64."""

import pytest
import torch
from torch import nn

from workbench.dpsgd import MODES, DPOptimizer

T, D, C = 5, 4, 0.5


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.inp = nn.Embedding(8, D), nn.Linear(2, D)
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x, position_ids):  # (n, T, 2), (1, T)
        h = self.inp(x) + self.pos(position_ids)  # one row of positions for every record
        flat = torch.tanh(self.fc(h.reshape(-1, D)))  # (n·T, d) rows, OPT-style
        return self.head(flat.reshape(x.shape[0], -1, D))


def losses(out, y):
    return ((out - y) ** 2).flatten(1).sum(1)


def clipped_sum(model, x, pos, y):
    total = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        losses(model(x[i:i + 1], pos), y[i:i + 1]).sum().backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        for k, p in model.named_parameters():
            total[k] += p.grad * min(1.0, C / norm.item())  # c_i = min(1, C / ||g_i||)
    model.zero_grad()
    return total


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_an_input_without_the_batch_is_passed_whole(mode):
    torch.manual_seed(0)
    model = Positions().double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum",
                      method=mode)
    pos = torch.arange(T)[None]
    try:
        for seed, n in ((0, 3), (1, T), (2, 4)):  # n = T in the middle
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, T, 2, generator=g, dtype=torch.float64)
            y = torch.randn(n, T, 2, generator=g, dtype=torch.float64)
            want = clipped_sum(model, x, pos, y)
            opt.zero_grad()
            losses(model(x, pos), y).sum().backward()
            opt.step()
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()
