"""A rule-less layer whose output is not a Tensor or a tuple of Tensors (Hugging Face's
Data2Vec-Vision, PVT and Hiera embeddings return ``embeddings, (height, width)``) has no
recorded call (``recording.odd_outputs``): the parameters it hands over to a broadcast call
(a cls token ``cat``-ed to the batch, a position table added to it) keep their rule, any other
takes the exact fallback; never a refusal naming fused kernels, never zeros. torch.nn's fused
layers are still refused with ``fix_model``'s advice (``tests/per_sample/test_engine.py``)."""

import pytest
import torch
from torch import nn

from tests.helpers import (
    assert_optimizer_matches_microbatch,
    exact_routes,
    mse_per_sample,
    random_batch,
)

T, D = 3, 4


class Embeddings(nn.Module):  # Data2VecVisionEmbeddings / PvtPatchEmbeddings
    def __init__(self, use="handed_over"):
        super().__init__()
        self.use = use
        self.patch = nn.Linear(2, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.position_embeddings = nn.Parameter(torch.randn(1, T + 1, D))
        if use == "matmul":
            self.mix = nn.Parameter(torch.randn(D, D))

    def forward(self, x):  # (n, T, 2) -> ((n, T + 1, D), (T, 1))
        h = self.patch(x)
        if self.use == "matmul":  # a use no broadcast rule takes: the exact fallback
            h = h @ self.mix
        h = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), h), dim=1)
        return h + self.position_embeddings, (T, 1)


class Model(nn.Module):
    def __init__(self, use="handed_over"):
        super().__init__()
        self.embeddings, self.head = Embeddings(use), nn.Linear(D, 2)

    def forward(self, x):
        h, (t, _) = self.embeddings(x)
        return self.head(torch.tanh(h)).sum(1) / t  # (n, 2)


def problem(use, n=5, seed=0):
    torch.manual_seed(seed)
    return (Model(use).double(), *random_batch((n, T, 2), (n, 2), seed))


@pytest.mark.parametrize("use", ["handed_over", "matmul"])
def test_a_layer_returning_a_tuple_with_an_int_is_exact(use):
    routes = exact_routes(*problem(use))
    broadcast = set(routes[routes["type"] == "BroadcastParameter"]["layer"])
    assert broadcast == {"broadcast(embeddings.cls_token in its owner)",
                         "broadcast(embeddings.position_embeddings in its owner)"}, routes
    fallback = routes[routes["route"].str.contains("fallback")]
    assert fallback.empty == (use == "handed_over"), routes
    assert not routes["route"].str.contains("vmap on").any(), routes


@pytest.mark.parametrize("use", ["handed_over", "matmul"])
@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])  # microbatch, vmap: the fallback
def test_optimizer_with_a_layer_returning_a_tuple_with_an_int(use, mode):
    model, _, _ = problem(use)
    sizes = ((0, 4), (1, T + 1))  # n = T + 1: a layout the shapes cannot tell apart
    batches = [problem(use, n=n, seed=seed)[1:] for seed, n in sizes]
    assert_optimizer_matches_microbatch(model, mse_per_sample, batches, method=mode)
