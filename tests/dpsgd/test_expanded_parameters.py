"""A parameter expanded to the batch, then given to a layer (Perceiver's latents through a
LayerNorm, DETR's object queries, fixed decoder ids through an Embedding): the call is on a
tensor computed without the batch, whose rows are one row repeated. Every DP-optimizer mode
crashed on it with "Tensor.item() cannot be called on meta tensors": streaming had replaced the
call's inputs by shape-only stand-ins before the check that its rows are one row repeated read
their values. ``hooks.drop_inputs`` now notes that per input before dropping it. Exact against a
loop over records, float64, every mode, n equal to the number of latents among the sizes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.dpsgd import MODES, DPOptimizer

C, L = 0.5, 4


class Latents(nn.Module):
    def __init__(self, ids=False):
        super().__init__()
        self.lat = nn.Parameter(torch.randn(L, 8))
        self.register_buffer("ids", torch.tensor([[1, 2, 3, 0]]))
        self.emb, self.ln = nn.Embedding(5, 8), nn.LayerNorm(8)
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.use_ids = ids

    def forward(self, x):
        n = x.shape[0]
        if self.use_ids:
            latents = self.emb(self.ids.expand(n, -1))
        else:
            latents = self.ln(self.lat.expand(n, -1, -1))
        return self.out((self.inp(x)[:, None] + latents).mean(1))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def clipped_sum(model, x, y):
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(losses(model(x[i:i + 1]), y[i:i + 1]).sum(), params,
                                    allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += g * min(1.0, C / norm.item())
    return dict(zip([k for k, p in model.named_parameters() if p.requires_grad], total))


@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_a_parameter_expanded_to_the_batch_steps_exactly(mode, ids):
    torch.manual_seed(0)
    model = Latents(ids).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum",
                      method=mode)
    try:
        for seed, n in ((0, 3), (1, L), (2, 5)):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, 6, generator=g, dtype=torch.float64)
            y = torch.randint(0, 3, (n,), generator=g)
            want = clipped_sum(model, x, y)
            opt.zero_grad()
            losses(model(x), y).sum().backward()
            opt.step()
            for k, p in model.named_parameters():
                if k in want:
                    torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()
