"""A parameter broadcast into the batch inside its rule-less owner (timm's ViT: the model owns
cls_token and pos_embed) takes the broadcast rule (``rules/broadcast.py``), not vmap on the
owner; mixed uses stay on the owner's vmap; every case exact against micro-batching."""

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

T, D = 3, 4


class ViT(nn.Module):  # timm's VisionTransformer._pos_embed: the model owns the tokens
    def __init__(self, use="vit"):
        super().__init__()
        self.use = use
        self.patch, self.head = nn.Linear(2, D), nn.Linear(D, 2)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        shape = (T + 1, D) if use == "no_leading_one" else (1, T + 1, D)
        self.pos_embed = nn.Parameter(torch.randn(*shape))

    def forward(self, x):  # (n, T, 2)
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        if self.use == "subtract":  # not an add: the owner's vmap
            h = h - self.pos_embed
        elif self.use == "cast":  # p.to(its own dtype), p.contiguous(): p itself, no use
            h = h + self.pos_embed.to(h.dtype).contiguous()
        else:
            h = self.pos_embed + h if self.use == "radd" else h + self.pos_embed
        if self.use == "mixed":  # pos_embed also used otherwise: the owner's vmap for it
            h = h * self.pos_embed.sum()
        return self.head(torch.tanh(h)).sum(1)  # (n, 2)


class Embeddings(nn.Module):  # Hugging Face's ViTEmbeddings: a rule-less part owns them
    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(2, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.position_embeddings = nn.Parameter(torch.randn(1, T + 1, D))

    def forward(self, x):
        h = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), self.patch(x)), dim=1)
        return h + self.position_embeddings


class OutsideBias(nn.Module):  # a Linear's bias also added outside it: shared, cross terms
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(2, D), nn.Linear(D, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x) + self.fc.bias)).sum(1)


MODELS = {
    "vit": (lambda: ViT(), {"cls_token", "pos_embed"}),
    "radd": (lambda: ViT("radd"), {"cls_token", "pos_embed"}),
    "no_leading_one": (lambda: ViT("no_leading_one"), {"cls_token", "pos_embed"}),
    "subtract": (lambda: ViT("subtract"), {"cls_token"}),
    "cast": (lambda: ViT("cast"), {"cls_token", "pos_embed"}),
    "mixed": (lambda: ViT("mixed"), {"cls_token"}),
    "hf_embeddings": (lambda: nn.Sequential(Embeddings(), nn.Tanh(), nn.Flatten(1),
                                            nn.Linear((T + 1) * D, 2)),
                      {"0.cls_token", "0.position_embeddings"}),
    "outside_bias": (OutsideBias, {"fc.bias"}),
}


def problem(name, n=5, seed=0):
    torch.manual_seed(seed)
    return (MODELS[name][0]().double(), *random_batch((n, T, 2), (n, 2), seed))


@pytest.mark.parametrize("name", MODELS)
def test_broadcast_parameters_are_exact_and_leave_vmap(name):
    routes = exact_routes(*problem(name))
    broadcast = set(routes[routes["type"] == "BroadcastParameter"]["layer"])
    want = {f"broadcast({p}{'' if name == 'outside_bias' else ' in its owner'})"
            for p in MODELS[name][1]}
    assert broadcast == want, routes
    vmap = routes[routes["route"].str.contains("vmap")]
    assert vmap.empty == (name not in ("subtract", "mixed")), routes


@pytest.mark.parametrize("name", ["vit", "mixed", "hf_embeddings", "cast"])
@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_optimizer_with_broadcast_parameters_matches_microbatching(name, mode):
    model, _, _ = problem(name)
    sizes = ((0, 4), (1, T + 1))  # n = T + 1: a layout the shapes cannot tell apart
    batches = [problem(name, n=n, seed=seed)[1:] for seed, n in sizes]
    assert_optimizer_matches_microbatch(model, mse_per_sample, batches, method=mode)
