"""A statistic over the records inside the forward pass that the gradient flows through
(``per_sample/batch_reductions.py``): refused by name in every method and the optimizer,
where the outputs alone cannot show it (HF Nystromformer's pseudo-inverse, started from a
max over the whole batch: 1.9e-5 of the clipped sum, silently, until 2026-11-30).

The family: a non-linear reduction (max, norm, std, logsumexp, ...) over dim 0 of a tensor
holding the records, whole-tensor or with a dim that includes 0, through a flattening too.
Its neighbours that are fine stay exact against micro-batching: a reduction over each
record's own dims, over a parameter, elementwise ``torch.max(a, b)``, a statistic the outputs
do not reach, a batch of one record."""

import importlib.util
import warnings

import pytest
import torch
from torch import nn

import workbench as wb
from tests.per_sample.test_check_coverage import DetachedMax
from workbench.dpsgd import DPOptimizer

C = 0.5


def loss(out, y):
    return (out - y).pow(2).sum(1)


def data(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randn(n, 2, generator=g, dtype=torch.float64))


def invisible(s):
    """s's value removed, its gradient kept: outputs equal to the model without it."""
    return s - s.detach()


STATISTICS = {  # h (n, 6) -> a statistic over the records
    "max": lambda h: h.abs().max(),
    "norm": lambda h: h.norm(),
    "std": lambda h: h.std(),
    "amax_all_dims": lambda h: torch.amax(h, dim=(0, 1)),
    "max_dim0": lambda h: h.max(dim=0).values.sum(),
    "logsumexp_dim0": lambda h: torch.logsumexp(h, 0).sum(),
    "flattened_max": lambda h: h.reshape(-1).abs().max(),
    "vector_norm": lambda h: torch.linalg.vector_norm(h),
}

FINE = {  # h (n, 6) -> no statistic over the records
    "per_record_max": lambda h: h.abs().amax(dim=1, keepdim=True),
    "per_record_norm": lambda h: h.norm(dim=-1, keepdim=True),
    "elementwise_max": lambda h: torch.max(h, torch.zeros_like(h)).sum(1, keepdim=True),
}


class Stat(nn.Module):
    def __init__(self, stat, reach=True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.stat, self.reach = stat, reach
        self.seen = None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        s = self.stat(h)
        if self.reach:
            h = h + invisible(s)
        else:
            self.seen = float(s.detach().sum())  # logged, never in the outputs
        return self.b(h)


def run_optimizer(m, mode, x, y):
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=float(len(x)), method=mode,
                      loss_reduction="sum")
    try:
        opt.zero_grad()
        loss(m(x), y).sum().backward()
        opt.step()
        return {k: p.grad.clone() for k, p in m.named_parameters()}
    finally:
        opt.detach()


@pytest.mark.parametrize("stat", sorted(STATISTICS))
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_statistic_over_the_records_with_gradient_is_refused(stat, method):
    m = Stat(STATISTICS[stat]).double()
    with pytest.raises(wb.SampleMixingError, match="over dim 0 \\(the records\\)") as err:
        wb.clipped_grad_sum(m, loss, *data(), C, method=method)
    assert "test_batch_reductions.py" in str(err.value)  # the model's own line is named


@pytest.mark.parametrize("mode", ["vmap", "einsum", "bookkeeping", "auto"])
def test_the_optimizer_refuses_it_at_the_forward_pass(mode):
    m = Stat(STATISTICS["max"]).double()
    with pytest.raises(wb.SampleMixingError, match="couples the records"):
        run_optimizer(m, mode, *data())


@pytest.mark.parametrize("stat", sorted(FINE))
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_statistics_of_each_record_stay_exact(stat, method):
    m = Stat(FINE[stat]).double()
    x, y = data()
    want = wb.clipped_grad_sum(m, loss, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(m, loss, x, y, C, method=method, check="always")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_statistic_the_outputs_do_not_reach_is_not_refused(method):
    m = Stat(STATISTICS["max"], reach=False).double()
    x, y = data()
    want = wb.clipped_grad_sum(m, loss, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(m, loss, x, y, C, method=method)
    assert m.seen is not None
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


def test_a_max_over_a_parameter_and_a_batch_of_one_are_not_refused():
    class ParamMax(Stat):
        def forward(self, x):
            return self.b(torch.tanh(self.a(x)) / self.a.weight.abs().max())

    x, y = data()
    m = ParamMax(None).double()
    want = wb.clipped_grad_sum(m, loss, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(m, loss, x, y, C, method="einsum")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)
    one = Stat(STATISTICS["max"]).double()  # one record: its own statistic
    want = wb.clipped_grad_sum(one, loss, x[:1], y[:1], C, method="microbatch")
    got = wb.clipped_grad_sum(one, loss, x[:1], y[:1], C, method="einsum")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed: pip install '.[realmodels]'")
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_hf_nystromformer_is_refused(method, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from workbench.realzoo.imports import import_transformers

    tf = import_transformers()
    cfg = tf.NystromformerConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32,
                                 max_position_embeddings=32, num_landmarks=2,
                                 segment_means_seq_len=6, conv_kernel_size=3, num_labels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    hf = tf.NystromformerForSequenceClassification(cfg).double().eval()

    class Ids(nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            return self.hf(input_ids=ids).logits

    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(2, 32, (3, 6), generator=g), torch.randint(0, 3, (3,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(wb.SampleMixingError, match="modeling_nystromformer.py"):
            wb.clipped_grad_sum(Ids(), lambda o, t: nn.functional.cross_entropy(
                o, t, reduction="none"), ids, y, C, method=method)


class Shifted(DetachedMax):
    """A global max subtracted before a softmax: shift-invariant, so no gradient flows
    through the max (refused until the gradient was measured, 2026-11-30). (DetachedMax's
    layers; its detached max is the halves check's.)"""

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.softmax(h - h.max(), -1))


class TimeMajorPool(nn.Module):
    """A max over dim 0 that is time, not the records (T == n here): never the batch's rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):  # x (n, T, 4)
        h = torch.tanh(self.a(x)).transpose(0, 1)  # (T, n, 6)
        return self.b(h.max(dim=0).values)


class LoopPool(TimeMajorPool):
    """Each record's own positions pooled in a Python loop (a record of n valid rows)."""

    def forward(self, x):
        h = torch.tanh(self.a(x))
        valid = x.abs().sum(-1) > 0
        return self.b(torch.stack([h[i][valid[i]].max(0).values for i in range(len(x))]))


@pytest.mark.parametrize("make", [Shifted, TimeMajorPool, LoopPool])
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_no_statistic_over_the_records_is_seen_where_there_is_none(make, method):
    g = torch.Generator().manual_seed(3)
    if make is Shifted:
        x, y = data()
    else:
        x = torch.randn(4, 4, 4, generator=g, dtype=torch.float64)  # T == n == 4
        x[2, 2:] = 0  # record 2: 2 valid rows
        y = torch.randn(4, 2, generator=g, dtype=torch.float64)
    m = make().double()
    want = wb.clipped_grad_sum(m, loss, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(m, loss, x, y, C, method=method, check="always")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)
    assert run_optimizer(make().double(), "auto", x, y)  # the optimizer too: no error
