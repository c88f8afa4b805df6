"""Convolution norms and streamed per-sample gradients (rules/conv.py, float64, against
micro-batching): the shifted-Gram route, the chunked routes at every chunk size, and the
optimizer's streaming of convolutions in every method, with weight gradients skipped or not."""

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import assert_optimizer_matches_microbatch
from tests.per_sample.test_conv import CONFIGS, CONV, SIZE
from workbench.dpsgd import MODES, DPOptimizer
from workbench.rules import conv as conv_rule
from workbench.rules import conv_gram

VARIANTS = [(dims, name) for dims in (1, 2, 3) for name in CONFIGS]


def layer_and_batch(dims, name, n=5, c_in=4, c_out=6, seed=0):
    torch.manual_seed(seed)
    config = dict(CONFIGS[name])
    if name == "depthwise":
        c_out = c_in
    layer = CONV[dims](c_in, c_out, **config).double()
    a = torch.randn(n, c_in, *SIZE[dims], dtype=torch.float64)
    b = torch.randn_like(layer(a))
    return layer, a, b


def micro_squares(layer, a, b):
    """||∂<o_i, b_i>/∂θ||² (n,), one sample at a time by autograd."""
    out = []
    for i in range(a.shape[0]):
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = torch.autograd.grad((layer(a[i:i + 1]) * b[i:i + 1]).sum(), params)
        out.append(sum(g.pow(2).sum() for g in grads))
    return torch.stack(out)


def micro_grads(layer, a, b):
    """∂<o_i, b_i>/∂W (n, *W.shape), one sample at a time by autograd."""
    return torch.stack([torch.autograd.grad((layer(a[i:i + 1]) * b[i:i + 1]).sum(),
                                            layer.weight)[0] for i in range(a.shape[0])])


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dims,name", VARIANTS)
def test_the_shifted_gram_is_the_unfolded_gram(dims, name, strided):
    layer, a, _ = layer_and_batch(dims, name)
    want = conv_rule.unfolded_gram(layer, a)
    torch.testing.assert_close(conv_rule.shifted_gram(layer, a, strided=strided), want,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scratch,gram_route", [  # whole call, one sample, uneven chunks
    (None, "shifted"), (1, "unfolded"), (700, "shifted"), (None, "strided"), (700, "strided"),
    (None, "auto"), (700, "auto")])
@pytest.mark.parametrize("dims,name", VARIANTS)
def test_conv_norms_match_micro_batching(dims, name, scratch, gram_route, monkeypatch):
    monkeypatch.setattr(conv_rule, "SCRATCH", scratch)
    monkeypatch.setattr(conv_rule, "GRAM_ROUTE", gram_route)
    layer, a, b = layer_and_batch(dims, name)
    want = micro_squares(layer, a, b)
    L, p, d = conv_rule.conv_dims(layer, a)
    for force_gram in (False, True):  # both sides of the rule, whatever L is
        monkeypatch.setattr(conv_gram, "gram_is_cheaper", lambda *_, g=force_gram: g)
        got = conv_rule.conv_norm_sampler(layer, (a,), b)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("route", ["unfold", "grouped", "depthwise"])
@pytest.mark.parametrize("dims,name", VARIANTS)
def test_chunked_per_sample_gradients_match_micro_batching(dims, name, route, monkeypatch):
    monkeypatch.setattr(conv_rule, "SCRATCH", 700)  # uneven chunks of a few samples
    monkeypatch.setattr(conv_rule, "ROUTE", route)
    layer, a, b = layer_and_batch(dims, name)
    got = conv_rule.conv_grad_sampler(layer, (a,), b)["weight"]
    torch.testing.assert_close(got, micro_grads(layer, a, b), rtol=1e-10, atol=1e-12)


def test_gram_way_picks_the_cheapest_modelled_way(monkeypatch):
    """``gram_costs``' order: the shifted loop for many channels on a mid-sized map (the
    CIFAR-10 CNN's chunks of 32), the unfolded input for few channels or a stride of 2, the
    strided view on the base ResNets' smallest maps, where the op count decides."""
    conv = nn.Conv2d(64, 64, 3, padding=1)
    assert conv_rule.gram_way(conv, torch.zeros(32, 64, 8, 8)) == "shifted"
    assert conv_rule.gram_way(nn.Conv2d(8, 8, 3, padding=1), torch.zeros(32, 8, 8, 8)) == \
        "unfolded"
    assert conv_rule.gram_way(nn.Conv2d(16, 16, 3, stride=2, padding=1),
                              torch.zeros(16, 16, 8, 8)) == "unfolded"
    assert conv_rule.gram_way(conv, torch.zeros(16, 64, 2, 2)) == "strided"
    for a in (torch.zeros(32, 64, 8, 8), torch.zeros(16, 8, 16, 16), torch.zeros(16, 64, 2, 2)):
        costs = conv_gram.gram_costs(conv if a.shape[1] == 64 else nn.Conv2d(8, 8, 3), a)
        assert set(costs) == {"unfolded", "shifted", "strided"} and min(costs.values()) > 0
    monkeypatch.setattr(conv_rule, "GRAM_ROUTE", "unfolded")  # the setting, through conv
    assert conv_rule.gram_way(conv, torch.zeros(32, 64, 8, 8)) == "unfolded"
    assert conv_gram.GRAM_ROUTE == "unfolded"


def test_conv_settings_write_through_to_their_homes_and_are_restored():
    """``conv.ROUTE`` / ``SCRATCH`` / ``GRAM_ROUTE`` (the single-file spelling) set the module
    that reads them, and monkeypatch's undo restores them (not a stale copy in ``conv``)."""
    from workbench.rules import conv_chunks, conv_grads
    homes = {"ROUTE": conv_grads, "SCRATCH": conv_chunks, "GRAM_ROUTE": conv_gram}
    before = {name: getattr(home, name) for name, home in homes.items()}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in [("ROUTE", "grouped"), ("SCRATCH", 7), ("GRAM_ROUTE", "shifted")]:
            mp.setattr(conv_rule, name, value)
            assert getattr(homes[name], name) == value == getattr(conv_rule, name)
    assert {name: getattr(home, name) for name, home in homes.items()} == before
    assert all(getattr(conv_rule, name) == value for name, value in before.items())


def test_chunks_cover_the_batch_once():
    for n, per, budget in [(5, 3, 7), (5, 100, 7), (64, 10, 640), (0, 1, 1)]:
        parts = conv_rule.chunks(n, per, budget)
        assert [i for s in parts for i in range(n)[s]] == list(range(n))
        assert all(len(range(n)[s]) * per <= max(budget, per) for s in parts)


class WideFirst(nn.Module):
    """A CNN whose first convolutions see a wide image with few channels (their g_i are
    smaller than their a and b: streamed) and whose last one does not."""

    def __init__(self, dims=2):
        super().__init__()
        self.c1 = CONV[dims](2, 3, 3, padding=1)
        self.c2 = CONV[dims](3, 4, 2, stride=2, dilation=1, groups=1)
        self.c3 = CONV[dims](4, 16, 5, padding="same", bias=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        return self.head(self.c3(h).flatten(2).mean(2))


SHAPES = {1: (6, 2, 24), 2: (6, 2, 10, 12), 3: (6, 2, 6, 6, 8)}
CE = nn.CrossEntropyLoss(reduction="none")


def batches(dims, sizes=(6, 4)):
    g = torch.Generator().manual_seed(dims)
    return [(torch.randn(n, *SHAPES[dims][1:], generator=g, dtype=torch.float64),
             torch.randint(0, 3, (n,), generator=g)) for n in sizes]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_the_optimizer_streams_wide_convolutions_exactly(dims, mode):
    torch.manual_seed(0)
    model = WideFirst(dims).double()
    assert_optimizer_matches_microbatch(model, CE, batches(dims), method=mode)


@pytest.mark.parametrize("skip", [False, True])
def test_streamed_convolutions_free_their_inputs_in_backward(skip):
    torch.manual_seed(0)
    model = WideFirst(2).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=1.0, method="bookkeeping",
                      loss_reduction="sum")
    opt.skip_weight_grads = skip
    try:
        for x, y in batches(2, (6, 6, 5)):  # steps 2 and 3: the weight gradients skipped
            want = wb.clipped_grad_sum(model, CE, x, y, 0.5, method="microbatch")
            opt.zero_grad()
            CE(model(x), y).sum().backward()
            streamed = {c.path for c in opt.recorder.layer_rec.all_calls()
                        if c.sampled is not None}
            assert streamed == {"c1", "c2"}  # c3's g_i (16·4·25) outweigh its a and b
            opt.step()
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()


class PerSampleLoop(nn.Module):
    """A convolution called on each unbatched (C, H, W) sample, C = n = 4: dim 0 looks like
    the batch; the call is not streamed (``smaller_materialised`` refuses an input without a
    batch dim) and the whole-model fallback gives the exact clipped sum."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(4, 2, 3, padding=1), nn.Linear(2, 3)

    def forward(self, x):  # (n, 4, 6, 6)
        h = torch.stack([self.conv(x[i]) for i in range(x.shape[0])])  # (n, 2, 6, 6)
        return self.head(h.mean((2, 3)))


def test_an_unbatched_convolution_is_not_streamed():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=g)
    assert_optimizer_matches_microbatch(PerSampleLoop().double(), CE, [(x, y)],
                                        method="bookkeeping")
