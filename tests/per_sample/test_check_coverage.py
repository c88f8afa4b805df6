"""What the self-check sees beyond its probed record (found by a probe of the functional API,
2026-11-29; each was silent before):

- a batch of one record was never checked (``known`` skipped n < 2), and Poisson sampling
  draws such batches: a rule off by 2x passed there in every method and in the optimizer;
- the probe compares record n - 1 alone, so a loss normalised by a statistic held by that
  record (``/ y.abs().max()``) agreed with it, and a rule wrong only for other rows too:
  the loss now runs on each half of the batch (``selfcheck.check_separable``) and einsum's
  per-sample gradients are summed against the batch's own gradient
  (``selfcheck.compare_sums``);
- ``method="vmap"`` dropped a loss term reading a parameter (an L2 term in loss_fn): the
  parameters are swapped over the loss too.

The reference: float64, one record at a time, clipped and summed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.dpsgd import DPOptimizer
from workbench.errors import LossCouplingError, PerSampleCheckError

C = 0.5


class Scaled(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x) * self.weight + self.bias


class TwiceScaled(Scaled):  # its registered rule is off by 2 on the weight
    pass


class FirstRowWrong(Scaled):  # its registered rule is off on row 0 only
    pass


@wb.register_grad_sampler(TwiceScaled)
def _twice(layer, activations, backprops):
    a, b = activations[0], backprops
    return {"weight": 2 * torch.tanh(a) * b, "bias": b}


@wb.register_grad_sampler(FirstRowWrong)
def _first_row(layer, activations, backprops):
    a, b = activations[0], backprops
    w = torch.tanh(a) * b
    w = torch.cat([3 * w[:1], w[1:]])
    return {"weight": w, "bias": b}


def model(cls):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), cls(4), nn.Linear(4, 2)).double()


def loss(out, y):
    return (out - y).pow(2).sum(1)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randn(n, 2, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_wrong_rule_is_caught_in_a_batch_of_one(method):
    x, y = data(1)
    with pytest.raises(PerSampleCheckError):
        wb.clipped_grad_sum(model(TwiceScaled), loss, x, y, C, method=method)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping", "auto"])
def test_the_optimizer_checks_a_batch_of_one(mode):
    m = model(TwiceScaled)
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    try:
        x, y = data(1)
        opt.zero_grad()
        loss(m(x), y).sum().backward()
        with pytest.raises(PerSampleCheckError):
            opt.step()
    finally:
        opt.detach()


def test_a_batch_of_one_verdict_serves_no_larger_batch():
    m = model(Scaled)  # the elementwise rule of its parent class: none, vmap
    wb.clipped_grad_sum(m, loss, *data(1), C, method="einsum")
    wb.clipped_grad_sum(m, loss, *data(6), C, method="einsum")  # checked afresh, passes


def test_a_rule_wrong_for_a_row_the_probe_does_not_see_is_caught_by_the_sum():
    with pytest.raises(PerSampleCheckError, match="do not sum to the batch's own gradient"):
        wb.per_sample_gradients(model(FirstRowWrong), loss, *data(6), method="einsum")


@pytest.mark.parametrize("where", [0, 5])
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_loss_normalised_by_a_batch_statistic_is_refused_wherever_it_sits(method, where):
    x, y = data(6)
    y[where] = 10.0  # the maximum: in the probed record (5) or not (0)

    def normalised(out, t):
        return (out - t).pow(2).sum(1) / t.abs().max()

    with pytest.raises(LossCouplingError, match="statistic of the"):  # the window's follower
        wb.clipped_grad_sum(model(Scaled), normalised, x, y, C, method=method)  # or halves


@pytest.mark.filterwarnings("ignore:per-sample gradients of 2.weight")  # micro-batched
@pytest.mark.parametrize("method", ["microbatch", "vmap", "einsum", "ghost", "bookkeeping"])
def test_a_loss_reading_a_parameter_is_exact_in_every_method(method):
    m = model(Scaled)
    x, y = data(5)

    def with_l2(out, t):
        return loss(out, t) + 0.1 * m[2].weight.pow(2).sum()

    got = wb.clipped_grad_sum(m, with_l2, x, y, C, method=method)
    params = list(m.parameters())
    want = [torch.zeros_like(p) for p in params]
    for i in range(5):
        g = torch.autograd.grad(with_l2(m(x[i:i + 1]), y[i:i + 1]).sum(), params)
        norm = torch.sqrt(sum((t ** 2).sum() for t in g))
        for w, t in zip(want, g):
            w += min(1.0, C / float(norm)) * t
    for (name, _), w in zip(m.named_parameters(), want):
        torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12)


def test_vmap_refuses_a_parameter_the_loss_holds_itself():
    m = model(Scaled)
    held = m[2].weight  # captured: vmap cannot swap it

    def with_l2(out, t):
        return loss(out, t) + 0.1 * held.pow(2).sum()

    with pytest.raises(wb.UnsupportedLayerError, match="2.weight through a reference"):
        wb.per_sample_gradients(m, with_l2, *data(5), method="vmap")


class WrongAxisNorm(Scaled):  # its norm rule sums over the batch, returning (T,)
    pass


@wb.register_norm_sampler(WrongAxisNorm)
def _wrong_axis(layer, activations, backprops):
    return (torch.tanh(activations[0]) * backprops).sum(0).pow(2).sum(-1)


@pytest.mark.parametrize("method", ["ghost", "bookkeeping"])
def test_a_norm_rule_of_the_wrong_shape_is_named(method):
    """Ghost uses the registered norm rule and names it; book-keeping streams this layer by
    what it computes (tanh(x) * w + b: the norm+activation rule, 2026-12-01), so the wrong
    rule is never read and the sum is exact."""
    m = nn.Sequential(nn.Linear(4, 4), WrongAxisNorm(4), nn.Flatten(), nn.Linear(20, 2)).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    y = torch.randn(3, 2, dtype=torch.float64)
    if method == "ghost":
        with pytest.raises(PerSampleCheckError,
                           match="norm sampler registered for WrongAxisNorm"):
            wb.clipped_grad_sum(m, loss, x, y, C, method=method)
        return
    got = wb.clipped_grad_sum(m, loss, x, y, C, method=method)
    want = wb.clipped_grad_sum(m, loss, x, y, C, method="microbatch")
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12)


def test_a_forward_given_as_a_property_does_not_inherit_the_parents_rule():
    from workbench.per_sample.registry import find_grad_sampler

    class Doubled(nn.Linear):
        forward = property(lambda self: lambda x: F.linear(x, 2 * self.weight, self.bias))

    assert find_grad_sampler(Doubled(3, 2)) is None
    assert find_grad_sampler(nn.Linear(3, 2)) is not None


class TupleNorm(nn.Module):  # IBert's IntLayerNorm in float mode: no rule, (x, scale)
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(8))
        self.bias = nn.Parameter(0.1 * torch.randn(8))

    def forward(self, x):
        y = x - x.mean(axis=2, keepdim=True)
        var = torch.mean(y ** 2, axis=2, keepdim=True)
        return y / torch.sqrt(1e-5 + var) * self.weight + self.bias, None


class TupleLinear(nn.Module):  # IBert's QuantLinear in float mode: F.linear by keyword
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(8, 8))
        self.bias = nn.Parameter(0.1 * torch.randn(8))

    def forward(self, x):
        return F.linear(x, weight=self.weight, bias=self.bias), None


class TupleEmbedding(nn.Module):  # IBert's QuantEmbedding in float mode
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 8))

    def forward(self, ids):
        return F.embedding(ids, weight=self.weight), None


class IBertLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.n, self.q, self.h = TupleEmbedding(), TupleNorm(), TupleLinear(), \
            nn.Linear(8, 3)

    def forward(self, ids):
        x = self.n(self.e(ids)[0])[0]
        return self.h(torch.tanh(self.q(x)[0]).mean(1))


@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_functional_layer_only_the_probe_records_is_not_a_crash(method):
    """The probe's one-record pass recorded the F.linear inside TupleLinear as a layer of
    its own, which the batch's pass had not: a bare KeyError in every mode with the check on
    until 2026-11-29 (the probe's recorder shared the batch's table of layers)."""
    torch.manual_seed(0)
    m = IBertLike().double()
    x = torch.randint(0, 32, (5, 5), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 3, (5,), generator=torch.Generator().manual_seed(3))

    def loss(out, t):
        return F.cross_entropy(out, t, reduction="none")

    want = wb.clipped_grad_sum(m, loss, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(m, loss, x, y, C, method=method, check="always")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=method.replace(
                          "ghost", "auto"), loss_reduction="sum")
    try:
        for step, n in enumerate((3, 1, 5, 2)):  # Poisson sizes: a new signature each
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randint(2, 32, (n, 5), generator=g), torch.randint(0, 3, (n,),
                                                                          generator=g)
            want = wb.clipped_grad_sum(m, loss, x, y, C, method="microbatch")
            opt.zero_grad()
            loss(m(x), y).sum().backward()
            opt.step()
            for k, p in m.named_parameters():
                torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
    finally:
        opt.detach()


class DetachedMax(nn.Module):
    """Scales its features by their largest magnitude over the whole batch, detached: the
    probe's record alone agreed where that record held the maximum (silent until
    2026-11-29)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h / h.abs().max().detach())


def last_holds_the_maximum(n=6):
    x, y = data(n)
    x[-1] = 20.0  # record n - 1, the probed one, holds the batch's maximum
    return x, y


@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_detached_batch_statistic_in_the_forward_is_refused(method):
    with pytest.raises(wb.SampleMixingError, match="couples the records"):
        wb.clipped_grad_sum(DetachedMax().double(), loss, *last_holds_the_maximum(), C,
                            method=method)


@pytest.mark.parametrize("mode", ["microbatch", "vmap", "einsum", "bookkeeping", "auto"])
def test_the_optimizer_refuses_a_detached_batch_statistic(mode):
    m = DetachedMax().double()
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    try:
        x, y = last_holds_the_maximum()
        opt.zero_grad()
        loss(m(x), y).sum().backward()
        with pytest.raises(wb.SampleMixingError, match="couples the records"):
            opt.step()
    finally:
        opt.detach()


@pytest.mark.parametrize("case", ["empty", "lengths"])
@pytest.mark.parametrize("method", ["microbatch", "vmap", "einsum"])
def test_argument_errors_are_named_in_every_method(method, case):
    """method='vmap' read them as a model needing its batch (a SampleMixingError) until
    2026-11-29."""
    x, y = (torch.zeros(0, 4), torch.zeros(0, 2)) if case == "empty" else \
        (torch.zeros(4, 4), torch.zeros(3, 2))
    m = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="empty batch|different batch sizes") as info:
        wb.per_sample_gradients(m, loss, x, y, method=method)
    assert not isinstance(info.value, wb.SampleMixingError)
