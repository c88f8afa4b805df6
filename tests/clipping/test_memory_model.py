"""The ghost memory model: each route's scratch per sample, against a measured peak.

The model says what a norm route holds per sample (``clipping.memory_model.route_scratch``).
For the Gram route that is two (T, T) Grams per group, 2·G·T² numbers. Measured here on CPU
(the profiler's peak of allocations, ``bench.peak_memory``) around the norm sampler alone,
with its activations and backprops already live: the peak must be at least the model's
Grams and at most twice them (the elementwise product A Aᵀ ⊙ B Bᵀ before its sum is one
more Gram's worth, and small terms). A model of 2T² for a grouped convolution (G = 16)
would be 16x below the measured peak.
"""

import pytest
import torch
from torch import nn

from workbench.bench.peak_memory import peak_bytes
from workbench.bench.steps import sum_of_products
from workbench.clipping.memory_model import ghost_memory, ghost_scratch_bytes, layer_sizes
from workbench.rules import conv as conv_rule
from workbench.rules.conv import conv_norm_sampler
from workbench.rules.linear import linear_norm_sampler

CPU = torch.device("cpu")
CASES = {  # name -> (layer, input shape per sample, groups G, positions T)
    "grouped conv1d": (lambda: nn.Conv1d(64, 1024, 1, groups=16, bias=False), (64, 11), 16, 11),
    "linear over T": (lambda: nn.Linear(256, 256, bias=False), (16, 256), 1, 16),
}


def case(name, n):
    make, shape, G, T = CASES[name]
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(n, *shape)
    with torch.no_grad():
        b = torch.randn(layer(x).shape)
    return layer, x, b, G, T


@pytest.mark.parametrize("name", CASES)
def test_gram_scratch_is_2GT2_and_matches_the_measured_peak(name, monkeypatch):
    # the conv norm runs in chunks (rules/conv.chunks) whose scratch is at most a quarter of
    # the call's a and b: the model is the unchunked scratch, measured with one chunk
    monkeypatch.setattr(conv_rule, "SCRATCH", 2**40)
    n = 64
    layer, x, b, G, T = case(name, n)
    table = ghost_memory(layer, sum_of_products, x[:2], b[:2])
    assert table["route"].tolist() == ["gram"]
    assert table["scratch"].item() == 2 * G * T**2
    assert table["backprops"].item() == b[0].numel() and table["bytes"].item() == 4
    sampler = conv_norm_sampler if isinstance(layer, nn.Conv1d) else linear_norm_sampler
    with torch.no_grad():
        step = lambda: sampler(layer, (x,), b)  # noqa: E731
        step()  # warm-up
        measured = peak_bytes(step, CPU, resident=0)
    model = n * table["scratch"].item() * 4
    assert model <= measured <= 2 * model, (measured, model)


def test_other_routes_and_S_sum_over_calls():
    layer, x = nn.Linear(8, 4), torch.randn(3, 8)  # one position: the norm product
    t = torch.randn(3, 4)
    row = ghost_memory(layer, sum_of_products, x, t).iloc[0]
    assert (row["route"], row["backprops"], row["scratch"]) == ("norm product", 4, 2)
    conv = nn.Conv2d(4, 4, 3)  # 2L² = 2·36² >= pd = 4·36: its own gradient, 148 numbers
    xc = torch.randn(2, 4, 8, 8)
    tc = torch.randn(2, 4, 6, 6)
    row = ghost_memory(conv, sum_of_products, xc, tc).iloc[0]
    assert (row["route"], row["scratch"]) == ("materialise", 4 * 4 * 9 + 4)
    assert ghost_scratch_bytes(conv, sum_of_products, xc, tc) == (4 * 36 + 148) * 4


def test_layer_sizes_needs_a_label_of_the_output_shape():
    with pytest.raises(ValueError, match=r"t must have the layer's output shape \(3, 4\)"):
        layer_sizes(nn.Linear(8, 4), torch.randn(3, 8), torch.randn(3, 5))
