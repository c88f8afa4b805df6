"""The per-step fixed costs the optimizer saves must never change what it computes: the mode
"auto" chose is remembered per batch layout (``optimizer.mode_key``) and chosen again when
the layout changes; the weight-gradient skipper taps only outputs the graph would not reach."""

import pytest
import torch
from torch import nn

from workbench.clipping import auto
from workbench.clipping.auto import choose_mode
from workbench.clipping.ghost import record
from workbench.dpsgd import DPOptimizer
from workbench.dpsgd.optimizer import mode_key

CE = nn.CrossEntropyLoss(reduction="none")


def embedding_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 4), nn.Flatten(), nn.Linear(20, 3)).double()


def batch(n, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (n, T), generator=g), torch.randint(0, 3, (n,), generator=g)


def key(model, n=6, T=5, seed=0):
    return mode_key(record(model, CE, *batch(n, T, seed), retain_graph=False))


def test_the_key_is_the_layout_not_the_values():
    model = embedding_model()
    assert key(model) == key(model, seed=1)


def test_the_key_changes_with_n_shapes_layers_and_requires_grad():
    model = embedding_model()
    first = key(model)
    assert key(model, n=7) != first  # n: the cost model reads it
    model[2] = nn.Linear(28, 3).double()
    assert key(model, T=7) != first  # a new input shape, and a new layer
    model = embedding_model()
    first = key(model)
    model[2] = nn.Linear(20, 3).double()  # same shapes, a layer replaced
    assert key(model) != first
    model[2].bias.requires_grad_(False)  # a parameter frozen
    frozen = key(model)
    assert frozen != first
    model[2].bias.requires_grad_(True)  # and unfrozen
    assert key(model) != frozen


@pytest.mark.parametrize("sizes", [(6, 2000, 6, 2000), (2000, 6, 2001, 5)])
def test_the_optimizer_chooses_again_when_the_layout_changes(sizes):
    # auto's Eq. (1) grows as 3 x 8 bytes x n x 263 per-sample numbers (200 + 63), Eq. (2) starts at
    # 2 FIXED = 2 ms and grows slower: einsum at n = 6, book-keeping at n = 2000
    assert 3 * 8 * 6 * 263 / auto.BANDWIDTH < 2 * auto.FIXED < 3 * 8 * 2000 * 263 / auto.BANDWIDTH
    model = embedding_model()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=8.0)
    for n in sizes:
        x, y = batch(n, seed=n)
        expected = choose_mode(record(model, CE, x, y, retain_graph=False))[0]
        opt.zero_grad()
        CE(model(x), y).mean().backward()
        opt.step()
        assert opt.last["mode"] == expected == ("bookkeeping" if n >= 1000 else "einsum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_privatise_is_noised_mean_bit_for_bit(dtype):
    from workbench.dpsgd.privatise import noised_mean
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)).to(dtype)
    model[1].bias.requires_grad_(False)  # frozen: no noise, no draw
    params = [p for p in model.parameters() if p.requires_grad]
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.1), model, noise_multiplier=1.3,
                      max_grad_norm=0.7, expected_batch_size=6.0,
                      generator=torch.Generator().manual_seed(3))
    sums = {id(p): torch.randn(p.shape, dtype=torch.float64) for p in params[:2]}  # one left
    opt._sums = dict(sums)
    opt.privatise()
    g = torch.Generator().manual_seed(3)
    for p in params:
        expected = noised_mean(sums.get(id(p)), p, opt.noise_std(), 6.0, g)
        assert p.grad.dtype == dtype and torch.equal(p.grad, expected)
    signal = sum(float(s.to(dtype).double().norm()) ** 2 for s in sums.values()) ** 0.5 / 6.0
    assert opt.last["signal"] == pytest.approx(signal, rel=1e-6)
