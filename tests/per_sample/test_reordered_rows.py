"""Rows reordered inside the model (``flat_rows._reorder``): a layer called on the batch's rows
in another order than the batch's.

Old NLP code sorts a batch by length before a layer and puts it back after
(``x[perm]`` ... ``h[perm.argsort()]``); each record's output is what it gives alone, but row r
of the layers between is record ``perm[r]``'s. Until 2026-11-30 every rule read row r as record
r's: per-sample gradients exchanged between records, the clipped sum 17% off in every
optimizer mode, and the self-check passed whenever the probed record (the last) kept its
place, in the optimizer on every later batch of a size already checked (a review's probe,
``/work/runs/probeC/sortperm*.py``). Each case is compared with a float64 loop over one record
at a time, over batches in several orders, the last record kept in place among them.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.dpsgd import MODES, DPOptimizer

T, V = 5, 12


class SortRun(nn.Module):
    """Sort by length, run, put back: the rows of ``e`` and ``l`` are in length order."""

    def __init__(self, unsort="argsort", select=False):
        super().__init__()
        self.e, self.l, self.o = nn.Embedding(V, 4, padding_idx=0), nn.Linear(4, 6), \
            nn.Linear(6, 3)
        self.unsort, self.select = unsort, select

    def forward(self, x):
        perm = (x != 0).sum(1).argsort(descending=True, stable=True)
        if self.select == "gather":
            xs = torch.gather(x, 0, perm[:, None].expand(-1, x.shape[1]))
        elif self.select == "take":
            xs = torch.take_along_dim(x, perm[:, None], 0)
        else:
            xs = x.index_select(0, perm) if self.select else x[perm]
        h = torch.tanh(self.l(self.e(xs))).sum(1)
        if self.unsort == "argsort":
            h = h[perm.argsort()]
        elif self.unsort == "scatter":  # out[perm] = h: written in place
            out = torch.empty_like(h)
            out[perm] = h
            h = out
        return self.o(h)


class LastToken(nn.Module):
    """``h[arange(n), lengths - 1]``: each record's own last token (GPT-2's pooling): the
    batch's rows in their order, kept on the fast path."""

    def __init__(self):
        super().__init__()
        self.e, self.l, self.o = nn.Embedding(V, 4, padding_idx=0), nn.Linear(4, 6), \
            nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.l(self.e(x)))
        last = (x != 0).sum(1).clamp(min=1) - 1
        return self.o(h[torch.arange(x.shape[0]), last])


class SortedAside(nn.Module):
    """Also returns the lengths sorted, which no loss reads: no refusal (a review found the
    first version of this change refusing it)."""

    def __init__(self):
        super().__init__()
        self.run = SortRun()

    def forward(self, x):
        lengths = (x != 0).sum(1)
        return self.run(x), lengths[lengths.argsort()]


class Unsorted(nn.Module):
    """Returns the rows sorted: row r is record perm[r]'s, paired with record r's target."""

    def __init__(self):
        super().__init__()
        self.e, self.o = nn.Embedding(V, 4, padding_idx=0), nn.Linear(4, 3)

    def forward(self, x):
        perm = (x != 0).sum(1).argsort(descending=True, stable=True)
        return self.o(self.e(x[perm]).sum(1))


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def batch(n, seed, last_shortest=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (n, T), generator=g)
    lengths = torch.randint(2, T + 1, (n,), generator=g)
    if last_shortest:
        lengths[-1] = 1  # the probed record stays in place after the sort
    x[torch.arange(T)[None] >= lengths[:, None]] = 0
    return x, torch.randint(0, 3, (n,), generator=g)


def reference(model, x, y, C):
    """Σ_i min(1, C / ||g_i||) g_i, one record at a time."""
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                list(params.values())) for i in range(len(x))]
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in r)) for r in rows])
    c = (C / norms).clamp(max=1.0)
    return {k: sum(c[i] * rows[i][j] for i in range(len(x)))
            for j, k in enumerate(params)}, norms


def rel(got, want):
    num = sum((got[k] - want[k]).pow(2).sum() for k in want)
    return float(num.sqrt() / sum(w.pow(2).sum() for w in want.values()).sqrt())


@pytest.fixture(autouse=True)
def _float64(float64_default):  # (tests/conftest.py)
    yield


@pytest.mark.parametrize("spelling", [dict(), dict(select=True), dict(unsort="scatter"),
                                      dict(select="gather"), dict(select="take")],
                         ids=["index", "index_select", "scatter_back", "gather",
                              "take_along_dim"])
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_functional_clipped_sum_exact_with_the_probed_record_in_place(spelling, method):
    torch.manual_seed(0)
    model = SortRun(**spelling)
    x, y = batch(4, 3, last_shortest=True)
    want, norms = reference(model, x, y, 1.0)
    C = float(norms.median())
    want, _ = reference(model, x, y, C)
    got = wb.clipped_grad_sum(model, loss_fn, x, y, C, method=method)
    assert rel(got, want) < 1e-10


def test_functional_per_sample_gradients_exact():
    torch.manual_seed(0)
    model = SortRun()
    x, y = batch(4, 3, last_shortest=True)
    got = wb.per_sample_gradients(model, loss_fn, x, y, method="einsum")
    for i in range(len(x)):
        want = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                   list(model.parameters()))
        for (k, g), w in zip(got.items(), want):
            torch.testing.assert_close(g[i], w, rtol=1e-10, atol=1e-12, msg=k)


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_optimizer_exact_over_steps_of_one_size(mode):
    """The first batches arrive sorted (the order a sort keeps), the later ones not: a verdict
    of the first must not cover them."""
    torch.manual_seed(0)
    model = SortRun()
    twin = SortRun()
    twin.load_state_dict(model.state_dict())
    batches = [batch(n, seed, last_shortest=step >= 1) for step, (n, seed) in
               enumerate([(5, 1), (5, 2), (3, 3), (5, 4), (5, 5)])]
    order = (batches[0][0] != 0).sum(1).argsort(descending=True, stable=True)
    batches[0] = batches[0][0][order], batches[0][1][order]  # made before the loop: its
    # sort is no statistic of a batch the loop prepares (loss_watch.py)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=5, loss_reduction="sum",
                      method=mode)
    for step, (x, y) in enumerate(batches):
        want, _ = reference(twin, x, y, 0.5)
        opt.zero_grad()
        loss_fn(model(x), y).sum().backward()
        opt.step()
        got = {k: -(p.detach() - q.detach()) / 0.1 * 5 for (k, p), q in
               zip(model.named_parameters(), twin.parameters())}
        assert rel(got, want) < 1e-9, (step, rel(got, want))
        twin.load_state_dict(model.state_dict())


def test_each_records_last_token_keeps_the_fast_path():
    """``h[arange(n), last]`` is the batch's rows in order: no fallback, exact."""
    torch.manual_seed(0)
    model = LastToken()
    x, y = batch(4, 3)
    rec = wb.per_sample.record(model, loss_fn, x, y) if hasattr(wb.per_sample, "record") \
        else None
    want, norms = reference(model, x, y, 1.0)
    got = wb.clipped_grad_sum(model, loss_fn, x, y, 1.0, method="bookkeeping")
    assert rel(got, want) < 1e-10
    if rec is not None:
        assert not rec.fallback


@pytest.mark.parametrize("api", ["functional", "optimizer"])
def test_outputs_in_another_order_are_refused(api):
    torch.manual_seed(0)
    model = Unsorted()
    x, y = batch(4, 3)
    with pytest.raises(wb.SampleMixingError):  # the halves check: records' outputs move
        if api == "functional":
            wb.clipped_grad_sum(model, loss_fn, x, y, 1.0, method="einsum")
        else:
            opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                              noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4,
                              loss_reduction="sum")
            loss_fn(model(x), y).sum().backward()
            opt.step()


@pytest.mark.parametrize("api", ["functional", "optimizer"])
def test_an_output_in_another_order_that_no_loss_reads_is_no_refusal(api):
    torch.manual_seed(0)
    model = SortedAside()
    x, y = batch(4, 3, last_shortest=True)

    def first(out, y):
        return loss_fn(out[0], y)

    want, _ = reference(model.run, x, y, 1.0)
    if api == "functional":
        got = wb.clipped_grad_sum(model, first, x, y, 1.0, method="bookkeeping")
        got = {k.removeprefix("run."): v for k, v in got.items()}
    else:
        before = {k: p.detach().clone() for k, p in model.run.named_parameters()}
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                          noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4,
                          loss_reduction="sum")
        first(model(x), y).sum().backward()
        opt.step()
        got = {k: (before[k] - p.detach()) / 0.1 * 4 for k, p in model.run.named_parameters()}
    assert rel(got, want) < 1e-9
