"""Layers without a rule on batch-flattened rows: a Mixture-of-Experts block (Mixtral's shape:
a top-k router and the experts' weights as 3-D parameters gathered per token, Hugging Face's
"batched_mm" experts) runs both on (n·T, d) tokens. The flattened-row proof follows the
router's ``topk``, the experts' ``repeat_interleave`` over dim 0, the weights gathered by a
tagged index, the batched products and the ``view`` back to (tokens, k, d); each layer's
outputs proved row by row from its inputs, per-layer vmap maps each sample's T rows
(``flat_rows.rule_less_rows``) instead of the whole-model fallback. A rule-less layer that
reorders the flattened rows by an op the proof does not follow keeps the fallback. Exact
against micro-batching in float64, every method and optimizer mode, n ≠ T and n = T, with
and without the self-check."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import (
    assert_agree,
    assert_clipped_sums_agree,
    assert_optimizer_matches_microbatch,
)
from workbench.dpsgd import MODES

T, D, E, K, C = 5, 6, 4, 2, 0.5


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, D) / D ** 0.5)

    def forward(self, h):  # (tokens, D)
        logits = F.linear(h, self.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, index


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, 2 * D, D) / D ** 0.5)
        self.down = nn.Parameter(torch.randn(E, D, 2 * D) / D ** 0.5)

    def forward(self, h, index, weights):  # (tokens, D), (tokens, K), (tokens, K)
        tokens = h.shape[0]
        picked = h.repeat_interleave(K, dim=0)  # (tokens·K, D)
        ids = index.reshape(-1)
        up = torch.bmm(self.up[ids], picked.unsqueeze(-1)).squeeze(-1)
        out = torch.bmm(self.down[ids], F.silu(up).unsqueeze(-1)).squeeze(-1)
        out = out * weights.reshape(-1).unsqueeze(-1)
        return out.view(tokens, K, D).sum(dim=1)


class Mixer(nn.Module):
    """Rule-less, and reorders each sample's flattened rows by an op the proof does not follow
    (``flip``): its outputs carry no proof of their rows, so it keeps the exact fallback."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, h):
        return h.view(-1, T, D).flip(1).reshape(-1, D) * self.scale


class MoE(nn.Module):
    def __init__(self, mix=False):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, D), nn.Linear(D, 11)
        self.gate, self.experts = Router(), Experts()
        self.mixer = Mixer() if mix else None

    def forward(self, ids):  # (n, T)
        h = self.embed(ids)
        n = h.shape[0]
        flat = h.view(-1, D)
        _, weights, index = self.gate(flat)
        flat = flat + self.experts(flat, index, weights)
        if self.mixer is not None:
            flat = flat + self.mixer(flat)
        return self.head(flat.reshape(n, T, D))


def losses(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (n, T), generator=g), torch.randint(0, 11, (n, T), generator=g)


def model_of(mix=False):
    torch.manual_seed(0)
    return MoE(mix).double()


def test_router_and_experts_take_per_layer_vmap_on_the_rows():
    for n in (3, T):
        x, y = batch(n)
        routes = wb.ghost_routes(model_of(), losses, x, y)
        moe = routes[routes["layer"].isin(["gate", "experts"])]
        assert len(moe) == 2 and moe["route"].str.contains("vmap").all(), routes
        assert not routes["route"].str.contains("fallback").any(), routes


def test_a_rule_less_layer_on_rows_not_proved_keeps_the_fallback():
    x, y = batch(3)
    routes = wb.ghost_routes(model_of(mix=True), losses, x, y)
    assert routes.set_index("layer").loc["mixer", "route"] == "exact fallback", routes


@pytest.mark.parametrize("mix", [False, True])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("n", [3, T])
def test_functional_api_is_exact(mix, check, n):
    model, (x, y) = model_of(mix), batch(n, seed=n)
    assert_agree(model, losses, x, y, methods=("einsum",), check=check)
    assert_clipped_sums_agree(model, losses, x, y, C, check=check)


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_dp_optimizer_steps_are_exact(mode):
    batches = [batch(n, seed) for seed, n in ((0, 3), (1, T), (2, 4), (3, T))]
    assert_optimizer_matches_microbatch(model_of(), losses, batches, max_grad_norm=C,
                                        method=mode)
