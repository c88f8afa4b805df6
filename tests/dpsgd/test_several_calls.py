"""One backward pass through several calls of the private model is refused: row i of each call
would be clipped as one record. With a batch split in two halves of equal size, records i and
n/2 + i were silently clipped together (the sum 35% off in every mode, each pair's
sensitivity 2C); nothing in the data tells a split batch from two views of the same records."""

import pytest
import torch
from torch import nn

from workbench.dpsgd import MODES, DPOptimizer
from workbench.errors import LossCouplingError


def clipped_reference(model, x, y, C):
    """Σ_i min(1, C/||g_i||) g_i, one record at a time (the independent twin)."""
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        (model(x[i:i + 1]) - y[i:i + 1]).pow(2).sum().backward()
        rows.append({k: p.grad.clone() for k, p in model.named_parameters()})
    norms = torch.stack([torch.cat([g.flatten() for g in r.values()]).norm() for r in rows])
    c = (C / norms).clamp(max=1)
    return {k: sum(c[i] * rows[i][k] for i in range(len(x))) for k in rows[0]}


@pytest.mark.parametrize("mode", [*MODES, "auto"])
@pytest.mark.parametrize("halves", [(3, 3), (4, 2)])
def test_a_batch_split_over_two_calls_is_refused_and_the_next_step_is_exact(mode, halves):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    C = 0.5
    want = clipped_reference(model, x, y, C)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum",
                      method=mode)
    try:
        a = halves[0]
        opt.zero_grad()
        loss = (model(x[:a]) - y[:a]).pow(2).sum() + (model(x[a:]) - y[a:]).pow(2).sum()
        loss.backward()
        with pytest.raises(LossCouplingError, match="2 calls of the private model"):
            opt.step()
        opt.zero_grad()  # the fix the message gives: one call, the output split for the loss
        (model(x) - y).pow(2).sum().backward()
        opt.step()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()
