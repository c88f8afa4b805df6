"""An ``nn.Embedding`` subclass whose forward builds its own indices (OPT's and BART's learned
positions, offset 2) takes the Embedding rule through its ``F.embedding`` lookup
(``per_sample/tied.py``), not by inheriting it: exact against micro-batching, no vmap route.
The classes copy the forward passes of Hugging Face's (tests/per_sample/test_real_models.py
runs the real ones)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import assert_agree, assert_clipping_agrees, assert_optimizer_matches_microbatch
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.per_sample.registry import find_grad_sampler


class CumsumPositions(nn.Embedding):  # OPT: positions from the attention mask, offset 2
    def __init__(self, T, d):
        super().__init__(T + 2, d)

    def forward(self, mask, position_ids=None):
        if position_ids is None:
            position_ids = (torch.cumsum(mask, dim=1) * mask - 1).long()
        return super().forward(position_ids + 2)


class ArangePositions(nn.Embedding):  # BART: arange(T) expanded to the batch, offset 2
    def __init__(self, T, d, batch=True):
        super().__init__(T + 2, d)
        self.batch = batch

    def forward(self, ids):
        n, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        return super().forward((pos.expand(n, -1) if self.batch else pos) + 2)


class ScaledEmbedding(nn.Embedding):  # BART's scaled word embedding: a scale after the lookup
    def forward(self, ids):
        return super().forward(ids) * 1.5


class WeightAgain(nn.Embedding):  # uses its weight outside the lookup too: exact fallback
    def forward(self, ids):
        return super().forward(ids) + self.weight.mean(0)


class Model(nn.Module):
    def __init__(self, pos, words=None, V=7, T=4, d=3):
        super().__init__()
        self.words = words or nn.Embedding(V, d, padding_idx=0)
        self.pos, self.head = pos, nn.Linear(d, 2)

    def forward(self, ids):
        mask = (ids != 0).long()
        h = self.words(ids)
        p = self.pos(mask) if isinstance(self.pos, CumsumPositions) else self.pos(ids)
        return self.head(torch.tanh(h + p)).sum(1)  # (n, 2)


V, T, D = 7, 4, 3
MODELS = {
    "opt_cumsum": lambda: Model(CumsumPositions(T, D)),
    "bart_arange": lambda: Model(ArangePositions(T, D)),
    "arange_without_batch": lambda: Model(ArangePositions(T, D, batch=False)),
    "scaled_words": lambda: Model(ArangePositions(T, D), ScaledEmbedding(V, D, padding_idx=1)),
    "weight_used_again": lambda: Model(WeightAgain(V, D)),
}


def problem(name, n=5, seed=0):
    torch.manual_seed(seed)
    model = MODELS[name]().double()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, T), generator=g)
    ids[0, -1] = 0  # a padding token: OPT's mask and the padding row
    return model, ids, torch.randn(n, 2, generator=g, dtype=torch.float64)


def loss_fn(out, y):
    return ((out - y) ** 2).sum(1)


@pytest.mark.parametrize("name", MODELS)
def test_embedding_subclass_is_exact_through_its_lookup(name):
    model, ids, y = problem(name)
    assert find_grad_sampler(model.pos) is None  # the parent's rule is never inherited
    assert_agree(model, loss_fn, ids, y, check="always")
    assert_clipping_agrees(model, loss_fn, ids, y)
    routes = wb.ghost_routes(model, loss_fn, ids, y)
    assert not routes["route"].str.contains("vmap").any(), routes
    lookup = routes[routes["layer"].str.startswith("F.embedding(pos.weight")]["route"].tolist()
    assert lookup == ["exact fallback" if name == "weight_used_again" else "segment sum"], routes


@pytest.mark.parametrize("name", ["opt_cumsum", "arange_without_batch"])
def test_optimizer_with_embedding_subclass_matches_microbatching(name):
    model = problem(name)[0]
    batches = [problem(name, n=4, seed=seed)[1:] for seed in (0, 1)]  # a second step too
    assert_optimizer_matches_microbatch(model, loss_fn, batches)


def test_lookup_options_whose_gradient_differs_are_not_recorded():
    class ByFrequency(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight, scale_grad_by_freq=True)

    model = Model(ByFrequency(V, D)).double()
    ids, y = torch.randint(0, V, (3, T)), torch.randn(3, 2, dtype=torch.float64)
    assert_agree(model, loss_fn, ids, y, methods=("vmap",))  # each record alone
    for method in ("einsum", "ghost", "bookkeeping"):  # the batch's backward divides by the
        # batch's counts: ghost's clipped sum 0.16 off, silently, until 2026-11-30
        with pytest.raises(wb.UnsupportedLayerError, match="scale_grad_by_freq"):
            wb.clipped_grad_sum(model, loss_fn, ids, y, 1.0, method=method)


@pytest.mark.parametrize("where", ["bag", "parameter"])
def test_scale_grad_by_freq_is_refused_wherever_the_lookup_runs(where):
    """EmbeddingBag(scale_grad_by_freq=True) and F.embedding on a bare Parameter with it:
    ghost's clipped sum 0.13 / 0.16 off, silently, until 2026-11-30."""

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.head = nn.Parameter(torch.randn(V, D)), nn.Linear(D, 2)

        def forward(self, ids):
            return self.head(F.embedding(ids, self.w, scale_grad_by_freq=True).sum(1))

    torch.manual_seed(0)
    model = (nn.Sequential(nn.EmbeddingBag(V, D, mode="sum", scale_grad_by_freq=True),
                           nn.Linear(D, 2)) if where == "bag" else Bare()).double()
    ids, y = torch.randint(0, V, (3, T)), torch.randn(3, 2, dtype=torch.float64)
    for method in ("ghost", "bookkeeping", "einsum"):
        with pytest.raises(wb.UnsupportedLayerError, match="scale_grad_by_freq"):
            wb.clipped_grad_sum(model, loss_fn, ids, y, 1.0, method=method)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=3, loss_reduction="sum")
    try:
        opt.zero_grad()
        with pytest.raises(wb.UnsupportedLayerError, match="scale_grad_by_freq"):
            loss_fn(model(ids), y).sum().backward()
            opt.step()
    finally:
        opt.detach()
