"""A parameter multiplied into the batch, a layer scale (timm's ConvNeXt block
``x.mul(gamma.reshape(1, -1, 1, 1))``, Hugging Face's ``hidden * lambda1``), takes the
broadcast rule's product form (``rules/broadcast.py``) instead of vmap on its rule-less owner;
the owner's other layers keep their rules; mixed and in-place uses stay on the owner's vmap;
every case exact against micro-batching."""

import pytest
import torch
from torch import nn

from tests.helpers import (
    assert_optimizer_matches_microbatch,
    exact_routes,
    mse_per_sample,
    random_batch,
)
from workbench.dpsgd import MODES

C, S = 3, 4  # channels, spatial size


class Block(nn.Module):  # timm's ConvNeXtBlock: conv, then a layer scale, then a residual
    def __init__(self, use="convnext"):
        super().__init__()
        self.use = use
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.gamma = nn.Parameter(torch.randn(C))

    def forward(self, x):  # (n, C, S, S)
        h = torch.tanh(self.conv(x))
        if self.use == "convnext":
            h = h.mul(self.gamma.reshape(1, -1, 1, 1))
        elif self.use == "view_rmul":
            h = self.gamma.view(1, C, 1, 1) * h
        elif self.use == "mixed":  # gamma also used otherwise: the owner's vmap keeps it
            h = h.mul(self.gamma.reshape(1, -1, 1, 1)) + self.gamma.sum()
        elif self.use == "view_twice":  # the view used twice: two calls of the scale
            g = self.gamma.reshape(1, -1, 1, 1)
            h = h * g * g
        elif self.use == "inplace":  # x overwritten: not recorded, the owner's vmap
            h = h.clone().mul_(self.gamma.reshape(1, -1, 1, 1))
        return x + h


class LayerScale(nn.Module):  # Hugging Face's Dinov2LayerScale / timm's LayerScale
    def __init__(self):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.randn(S))

    def forward(self, h):
        return h * self.lambda1


class Outside(nn.Module):  # the model owns the scale, a Linear beside it
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(S, S)
        self.scale = nn.Parameter(torch.randn(1, 1, S))

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale


class Dinov2Like(nn.Module):  # a leaf layer scale beside a parameter used outside layers
    def __init__(self):
        super().__init__()
        self.conv, self.scale = nn.Conv2d(C, C, 1), LayerScale()
        self.pos = nn.Parameter(torch.randn(1, C, S, S))

    def forward(self, x):  # the scale's calls sit inside its tapped forward (skip_weights.py)
        return x + self.pos + self.scale(torch.tanh(self.conv(x)))


def head():
    return [nn.Flatten(1), nn.Linear(C * S * S, 2)]


MODELS = {  # name: (model, scale layers taking the rule; vmap remains?)
    "convnext": (lambda: nn.Sequential(Block(), *head()), 1, False),
    "view_rmul": (lambda: nn.Sequential(Block("view_rmul"), *head()), 1, False),
    "mixed": (lambda: nn.Sequential(Block("mixed"), *head()), 0, True),
    "view_twice": (lambda: nn.Sequential(Block("view_twice"), *head()), 1, False),
    "inplace": (lambda: nn.Sequential(Block("inplace"), *head()), 0, True),
    "hf_layer_scale": (lambda: nn.Sequential(nn.Conv2d(C, C, 1), LayerScale(), nn.Tanh(),
                                             *head()), 1, False),
    "outside": (lambda: nn.Sequential(Outside(), nn.Tanh(), *head()), 1, False),
    "dinov2": (lambda: nn.Sequential(Dinov2Like(), nn.Tanh(), *head()), 1, False),
}


def problem(name, n=5, seed=0):
    torch.manual_seed(seed)
    return (MODELS[name][0]().double(), *random_batch((n, C, S, S), (n, 2), seed))


@pytest.mark.parametrize("name", MODELS)
def test_layer_scales_are_exact_and_leave_vmap(name):
    routes = exact_routes(*problem(name))
    scales = routes[routes["type"] == "BroadcastProduct"]
    assert scales["layer"].nunique() == MODELS[name][1], routes  # one row per call
    vmap = routes[routes["route"].str.contains("vmap")]
    assert (not vmap.empty) == MODELS[name][2], routes
    if name == "convnext":  # the block's conv keeps its own rule
        assert "0.conv" in set(routes["layer"]), routes


@pytest.mark.parametrize("name", ["convnext", "mixed", "outside", "dinov2"])
@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_optimizer_with_layer_scales_matches_microbatching(name, mode):
    model, _, _ = problem(name)
    sizes = ((0, 4), (1, C))  # n = C: a layout the shapes cannot tell apart
    batches = [problem(name, n=n, seed=seed)[1:] for seed, n in sizes]
    assert_optimizer_matches_microbatch(model, mse_per_sample, batches, method=mode)
