"""The problem table of issue "never silently wrong": model families that break a per-layer
engine's assumptions, each method against micro-batching in float64, and the impossible cases
against their errors."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import workbench as wb
from tests.helpers import relative_error
from workbench.dpsgd import MODES, DPOptimizer

TOL = 1e-9
V, T, D = 11, 5, 6


def seq_loss(out, y):  # per-token cross-entropy summed per sequence: (n,)
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)


def mse(out, y):
    return ((out - y) ** 2).flatten(1).sum(1)


class TiedLM(nn.Module):
    """nanoGPT's habits: tied head by F.linear, positional embedding on arange(T).

    ``head``: how the tied head is written ("linear": F.linear(h, E), a rule call; "matmul":
    h @ E.T and "torch_matmul": torch.matmul(h, E.t()), exact by the fallback). ``pos``: how
    the positions enter ("arange", "radd": pos + tok, "unsqueeze": wpe(arange(T)[None]),
    "linear": a Linear on batch-free features, all rule calls; "expand": wpe on arange
    expanded to the batch, an ordinary call; "twice": the positions added twice, two meetings,
    a rule call; "times": added, then multiplied into the batch, fallback).
    """

    def __init__(self, head="linear", pos="arange"):
        super().__init__()
        self.head, self.pos = head, pos
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)
        self.pfc = nn.Linear(D, D)
        self.register_buffer("features", torch.randn(T, D))

    def positions(self, idx):
        n, t = idx.shape
        if self.pos == "unsqueeze":
            return self.wpe(torch.arange(t)[None])  # (1, t, D)
        if self.pos == "expand":
            return self.wpe(torch.arange(t).unsqueeze(0).expand(n, t))  # (n, t, D)
        if self.pos == "linear":
            return self.pfc(self.features[:t])  # (t, D)
        return self.wpe(torch.arange(t))  # (t, D)

    def forward(self, idx):
        tok, pos = self.wte(idx), self.positions(idx)
        h = pos + tok if self.pos == "radd" else tok + pos
        u = torch.tanh(self.fc(self.ln(h)))
        if self.pos == "twice":
            u = u + pos
        if self.pos == "times":
            u = u * pos
        if self.head == "matmul":
            return u @ self.wte.weight.T
        if self.head == "torch_matmul":
            return torch.matmul(u, self.wte.weight.t())
        return F.linear(u, self.wte.weight)


class ParentReadsChild(nn.Module):
    """A child's weight also read directly in the parent's forward."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x)) + x @ self.fc.weight.T * 0.5
        return self.out(h)


class ForwardBypass(nn.Module):
    """``self.fc.forward(x)``: the module's hooks never run."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc.forward(x)))


class SeqFirst(nn.Module):
    """Linear layers on (T, n, d) tensors, then a view(n * T, d) before the head."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):  # x: (n, T, 4)
        h = torch.tanh(self.fc(x.transpose(0, 1)))  # (T, n, 4)
        n, t = x.shape[0], x.shape[1]
        flat = h.transpose(0, 1).reshape(n * t, 4)  # (n T, 4)
        return self.head(flat).view(n, t, 3)


class Pair(nn.Module):
    """Returns a tuple; has a registered grad sampler (below)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.a, x * self.b


@wb.register_grad_sampler(Pair)
def _pair_sampler(layer, activations, backprops):
    x = activations[0]
    return {"a": x * backprops[0], "b": x * backprops[1]}  # (n, 4) each


class UsesPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair, self.out = Pair(), nn.Linear(4, 3)

    def forward(self, x):
        u, v = self.pair(x)
        return self.out(torch.tanh(u) * v)


def parametrised(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    if kind == "weight_norm":
        parametrizations.weight_norm(model[0])
    elif kind == "orthogonal":
        parametrizations.orthogonal(model[2])
    elif kind == "spectral":
        parametrizations.spectral_norm(model[0])
        model.eval()  # spectral_norm's power iteration updates buffers in training mode
    else:  # the older torch.nn.utils.weight_norm (a forward pre-hook)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            nn.utils.weight_norm(model[0])
    return model


def transformer(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0,
                                       batch_first=batch_first)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = layer, nn.Linear(D, 3)

        def forward(self, x):  # x: (n, T, D)
            h = self.enc(x if batch_first else x.transpose(0, 1))
            return self.head(h if batch_first else h.transpose(0, 1))

    return wb.fix_model(Model())


def dp_lstm_seq_first():
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = wb.layers.DPLSTM(4, 5), nn.Linear(5, 3)

        def forward(self, x):  # x: (n, T, 4)
            out, _ = self.rnn(x.transpose(0, 1))  # (T, n, 5)
            return self.head(out.transpose(0, 1))

    return Model()


def ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


def reals(shape, out, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64),
            torch.randn(out, generator=g, dtype=torch.float64))


def family(name, n):
    """(model in float64, loss_fn, inputs, targets)."""
    torch.manual_seed(0)
    if name.startswith("tied_lm"):
        return TiedLM(**TIED[name]).double(), seq_loss, *ids(n, n)
    if name == "parent_reads_child":
        return ParentReadsChild().double(), mse, *reals((n, 4), (n, 3), n)
    if name == "forward_bypass":
        return ForwardBypass().double(), mse, *reals((n, 4), (n, 3), n)
    if name == "seq_first":
        return SeqFirst().double(), mse, *reals((n, T, 4), (n, T, 3), n)
    if name == "tuple_with_sampler":
        return UsesPair().double(), mse, *reals((n, 4), (n, 3), n)
    if name.startswith("param_"):
        return parametrised(name[6:]).double(), mse, *reals((n, 4), (n, 3), n)
    if name.startswith("transformer_"):
        return transformer(name.endswith("bf")).double(), mse, *reals((n, T, D), (n, T, 3), n)
    if name == "dp_lstm_seq_first":
        return dp_lstm_seq_first().double(), mse, *reals((n, T, 4), (n, T, 3), n)
    raise KeyError(name)


TIED = {"tied_lm": {}, "tied_lm_matmul": dict(head="matmul"),
         "tied_lm_torch_matmul": dict(head="torch_matmul"), "tied_lm_pos_radd": dict(pos="radd"),
         "tied_lm_pos_unsqueeze": dict(pos="unsqueeze"), "tied_lm_pos_expand": dict(pos="expand"),
         "tied_lm_pos_linear": dict(pos="linear"), "tied_lm_pos_twice": dict(pos="twice"),
         "tied_lm_pos_times": dict(pos="times")}
FAMILIES = [*TIED, "parent_reads_child", "forward_bypass", "seq_first",
            "tuple_with_sampler", "param_weight_norm", "param_orthogonal", "param_spectral",
            "param_old_weight_norm", "transformer_sf", "transformer_bf", "dp_lstm_seq_first"]
SIZES = [3, T]  # n = T: the shapes of a sequence-first layer look batch-first


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", FAMILIES)
def test_einsum_and_ghost_are_exact(name, n):
    model, loss_fn, x, y = family(name, n)
    ref = wb.per_sample_gradients(model, loss_fn, x, y, method="microbatch")
    got = quiet(wb.per_sample_gradients, model, loss_fn, x, y, method="einsum", check="always")
    for k in ref:
        assert relative_error(got[k], ref[k]) <= TOL, (name, k)
    ref_norms = wb.per_sample_grad_norms(model, loss_fn, x, y, method="microbatch")
    norms = quiet(wb.per_sample_grad_norms, model, loss_fn, x, y, method="ghost", check="always")
    assert relative_error(norms, ref_norms) <= TOL, name
    C = float(ref_norms.median())
    ref_sum = wb.clipped_grad_sum(model, loss_fn, x, y, C, method="microbatch")
    for method in ("ghost", "bookkeeping", "einsum"):
        got_sum = quiet(wb.clipped_grad_sum, model, loss_fn, x, y, C, method=method,
                        check="always")
        for k in ref_sum:
            assert relative_error(got_sum[k], ref_sum[k]) <= TOL, (name, method, k)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FAMILIES)
def test_dp_optimizer_is_exact(name, mode):
    n = T
    model, loss_fn, x, y = family(name, n)
    norms = wb.per_sample_grad_norms(model, loss_fn, x, y, method="microbatch")
    C, B = float(norms.median()), 4.0
    ref = wb.clipped_grad_sum(model, loss_fn, x, y, C, method="microbatch")
    opt = quiet(DPOptimizer, torch.optim.SGD(model.parameters(), lr=0.0), model,
                noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=B,
                method=mode, loss_reduction="sum")
    opt.zero_grad()
    loss_fn(model(x), y).sum().backward()
    quiet(opt.step)
    opt.detach()
    for k, p in model.named_parameters():
        if p.requires_grad:
            assert relative_error(p.grad * B, ref[k]) <= TOL, (name, mode, k)


# which parameters the exact whole-model fallback computes: none where a rule covers every use
FALLBACK = {"tied_lm": set(), "tied_lm_pos_radd": set(), "tied_lm_pos_unsqueeze": set(),
            "tied_lm_pos_expand": set(), "tied_lm_pos_linear": set(),
            "tied_lm_matmul": {"wte.weight"}, "tied_lm_torch_matmul": {"wte.weight"},
            "tied_lm_pos_twice": set(), "tied_lm_pos_times": {"wpe.weight"}}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", FALLBACK)
def test_tied_heads_and_positions_by_rule_where_they_can(name, n):
    """A tied head by F.linear and positions added to the batch are rule calls (fast); the
    forms no rule covers are left to the exact fallback, after the probe, at n != T and n = T."""
    from workbench.clipping.ghost import record
    model, loss_fn, x, y = family(name, n)
    rec = quiet(record, model, loss_fn, x, y, retain_graph=False, check="always")
    assert set(rec.fallback_names()) == FALLBACK[name], rec.fallback
    tied = [path for path in rec.layers if path.startswith("F.linear")]
    assert tied == ([] if "matmul" in name else ["F.linear(wte.weight)"])


class Centre(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x - x.mean(0))  # mixes the samples of the batch without a module


class Liar(nn.Module):
    """A layer whose registered sampler returns the rows in the wrong order."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.w


@wb.register_grad_sampler(Liar)
def _liar_sampler(layer, activations, backprops):
    return {"w": (activations[0] * backprops).flip(0)}  # sums right, rows wrong


@pytest.mark.parametrize("method", ["einsum", "ghost"])
def test_sample_mixing_without_a_module_raises(method):
    x, y = reals((6, 4), (6, 3), 0)
    model = Centre().double()
    with pytest.raises((wb.PerSampleCheckError, wb.SampleMixingError),
                       match="mixes samples outside any module|couples the records"):
        if method == "einsum":
            wb.per_sample_gradients(model, mse, x, y, method="einsum")
        else:
            wb.per_sample_grad_norms(model, mse, x, y, method="ghost")


def test_a_sampler_that_lies_about_rows_is_caught():
    x, y = reals((6, 4), (6, 4), 1)
    model = nn.Sequential(Liar(), nn.Tanh()).double()
    with pytest.raises(wb.PerSampleCheckError, match=r"0\.w"):
        wb.per_sample_gradients(model, mse, x, y, method="einsum")
    got = wb.per_sample_gradients(model, mse, x, y, method="einsum", check=False)
    ref = wb.per_sample_gradients(model, mse, x, y, method="microbatch")
    assert relative_error(got["0.w"], ref["0.w"]) > 0.01  # what check=False would return


def test_check_runs_once_per_signature_and_always_on_request(monkeypatch):
    from workbench.per_sample import selfcheck
    calls = []
    real = selfcheck.probe
    monkeypatch.setattr(selfcheck, "probe", lambda *a: calls.append(1) or real(*a))
    model, loss_fn, x, y = family("tied_lm", 3)
    for _ in range(3):
        wb.per_sample_gradients(model, loss_fn, x, y)
    assert len(calls) == 1
    wb.per_sample_gradients(model, loss_fn, x, y, check="always")
    assert len(calls) == 2
    with pytest.raises(ValueError, match="check must be True"):
        wb.per_sample_gradients(model, loss_fn, x, y, check="sometimes")


def test_parameter_read_by_the_loss_is_exact_in_the_functional_api():
    model = nn.Linear(4, 3).double()
    x, y = reals((5, 4), (5, 3), 2)

    def loss_fn(out, t):  # reads the weight itself: a regulariser per sample
        return mse(out, t) + (model.weight ** 2).sum() * out.abs().sum(1)

    ref = wb.per_sample_gradients(model, loss_fn, x, y, method="microbatch")
    got = wb.per_sample_gradients(model, loss_fn, x, y, method="einsum")
    assert relative_error(got["weight"], ref["weight"]) <= TOL


def test_vmap_with_tuple_targets_is_exact():
    model = nn.Linear(4, 3).double()
    x, t = reals((5, 4), (5, 3), 3)
    w = torch.rand(5, dtype=torch.float64)

    def loss_fn(out, targets):  # (targets, per-sample weights): each row its own
        target, weight = targets
        return mse(out, target) * weight

    ref = wb.per_sample_gradients(model, loss_fn, x, (t, w), method="microbatch")
    for method in ("vmap", "einsum"):
        got = wb.per_sample_gradients(model, loss_fn, x, (t, w), method=method)
        assert relative_error(got["weight"], ref["weight"]) <= TOL, method


@pytest.mark.parametrize("option", [{"max_norm": 1.0}, {"sparse": True}])
def test_vmap_on_embedding_options_is_a_clear_error(option):
    model = nn.Sequential(nn.Embedding(10, 3, **option))
    with pytest.raises(wb.UnsupportedLayerError, match="Embedding at 0 uses .*method='microbatch'"):
        wb.per_sample_gradients(model, lambda o, t: o.sum((1, 2)), torch.randint(0, 10, (4, 2)),
                                None, method="vmap")


def test_vmap_on_packed_sequences_is_a_clear_error():
    from torch.nn.utils.rnn import pack_padded_sequence

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = wb.layers.DPLSTM(4, 3, batch_first=True)

        def forward(self, x):
            packed = pack_padded_sequence(x, torch.tensor([5, 4, 2]), batch_first=True)
            return self.rnn(packed)[1][0][-1]

    with pytest.raises(wb.UnsupportedLayerError, match="method='vmap' cannot run this model"):
        wb.per_sample_gradients(Packed(), lambda o, t: o.sum(1), torch.randn(3, 5, 4), None,
                                method="vmap")
