"""The embedding's chunked clipped sum: Σ_i c_i g_i exact without a (n, T, d) copy of c ⊙ b."""

import pytest
import torch
from torch import nn

from workbench.clipping.engine import _weighted, reweighted_weight_grads
from workbench.per_sample.hooks import LayerCall
from workbench.rules.embedding import CHUNK_SAMPLES, embedding_reweighted


def dense_clipped_sum(x, b, c, V, padding_idx=None):
    """Σ_i c_i g_i from per-sample gradients built one sample at a time (float64)."""
    total = torch.zeros(V, b.shape[-1], dtype=b.dtype)
    for i in range(len(x)):
        g = torch.zeros_like(total).index_add_(0, x[i].reshape(-1), b[i].reshape(-1, b.shape[-1]))
        if padding_idx is not None:
            g[padding_idx] = 0
        total += c[i] * g
    return total


def call_of(x, b):
    return LayerCall(args=(x,), kwargs={}, edges=[], outputs=[], backprops=b)


@pytest.mark.parametrize("n", [1, 5, CHUNK_SAMPLES + 3, 3 * CHUNK_SAMPLES])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_exact_in_float64(n, padding_idx):
    g = torch.Generator().manual_seed(n)
    layer = nn.Embedding(6, 4, padding_idx=padding_idx).double()
    x = torch.randint(0, 6, (n, 3, 2), generator=g)  # (n, ...) any index shape
    b = torch.randn(n, 3, 2, 4, generator=g, dtype=torch.float64)
    c = torch.rand(n, generator=g, dtype=torch.float64)
    before = b.clone()
    got = embedding_reweighted(layer, call_of(x, b), c, [layer.weight])[id(layer.weight)]
    torch.testing.assert_close(got, dense_clipped_sum(x, b, c, 6, padding_idx), rtol=1e-12,
                               atol=1e-14)
    assert torch.equal(b, before)  # b is read, never written (calls may share it)


def test_non_finite_record_is_masked_not_multiplied():
    """A record whose b holds NaN gets weight 0 (ok False): its rows add 0, not 0 · NaN."""
    layer = nn.Embedding(5, 2).double()
    x = torch.randint(0, 5, (CHUNK_SAMPLES + 1, 4), generator=torch.Generator().manual_seed(0))
    b = torch.randn(len(x), 4, 2, dtype=torch.float64)
    b[3, 1, 0] = float("nan")
    ok = torch.ones(len(x), dtype=torch.bool)
    ok[3] = False
    c = torch.where(ok, 0.5, 0.0).double()
    got = embedding_reweighted(layer, call_of(x, b), c, [layer.weight], ok)[id(layer.weight)]
    b_ok = torch.where(ok.view(-1, 1, 1), b, 0.0)
    torch.testing.assert_close(got, dense_clipped_sum(x, b_ok, c, 5), rtol=1e-12, atol=1e-14)


def test_engine_takes_the_chunked_rule_and_agrees_with_the_one_copy_rule():
    """reweighted_weight_grads uses the rule's own weighting; the old path (c ⊙ b, then one
    index_add) gives the same sum."""
    from workbench.rules.embedding import embedding_weight_grads
    layer = nn.Embedding(7, 3).double()
    g = torch.Generator().manual_seed(4)
    x, b = torch.randint(0, 7, (40, 5), generator=g), torch.randn(40, 5, 3, generator=g,
                                                                 dtype=torch.float64)
    c = torch.rand(40, generator=g, dtype=torch.float64)
    got = reweighted_weight_grads(layer, call_of(x, b), c, [layer.weight])[id(layer.weight)]
    one = embedding_weight_grads(layer, call_of(x, b), _weighted(b, c), [layer.weight])
    torch.testing.assert_close(got, one[id(layer.weight)], rtol=1e-12, atol=1e-14)


def test_options_with_another_gradient_are_left_to_the_general_path():
    layer = nn.Embedding(4, 2, scale_grad_by_freq=True).double()
    x, b = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, 2, dtype=torch.float64)
    assert embedding_reweighted(layer, call_of(x, b), torch.ones(2), [layer.weight]) is None
