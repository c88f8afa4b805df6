"""A behaviour rule's probe never moves the user's random stream. The elementwise-affine rule's
probe drew its random weights from the global generator (``torch.randn_like``) the first time
it met a layer, inside the first call: a seeded model with dropout (timm's ViT with drop path,
whose LayerScale is matched by behaviour) then drew other masks in that call's forward than a
plain forward seeded alike, and the per-sample gradients matched no seeded run (relative 0.70,
the sweep of new architectures). Probes now draw from their own generators, and every behaviour
verdict and probe forward runs with the global generators restored after it
(``registry.rng_kept``): a probe of a layer whose forward itself draws leaves no trace either."""

import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb

D = 4


class Scale(nn.Module):
    """LayerScale-like (o = x ⊙ γ + β, the affine rule's by behaviour), and it draws."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(D)), nn.Parameter(torch.zeros(D))

    def forward(self, x):
        noise = torch.rand(()) * 0  # a draw (think of a stochastic layer's coin), no effect
        return x * self.weight + self.bias + noise


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale, self.head = nn.Linear(D, D), Scale(), nn.Linear(D, 2)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.head(self.drop(self.scale(torch.tanh(self.fc(x)))))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def test_the_first_forward_starts_where_the_seed_left_the_generator():
    torch.manual_seed(0)
    model = Model().double()
    x, y = torch.randn(3, D, dtype=torch.float64), torch.tensor([0, 1, 0])
    starts = []
    model.register_forward_pre_hook(lambda m, a: starts.append(torch.get_rng_state()))
    seeded = torch.manual_seed(7).get_state()
    got = wb.per_sample_gradients(model, losses, x, y, method="einsum")
    assert torch.equal(starts[0], seeded)  # the probes drew nothing from the stream
    seen = []  # a plain forward seeded alike: its dropout mask, then one record at a time
    hook = model.drop.register_forward_hook(lambda m, a, o: seen.append(o / a[0]))
    with torch.no_grad():
        torch.manual_seed(7)
        model(x)
    hook.remove()
    mask = seen[0]
    for i in range(3):
        h = model.scale(torch.tanh(model.fc(x[i:i + 1]))) * mask[i:i + 1]
        loss = losses(model.head(h), y[i:i + 1]).sum()
        for k, g in zip([k for k, _ in model.named_parameters()],
                        torch.autograd.grad(loss, list(model.parameters()))):
            torch.testing.assert_close(got[k][i], g, rtol=1e-9, atol=1e-12)
