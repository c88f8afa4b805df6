"""A weight used in several calls, normed by Grams with cross terms (``clipping/cross.py``):
every pairing of the factor kinds (dense Linear, input-first Linear, Embedding indices),
padding, biases, float32 overflow, a call that cannot be factored, user-level clipping, the
optimizer, and the route table, each against micro-batching in float64."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import workbench as wb
from tests.helpers import assert_clipping_agrees, assert_optimizer_matches_microbatch
from workbench.clipping import cross
from workbench.clipping.ghost import record, squared_norms


def sequence_ce(out, y):
    """Per-sample cross-entropy summed over positions: out (n, T, V), y (n, T)."""
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)


class TiedHead(nn.Module):
    """A token embedding reused as the head, ``F.linear(h, wte.weight)`` (nanoGPT, GPT-2)."""

    def __init__(self, V=40, d=6, padding_idx=None, hidden_bias=True):
        super().__init__()
        self.wte = nn.Embedding(V, d, padding_idx=padding_idx)
        self.mix = nn.Linear(d, d, bias=hidden_bias)

    def forward(self, x):
        return F.linear(torch.tanh(self.mix(self.wte(x))), self.wte.weight)


class TiedModuleHead(nn.Module):
    """The head an ``nn.Linear`` whose weight *is* the embedding's (Hugging Face's tying)."""

    def __init__(self, V=40, d=6):
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x):
        return self.head(torch.tanh(self.wte(x)))


class Conv1D(nn.Module):
    """GPT-2's input-first Linear, o = a W + c with W (d, p)."""

    def __init__(self, d, p):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, p) * 0.3)
        self.bias = nn.Parameter(torch.randn(p) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


class SharedDepth(nn.Module):
    """ALBERT: one layer (weight and bias) called at every depth, here an input-first Linear
    and an ``nn.Linear`` each called three times, on sequences."""

    def __init__(self, d=16, calls=3):
        super().__init__()
        self.up, self.lin, self.calls = Conv1D(d, d), nn.Linear(d, d), calls
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for _ in range(self.calls):
            x = torch.tanh(self.lin(torch.tanh(self.up(x))))
        return self.head(x).sum(1)


class EmbeddingTwice(nn.Module):
    """One Embedding called on two index tensors (both one-hot factors)."""

    def __init__(self, V=30, d=8):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x) + self.emb(x.flip(1)))).sum(1)


def tokens(n=6, T=5, V=40, seed=0, pad=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (n, T), generator=g)
    x[0, 1] = x[0, 3]  # a repeated token inside one sample
    if pad is not None:
        x[1, :2] = pad
    return x, torch.randint(0, V, (n, T), generator=g)


def routes_of(model, loss_fn, x, y):
    table = wb.ghost_routes(model, loss_fn, x, y)
    return dict(zip(table["layer"] + "#" + table["call"].astype(str), table["route"]))


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_functional_head(padding_idx):
    torch.manual_seed(0)
    model = TiedHead(padding_idx=padding_idx).double()
    x, y = tokens(pad=padding_idx)
    routes = routes_of(model, sequence_ce, x, y)
    assert routes["wte#0"] == routes["F.linear(wte.weight)#0"] == "gram (shared)", routes
    assert_clipping_agrees(model, sequence_ce, x, y)


def test_tied_module_head():
    torch.manual_seed(0)
    model = TiedModuleHead().double()
    x, y = tokens()
    assert routes_of(model, sequence_ce, x, y)["head#0"] == "gram (shared)"
    assert_clipping_agrees(model, sequence_ce, x, y)


def test_shared_layers_called_at_every_depth():
    torch.manual_seed(0)
    model = SharedDepth().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 3, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,))
    routes = routes_of(model, nn.CrossEntropyLoss(reduction="none"), x, y)
    assert {routes[f"{m}#{k}"] for m in ("up", "lin") for k in range(3)} == {"gram (shared)"}
    assert_clipping_agrees(model, nn.CrossEntropyLoss(reduction="none"), x, y)


def test_embedding_called_twice():
    torch.manual_seed(0)
    model = EmbeddingTwice().double()
    x, _ = tokens(V=30, pad=0)
    y = torch.randint(0, 3, (6,))
    assert routes_of(model, nn.CrossEntropyLoss(reduction="none"), x, y)["emb#1"] == \
        "gram (shared)"
    assert_clipping_agrees(model, nn.CrossEntropyLoss(reduction="none"), x, y)


def test_long_sequences_materialise_instead():
    """2 (Σ T)² >= V d: the (n, V, d) gradient is smaller, and is what the calls build."""
    torch.manual_seed(0)
    model = TiedHead(V=12, d=4).double()
    x, y = tokens(T=9, V=12)
    routes = routes_of(model, sequence_ce, x, y)
    assert routes["wte#0"] == "materialise (shared)", routes
    assert not cross.plan(record(model, sequence_ce, x, y, retain_graph=False),
                          {id(model.wte.weight)})
    assert_clipping_agrees(model, sequence_ce, x, y)


def test_pairs_equal_the_materialised_inner_products():
    """<L_fᵀ R_f, L_gᵀ R_g> for every pairing of dense and one-hot factors."""
    g = torch.Generator().manual_seed(0)
    n, V, D = 3, 7, 4
    dense = [cross.Factors(torch.randn(n, T, D, generator=g, dtype=torch.float64),
                           left=torch.randn(n, T, V, generator=g, dtype=torch.float64))
             for T in (2, 5)]
    onehot = [cross.Factors(torch.randn(n, T, D, generator=g, dtype=torch.float64),
                            index=torch.randint(0, V, (n, T), generator=g)) for T in (3, 4)]
    for f in dense + onehot:
        for h in dense + onehot:
            want = (f.materialise(V) * h.materialise(V)).sum((1, 2))
            torch.testing.assert_close(cross.pair(f, h), want, rtol=1e-12, atol=1e-12)


def test_float32_overflow_is_renormed_in_float64():
    """Gram entries past float32's range: the norm comes from the same factors in float64."""
    torch.manual_seed(0)
    model = TiedHead()
    x, y = tokens()
    rec = record(model, sequence_ce, x, y, retain_graph=False)
    for call in rec.recorder.all_calls():  # blow every backprop up past float32's Grams
        if call.backprops is not None:
            call.backprops = call.backprops * 1e20
    ref_rec = record(model.double(), sequence_ce, x, y, retain_graph=False)
    for call in ref_rec.recorder.all_calls():
        if call.backprops is not None:
            call.backprops = call.backprops * 1e20
    got = squared_norms(rec)[0]
    want = squared_norms(ref_rec)[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


def test_a_call_that_cannot_be_factored_materialises_the_weight():
    """The plan saw a factorable call; if one arrives otherwise (here: its b forged into a
    tuple), the earlier calls' factors are materialised and the sum goes on as before."""
    torch.manual_seed(0)
    model = TiedHead().double()
    x, y = tokens()
    rec = record(model, sequence_ce, x, y, retain_graph=False)
    want, _ = squared_norms(rec)
    rec = record(model, sequence_ce, x, y, retain_graph=False)
    real = cross.factors
    seen = []

    def second_fails(layer, call, p):
        seen.append(layer)
        return None if len(seen) == 2 else real(layer, call, p)

    cross.factors = second_fails
    try:
        got, materialised = squared_norms(rec)
    finally:
        cross.factors = real
    assert id(model.wte.weight) in materialised
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("method", ["bookkeeping", "auto"])
def test_optimizer_steps_with_a_tied_head(method, verify):
    torch.manual_seed(0)
    model = TiedHead().double()
    batches = [tokens(n=n, seed=s) for s, n in enumerate((6, 5, 7, 5))]  # n = T included
    assert_optimizer_matches_microbatch(model, sequence_ce, batches, method=method,
                                        verify=verify)
