"""Tensors computed from parameters alone that meet the batch (``per_sample/derived.py``):
DeBERTa's projected relative positions (``q @ (E W)ᵀ``), Mamba's ``A = -exp(A_log)`` times
the batch, a weight built inside an ``autograd.Function`` (LoHa) in ``F.linear``, a
convolution weight read through a view. Their parameters used to take the whole-model
fallback; they now take Eqs. (1)-(2) at each meeting, exact against a float64 loop in every
method and optimizer mode, with and without the self-check. Where a parameter also reaches
the loss another way, or the batch operand is written after the op, it keeps the fallback."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import (
    assert_optimizer_matches_microbatch,
    ce_per_sample,
    classification_batch,
    one_at_a_time_grads,
)
from tests.per_sample.test_unseen import Hada
from workbench.dpsgd import MODES
from workbench.per_sample.recording import record

D, K, T = 4, 3, 5


class RelativeBias(nn.Module):
    """Scores q kᵀ + q (E W)ᵀ: the projected embeddings meet every record's queries in a
    matmul (DeBERTa's c2p term); E also read outside its module, W inside a batch-free call."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        self.rel = nn.Embedding(T, D)
        self.proj = nn.Linear(D, D, bias=False)
        self.head = nn.Linear(D, K)

    def forward(self, x):  # x (n, T, D)
        q, k = self.q(x), self.k(x)
        pos = self.proj(self.rel.weight).unsqueeze(0)  # (1, T, D): no sample in it
        scores = q @ k.transpose(-1, -2) + torch.matmul(q, pos.transpose(-1, -2))
        return self.head((scores.softmax(-1) @ x).mean(1))


class StateDecay(nn.Module):
    """h = x ⊙ (-exp(A_log)) + x ⊙ D, then a conv whose weight is read through a view (Mamba)."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.randn(D, 1))
        self.D = nn.Parameter(torch.randn(D))
        self.conv = nn.Conv1d(D, D, 3, groups=D, padding=2, bias=False)
        self.head = nn.Linear(D, K)

    def forward(self, x):  # x (n, T, D)
        h = x.transpose(1, 2) * -torch.exp(self.A_log)  # (n, D, T) ⊙ (D, 1)
        h = h + x.transpose(1, 2) * self.D[:, None]
        w = self.conv.weight.view(D, 3).unsqueeze(1)  # read outside the conv's forward
        h = F.conv1d(h, w, padding=2, groups=D)[..., :T]
        return self.head(torch.tanh(h).mean(-1))


class Hadamard(nn.Module):
    """A weight from an autograd.Function that torch.func cannot run, in ``F.linear``."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Parameter(torch.randn(D, 2)), nn.Parameter(torch.randn(D, 2))
        self.b, self.d = nn.Parameter(torch.randn(2, D)), nn.Parameter(torch.randn(2, D))
        self.head = nn.Linear(D, K)

    def forward(self, x):  # x (n, T, D)
        dw = Hada.apply(self.a, self.b, self.c, self.d)
        return self.head(torch.tanh(F.linear(x, dw)).mean(1))


class AlsoElsewhere(RelativeBias):
    """E also added to the batch directly: E reaches the loss outside the meeting."""

    def forward(self, x):
        return super().forward(x + self.rel.weight)


class TableBias(nn.Module):
    """BEiT's / Data2Vec's relative position bias on the SDPA path: a table (a parameter)
    indexed by a buffer, permuted, handed to ``scaled_dot_product_attention`` as its mask."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.head = nn.Linear(D, 3 * D), nn.Linear(D, K)
        self.table = nn.Parameter(torch.randn(2 * T - 1, heads))
        pos = torch.arange(T)
        self.register_buffer("index", (pos[:, None] - pos[None, :] + T - 1).flatten())

    def forward(self, x):  # x (n, T, D)
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index].view(T, T, self.heads).permute(2, 0, 1).unsqueeze(0)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (n, heads, T, D/heads)
        return self.head(h.transpose(1, 2).reshape(n, T, D).mean(1))


MODELS = {"relative_bias": RelativeBias, "state_decay": StateDecay, "hadamard": Hadamard,
          "table_bias": TableBias}


def batch(n, seed):
    x, y = classification_batch(n * T, D, K, seed)
    return x.view(n, T, D), y[:n]


def build(name):
    torch.manual_seed(0)
    return MODELS[name]().double()


def assert_same(got: dict, ref: dict, what=""):
    """Each parameter's error within 1e-9 of the whole gradient's size (k.bias's is zero but
    for rounding: the softmax does not see it)."""
    size = float(torch.sqrt(sum(g.pow(2).sum() for g in ref.values())))
    for k, g in ref.items():
        assert float((got[k] - g).norm()) <= 1e-9 * size, (what, k)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def derived_names(model, x, y):
    rec = record(model, ce_per_sample, x, y)
    rec.recorder.backward(rec.losses.sum())
    ids = {id(p) for m in rec.recorder.derived.meetings for p in m.params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [3, T])  # n = T: shapes cannot tell the batch from positions
def test_functional_api_is_exact(name, n, check):
    model = build(name)
    x, y = batch(n, 0)
    ref = one_at_a_time_grads(model, ce_per_sample, x, y)
    got = quiet(wb.per_sample_gradients, model, ce_per_sample, x, y, method="einsum",
                check=check)
    assert_same(got, ref)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    C = float(norms.median())
    c = (C / norms).clamp(max=1)
    for method in ("ghost", "bookkeeping"):
        got = quiet(wb.clipped_grad_sum, model, ce_per_sample, x, y, C, method=method,
                    check=check)
        assert_same(got, {k: torch.einsum("n,n...->...", c, g) for k, g in ref.items()},
                    method)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_meetings_serve_them_without_the_whole_model(name):
    model = build(name)
    x, y = batch(3, 0)
    served = {"relative_bias": {"rel.weight", "proj.weight"},
              "state_decay": {"A_log", "D", "conv.weight"},
              "hadamard": {"a", "b", "c", "d"}, "table_bias": {"table"}}[name]
    assert derived_names(model, x, y) == served
    routes = quiet(wb.ghost_routes, model, ce_per_sample, x, y)
    assert not routes.route.str.contains("fallback").any(), routes.to_string()
    assert routes.route.str.contains("derived").any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_optimizer_is_exact(name, mode):
    model = build(name)
    batches = [batch(n, 10 + s) for s, n in enumerate((3, T, 4))]
    quiet(assert_optimizer_matches_microbatch, model, ce_per_sample, batches, method=mode)


@pytest.mark.parametrize("name", list(MODELS))
def test_optimizer_without_its_check_and_with_accumulation(name):
    """Two backward passes before one step: each pass's meetings give its own g_i."""
    from workbench.dpsgd import DPOptimizer

    model = build(name)
    C = 0.3
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum")
    opt.verify = False
    try:
        for step in range(2):
            parts = [batch(3, 20 + step), batch(2, 30 + step)]
            opt.zero_grad()
            for x, y in parts:
                ce_per_sample(model(x), y).sum().backward()
            quiet(opt.step)
            want = {k: sum(wb.clipped_grad_sum(model, ce_per_sample, x, y, C,
                                               method="microbatch")[k] for x, y in parts)
                    for k, _ in model.named_parameters()}
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()


def test_a_parameter_reaching_the_loss_another_way_keeps_the_fallback():
    torch.manual_seed(0)
    model = AlsoElsewhere().double()
    x, y = batch(3, 0)
    assert "rel.weight" not in derived_names(model, x, y)
    assert "proj.weight" in derived_names(model, x, y)  # only through the meeting
    ref = one_at_a_time_grads(model, ce_per_sample, x, y)
    got = quiet(wb.per_sample_gradients, model, ce_per_sample, x, y, method="einsum",
                check=False)
    assert_same(got, ref)


class WrittenAfter(nn.Module):
    """The batch operand of a meeting written in place after it (an add saves nothing, so
    autograd allows it): Eq. (1) would re-run the op on other values, so the meeting gives
    nothing and the fallback computes the parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.head = nn.Linear(D, K)

    def forward(self, x):
        a = torch.tanh(x.mean(1))
        h = a + torch.exp(self.w)  # a meeting: a + D
        a.mul_(2)
        return self.head(h * a)


def test_an_operand_written_after_the_meeting_keeps_the_fallback():
    torch.manual_seed(0)
    model = WrittenAfter().double()
    x, y = batch(3, 0)
    ref = one_at_a_time_grads(model, ce_per_sample, x, y)
    for check in (True, False):
        got = quiet(wb.per_sample_gradients, model, ce_per_sample, x, y, method="einsum",
                    check=check)
        assert_same(got, ref, check)
    routes = quiet(wb.ghost_routes, model, ce_per_sample, x, y)
    assert not routes.route.str.contains("derived").any()


def test_a_batch_statistic_is_not_a_parameter_only_tensor():
    """D = mean over the batch of an activation: tainted by the inputs, not a meeting."""
    torch.manual_seed(0)

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(D, D), nn.Linear(D, K)

        def forward(self, x):
            h = self.lin(x.mean(1))
            return self.head(h * h.mean(0, keepdim=True))

    model = Centred().double()
    x, y = batch(3, 0)
    with pytest.raises(wb.SampleMixingError, match="mean over dim 0"):  # measured at the
        derived_names(model, x, y)  # forward's end (batch_reductions.LINEAR), before any
    # meeting is looked for


class AlsoInItsLayer(nn.Module):
    """W in its Linear on the batch and, transposed, in a matmul meeting (tests/clipping's
    shared model): from the second step on, book-keeping taps the Linear (skip_weights.py)
    and the graph walk no longer sees that use; the layer's rule still computes it, so W is
    not the meeting's alone (``derived.ruled``)."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, x):
        x = x.mean(1)
        return self.head(torch.tanh(self.inp(x) + 0.5 * torch.tanh(x @ self.inp.weight.T)))


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_also_in_its_tapped_layer_is_not_the_meetings_alone(mode):
    torch.manual_seed(0)
    model = AlsoInItsLayer().double()
    batches = [batch(n, 40 + s) for s, n in enumerate((3, 4, 3, 5))]
    quiet(assert_optimizer_matches_microbatch, model, ce_per_sample, batches, method=mode,
          verify=False)


@pytest.mark.parametrize("name", list(MODELS))
def test_optimizer_steps_never_run_the_whole_model(name, monkeypatch):
    """Every step, the first (checked) and the later ones (book-keeping taps its layers'
    weights, ``skip_weights.py``: a batch-free call such as ``proj`` is not tapped, so the
    walk below D still reaches its weight): no whole-model pass, the same sums."""
    import workbench.dpsgd.recorded as recorded

    def refuse(*args, **kwargs):
        raise AssertionError("the whole-model fallback ran")

    monkeypatch.setattr(recorded, "exact_per_sample_gradients", refuse)
    model = build(name)
    batches = [batch(n, 50 + s) for s, n in enumerate((3, 4, 3, T))]
    quiet(assert_optimizer_matches_microbatch, model, ce_per_sample, batches)


class PositionsFirst(nn.Module):
    """``maximum(pos, x)`` with the batch-free table first: the op reads pos, it does not
    write it, so pos stays untainted, and ``pos @ exp(M)`` is no meeting (its rows are
    positions, T of them; at n = T a taint that spread to pos would have read them as
    samples and given M a plausible, wrong g_i)."""

    def __init__(self):
        super().__init__()
        self.rel, self.M = nn.Embedding(T, D), nn.Parameter(torch.randn(D, D) / 2)
        self.head = nn.Linear(D, K)

    def forward(self, x):  # x (n, T, D)
        pos = self.rel.weight * 1.0  # (T, D), computed from a parameter
        h = torch.maximum(pos, x)  # not a meeting op: pos reaches the loss here too
        extra = pos @ torch.exp(self.M)  # (T, D): still no sample in it
        return self.head(torch.tanh(h + extra).mean(1))


@pytest.mark.parametrize("check", [True, False])
def test_an_op_reading_a_batch_free_tensor_does_not_taint_it(check):
    torch.manual_seed(0)
    model = PositionsFirst().double()
    x, y = batch(T, 0)  # n = T
    ref = one_at_a_time_grads(model, ce_per_sample, x, y)
    got = quiet(wb.per_sample_gradients, model, ce_per_sample, x, y, method="einsum",
                check=check)
    assert_same(got, ref)
    assert derived_names(model, x, y) == {"M"}  # rel.weight: also through maximum


def test_a_model_whose_only_trainable_parameters_are_derived(monkeypatch):
    """VB-LoRA's shape: the base frozen, the adapters' parameters reach the loss only through
    meetings; no layer call is recorded, so the optimizer counts backward passes at the
    model's output, and the meetings must count them the same way (they counted the layer
    recorder's passes, which never advanced: from the second step on the whole-model pass
    ran instead)."""
    import workbench.dpsgd.recorded as recorded

    def refuse(*args, **kwargs):
        raise AssertionError("the whole-model fallback ran")

    monkeypatch.setattr(recorded, "exact_per_sample_gradients", refuse)

    class FrozenBase(nn.Module):  # the factors in a ParameterDict no forward call records
        def __init__(self):
            super().__init__()
            self.factors = nn.ParameterDict({
                "a": nn.Parameter(torch.randn(D, 2)), "b": nn.Parameter(torch.randn(2, D)),
                "c": nn.Parameter(torch.randn(D, 2)), "d": nn.Parameter(torch.randn(2, D))})
            self.head = nn.Linear(D, K).requires_grad_(False)

        def forward(self, x):
            f = self.factors
            dw = Hada.apply(f["a"], f["b"], f["c"], f["d"])
            return self.head(torch.tanh(F.linear(x, dw)).mean(1))

    torch.manual_seed(0)
    model = FrozenBase().double()
    batches = [batch(n, 60 + s) for s, n in enumerate((3, 4, 3))]
    from workbench.dpsgd import DPOptimizer

    opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                      lr=0.0), model, noise_multiplier=0.0, max_grad_norm=0.3,
                      expected_batch_size=1.0, loss_reduction="sum")
    try:
        for x, y in batches:
            want = wb.clipped_grad_sum(model, ce_per_sample, x, y, 0.3, method="microbatch")
            opt.zero_grad()
            ce_per_sample(model(x), y).sum().backward()
            quiet(opt.step)
            for k, p in model.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()


class TableThenBatch(nn.Module):
    """One Linear called first on a position table (no sample in it, rows that differ), then
    on the batch: book-keeping's tap must take both calls or neither (``skip_weights.py``),
    since the optimizer's ``.grad`` check leaves a tapped path's calls out as a whole."""

    def __init__(self):
        super().__init__()
        self.rel, self.proj = nn.Embedding(T, D), nn.Linear(D, D)
        self.head = nn.Linear(D, K)

    def forward(self, x):  # x (n, T, D)
        pos = self.proj(self.rel.weight)  # (T, D)
        return self.head(torch.tanh(self.proj(x) + pos).mean(1))


def test_a_layer_called_without_then_with_the_batch_in_the_optimizer():
    torch.manual_seed(0)
    model = TableThenBatch().double()
    batches = [batch(n, 70 + s) for s, n in enumerate((3, 4, 2, 4, T))]  # new shapes, later
    quiet(assert_optimizer_matches_microbatch, model, ce_per_sample, batches)


class TimeMajorDecay(nn.Module):
    """exp(A) meets rows whose dim 0 is time, not the batch (a sequence-first block)."""

    def __init__(self):
        super().__init__()
        self.A = nn.Parameter(torch.randn(D))
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, K)

    def forward(self, x):  # (n, T, D)
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # (T, n, D)
        return self.head((h * torch.exp(self.A)).transpose(0, 1)).mean(1)  # (n, K)


@pytest.mark.parametrize("check", [True, False])
def test_a_meeting_on_rows_that_are_not_the_batch_is_refused(check):
    """At T = n the time-major rows have the batch's size: only the rows' proof from the model's
    inputs (flat_rows.py) tells them apart; without it, and without the self-check, A's g_i was
    summed over time steps (relative error 0.71)."""
    torch.manual_seed(0)
    model = TimeMajorDecay().double()
    x, y = batch(T, 0)
    got = quiet(wb.per_sample_gradients, model, ce_per_sample, x, y, method="einsum",
                check=check)
    assert_same(got, wb.per_sample_gradients(model, ce_per_sample, x, y, method="microbatch"))
    routes = quiet(wb.ghost_routes, model, ce_per_sample, x, y)
    assert "derived (meetings)" not in set(routes["route"]), routes


class GatheredPositions(nn.Module):
    """Two DeBERTa-like layers: each query meets a table projected from parameters alone
    (a meeting), the scores are gathered by relative position along the key dim with an index
    expanded to the batch, and added to content scores. The second layer's meeting needs the
    first's output rows proved the batch's through that gather (before: the proof stopped at
    the gather, and the second layer's table took the whole-model fallback on every step)."""

    def __init__(self):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(2 * T, D) / 2)
        self.q = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.pos = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.head = nn.Linear(D, K)

    def forward(self, x):  # (n, T, D)
        n = x.shape[0]
        idx = (torch.arange(T)[None, :] - torch.arange(T)[:, None] + T).expand(n, T, T)
        for q, pos in zip(self.q, self.pos):
            query = q(x)  # (n, T, D)
            scores = query @ pos(self.rel).T  # (n, T, 2T): the meeting
            scores = torch.gather(scores, -1, idx)  # (n, T, T) by relative position
            scores = scores + query @ x.transpose(1, 2)
            x = x + torch.softmax(scores, -1) @ x
        return self.head(x.mean(1))


@pytest.mark.parametrize("check", [True, False])
def test_a_gather_by_relative_position_keeps_the_rows_proof(check):
    torch.manual_seed(0)
    model = GatheredPositions().double()
    for n in (2, T):
        x, y = batch(n, 3)
        got = quiet(wb.per_sample_gradients, model, ce_per_sample, x, y, method="einsum",
                    check=check)
        assert_same(got, wb.per_sample_gradients(model, ce_per_sample, x, y,
                                                 method="microbatch"), n)
    routes = quiet(wb.ghost_routes, model, ce_per_sample, x, y)
    assert "exact fallback" not in set(routes["route"]), routes
    assert set(routes[routes.layer.str.startswith("pos.")]["route"]) == {"derived (meetings)"}
    batches = [batch(n, 80 + s) for s, n in enumerate((3, 1, T))]
    quiet(assert_optimizer_matches_microbatch, model, ce_per_sample, batches)
