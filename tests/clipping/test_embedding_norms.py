"""The embedding's norm sampler: exact against dense per-sample gradients, and no O(V) work."""

import torch
from torch import nn

from workbench.rules.embedding import embedding_norm_sampler, repeated


def dense_norms(x, b, V, padding_idx=None):
    """||g_i||² from the (n, V, d) per-sample gradients, built one sample at a time."""
    n, T, d = b.shape
    g = torch.zeros(n, V, d, dtype=b.dtype)
    for i in range(n):
        keep = x[i] != padding_idx if padding_idx is not None else slice(None)
        g[i].index_add_(0, x[i][keep], b[i][keep])
    return g.pow(2).sum((1, 2))


def test_exact_in_float64_with_repeats_and_padding():
    g = torch.Generator().manual_seed(0)
    for V, padding_idx in ((7, None), (7, 3), (1000, None)):  # many repeats, few repeats
        layer = nn.Embedding(V, 5, padding_idx=padding_idx).double()
        x = torch.randint(0, V, (6, 11), generator=g)
        b = torch.randn(6, 11, 5, generator=g, dtype=torch.float64)
        got = embedding_norm_sampler(layer, (x,), b)
        torch.testing.assert_close(got, dense_norms(x, b, V, padding_idx), rtol=1e-12, atol=0)


def test_repeated_marks_exactly_the_tokens_whose_index_repeats():
    rep, run = repeated(torch.tensor([[5, 1, 5, 2], [0, 0, 0, 9]]))
    assert rep.tolist() == [[True, False, True, False], [True, True, True, False]]
    assert run.tolist() == [[2, 0, 2, 1], [0, 0, 0, 1]]


def test_no_work_of_size_V():
    """A vocabulary of 2^40 rows on the meta device: anything of size V could not be made."""
    layer = nn.Embedding(2**40, 8, device="meta")
    x = torch.randint(0, 2**40, (4, 16))
    x[:, 1] = x[:, 0]  # a repeat in every sample
    b = torch.randn(4, 16, 8)
    norms = embedding_norm_sampler(layer, (x,), b)
    assert norms.shape == (4,) and torch.isfinite(norms).all()


def test_chunks_of_samples_change_nothing():
    """The norm runs NORM_CHUNKS chunks of samples: every n, uneven chunks too."""
    g = torch.Generator().manual_seed(1)
    layer = nn.Embedding(5, 3, padding_idx=0).double()
    for n in (1, 3, 5, 9):
        x = torch.randint(0, 5, (n, 7), generator=g)
        b = torch.randn(n, 7, 3, generator=g, dtype=torch.float64)
        got = embedding_norm_sampler(layer, (x,), b)
        assert got.shape == (n,)
        torch.testing.assert_close(got, dense_norms(x, b, 5, 0), rtol=1e-12, atol=0)
