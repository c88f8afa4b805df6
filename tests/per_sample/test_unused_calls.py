"""A layer call whose output never reaches the loss proves and disproves nothing
(``recording.loss_reach``): DoRA (peft) calls its adapter on ``eye(d)`` to build the weight
whose norm it then detaches (Liu et al. 2024, arXiv 2402.09353, §4.3). That call's dim 0 is d,
not n, and it is computed without the batch; it used to send the adapter to the whole-model
fallback. Now only calls that feed the loss are checked, by shape, taint and the probe, so
the adapter keeps its rule; the same call *not* detached still keeps the fallback (or the
meetings' route). Exact against micro-batching in float64, every method and optimizer mode,
d = n and d ≠ n."""

import pytest
import torch
from torch import nn

from tests.helpers import (
    assert_agree,
    assert_clipping_agrees,
    assert_optimizer_matches_microbatch,
    exact_routes,
    mse_per_sample,
)
from workbench.dpsgd import MODES

D, R, T = 4, 2, 3


class DoraLike(nn.Module):
    """result = (m / ||W + BA||) ⊙ (W x + B A x), the norm detached unless ``keep_norm``."""

    def __init__(self, keep_norm=False):
        super().__init__()
        self.keep_norm = keep_norm
        self.base = nn.Linear(D, D)
        self.base.weight.requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(D, R, bias=False), nn.Linear(R, D, bias=False)
        self.magnitude = nn.Parameter(1 + 0.1 * torch.randn(D))
        self.head = nn.Linear(D, 2)

    def forward(self, x):  # (n, T, D)
        eye = torch.eye(D, dtype=x.dtype)
        lora_weight = self.lora_B(self.lora_A(eye)).T  # (D, D), without the batch
        if not self.keep_norm:
            lora_weight = lora_weight.detach()
        norm = (self.base.weight + lora_weight).norm(dim=1)
        if not self.keep_norm:
            norm = norm.detach()
        scale = (self.magnitude / norm).view(1, -1)
        h = (scale - 1) * self.base(x) + scale * self.lora_B(self.lora_A(x))
        return self.head(torch.tanh(h))  # (n, T, 2)


def model(keep_norm=False):
    torch.manual_seed(0)
    return DoraLike(keep_norm).double()


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, T, D, generator=g, dtype=torch.float64),
            torch.randn(n, T, 2, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("n", [3, D])  # n = d: the eye call's dim 0 equals the batch's
def test_a_call_that_never_reaches_the_loss_leaves_the_rule_alone(n):
    routes = exact_routes(model(), *batch(n))
    by_layer = dict(zip(routes["layer"], routes["route"]))
    assert "fallback" not in by_layer["lora_A"] and "fallback" not in by_layer["lora_B"], routes
    assert "vmap" not in " ".join(routes["route"]), routes


@pytest.mark.parametrize("n", [3, D])
def test_the_same_call_reaching_the_loss_is_still_checked(n):
    routes = exact_routes(model(keep_norm=True), *batch(n))
    by_layer = dict(zip(routes["layer"], routes["route"]))
    assert by_layer["lora_A"] in ("exact fallback", "derived (meetings)"), routes


@pytest.mark.parametrize("mode", [*MODES, "auto"])
@pytest.mark.parametrize("keep_norm", [False, True])
def test_optimizer_with_an_unused_call_matches_microbatching(mode, keep_norm):
    batches = [batch(n, seed) for seed, n in ((0, 3), (1, D), (2, 5))]  # d = n in the middle
    assert_optimizer_matches_microbatch(model(keep_norm), mse_per_sample, batches,
                                        method=mode)


@pytest.mark.parametrize("keep_norm", [False, True])
def test_unchecked_unused_calls_are_exact_too(keep_norm):
    m, (x, y) = model(keep_norm), batch(D)
    assert_agree(m, mse_per_sample, x, y, check=False)
    assert_clipping_agrees(m, mse_per_sample, x, y)
