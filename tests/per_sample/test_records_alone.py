"""A model or loss that cannot run on one record alone couples the records: every exact
per-record gradient runs each record on its own (micro-batching, the self-check's probe, the
whole-model fallback), so such a model is refused by name (``checks.alone``), not with the
raw error it raised alone ("not enough values to unpack", "Expected input batch_size (0)"),
until 2026-11-29."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.dpsgd.test_invariant import ALL_MODES, C, batch
from workbench.dpsgd import DPOptimizer
from workbench.errors import SampleMixingError, UnsupportedLayerError

X, Y = batch(n=6)


class Halves(nn.Module):
    """The batch's first half through one layer, its second through another."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        x1, x2 = x.chunk(2)
        return torch.cat([self.a(x1), self.b(x2)])


class FirstTwo(nn.Module):
    """A layer on the batch's first two rows, padded back to n."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        return self.a(x) + F.pad(self.b(x[:2]), (0, 0, 0, x.shape[0] - 2))


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("method", wb.METHODS)
@pytest.mark.parametrize("cls", [Halves, FirstTwo])
def test_functional_api_refuses_a_model_that_needs_its_batch(cls, method):
    with pytest.raises((SampleMixingError, UnsupportedLayerError),
                       match="one record alone|cannot run this model|couples the records"):
        wb.per_sample_gradients(cls().double(), losses, X, Y, method=method)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("cls", [Halves, FirstTwo])
def test_optimizer_refuses_a_model_that_needs_its_batch(cls, mode):
    m = cls().double()
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.zero_grad()
            F.cross_entropy(m(X), Y, reduction="sum").backward()
            with pytest.raises(SampleMixingError, match="one record alone|couples the records"):
                opt.step()
    finally:
        opt.detach()


# A record alone is not the record in the batch: a layer applied to rows chosen by their
# place in the batch. Each exact twin runs the record alone (or probes record n - 1, past the
# slice), so only the batch's own gradient can show it: the functional API compares it with
# the fallback's sum on a checked call, the optimizer's path check compares `.grad`, which
# the skipped weight gradients left empty for such a call (b's clipped sum 0, every mode,
# check on or off, until 2026-11-29).


class PrefixLayer(nn.Module):
    """b on the first half of the batch's rows, added to a's output there."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        out, k = self.a(x), x.shape[0] // 2
        return torch.cat([out[:k] + self.b(x[:k]), out[k:]])


class EveryThird(nn.Module):
    """b on every third row, picked by a mask of the rows' places, added back in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        pick = torch.arange(x.shape[0]) % 3 == 0
        return self.a(x).index_put((pick.nonzero()[:, 0],), self.b(x[pick]), accumulate=True)


class AlsoOnASlice(nn.Module):
    """b on every row, then once more on the last two rows (a tapped layer called off the
    rows later in the same pass)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.b = nn.Linear(5, 4)

    def forward(self, x):
        out = self.b(x)
        return torch.cat([out[:-2], out[-2:] + self.b(x[-2:])])


class Routed(nn.Module):
    """b on the rows whose first feature is positive, chosen by each record's own data:
    a record alone is the record in the batch (a Mixture-of-Experts' routing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        pick = x[:, 0] > 0
        return self.a(x).index_put((pick.nonzero()[:, 0],), self.b(x[pick]), accumulate=True)


BY_PLACE = [PrefixLayer, EveryThird]


@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
@pytest.mark.parametrize("cls", BY_PLACE + [AlsoOnASlice])
def test_functional_api_refuses_rows_chosen_by_place(cls, method):
    with pytest.raises(SampleMixingError) as info:  # the halves, or the fallback's sum
        wb.clipped_grad_sum(cls().double(), losses, X, Y, C, method=method)
    message = str(info.value)
    assert "couples the records" in message or (
        "b.weight" in message and "dim 0 is not the batch" in message), message


def test_the_slow_twins_define_the_record_alone():
    """Micro-batching and whole-model vmap *are* the record alone (ARCHITECTURE, contract 2):
    b's gradient is 0 for every record there, as the model gives it one record at a time.
    A batch whose records interact has no record-alone answer that is the batch's, so by
    default they refuse it (``selfcheck.check_alone``, 2026-11-30); ``check=False`` asks for
    the record alone anyway."""
    for method in ("microbatch", "vmap"):
        with pytest.raises(SampleMixingError, match="couples the records"):
            wb.per_sample_gradients(PrefixLayer().double(), losses, X, Y, method=method)
        g = wb.per_sample_gradients(PrefixLayer().double(), losses, X, Y, method=method,
                                    check=False)
        assert float(g["b.weight"].abs().max()) == 0.0


def _step(m, mode, verify, zero):
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.verify = verify
    return opt


@pytest.mark.parametrize("zero", [True, False])
@pytest.mark.parametrize("verify", [True, "always"])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("cls", BY_PLACE)
def test_optimizer_refuses_rows_chosen_by_place(cls, mode, verify, zero):
    m = cls().double()
    opt = _step(m, mode, verify, zero)
    try:
        if zero:
            opt.zero_grad()  # arms the skipped weight gradients (skip_weights.py)
        F.cross_entropy(m(X), Y, reduction="sum").backward()
        with pytest.raises(SampleMixingError, match="in the batch than alone|couples the records"):
            opt.step()
    finally:
        opt.detach()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_tapped_layer_later_called_off_the_rows_is_refused_at_the_next_step(mode):
    """The first call was tapped before the second showed the slice: that step's .grad of b
    cannot be compared; the next step is checked with b untapped."""
    m = AlsoOnASlice().double()
    opt = _step(m, mode, True, True)
    try:
        with pytest.raises(SampleMixingError, match="in the batch than alone|couples the records"):
            for _ in range(2):
                opt.zero_grad()
                F.cross_entropy(m(X), Y, reduction="sum").backward()
                opt.step()
    finally:
        opt.detach()


@pytest.mark.filterwarnings("ignore:per-sample gradients of b.weight")  # micro-batched
@pytest.mark.parametrize("mode", ALL_MODES)
def test_rows_chosen_by_their_own_data_stay_exact(mode):
    from tests.dpsgd.test_invariant import released, twin

    def loss(out, y):
        return F.cross_entropy(out, y, reduction="sum")

    m = Routed().double()
    assert 0 < int((X[:, 0] > 0).sum()) < X.shape[0]
    ref = twin(m, loss, X, Y)
    for _ in range(2):  # the checked step and the unchecked one
        got = released(m, loss, X, Y, mode, reduction="sum")
        assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.filterwarnings("ignore:per-sample gradients of b.weight")
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_functional_api_keeps_rows_chosen_by_their_own_data(method):
    from tests.dpsgd.test_invariant import twin

    m = Routed().double()
    got = wb.clipped_grad_sum(m, losses, X, Y, C, method=method, check="always")
    flat = torch.cat([got[name].flatten() for name, _ in m.named_parameters()])
    ref = twin(m, lambda out, y: F.cross_entropy(out, y, reduction="sum"), X, Y)
    assert torch.allclose(flat, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["microbatch", "vmap", "einsum"])
def test_inputs_the_batch_cannot_take_either_keep_their_own_error(method):
    """A float32 input to a float64 model fails alone and in the batch alike: the user sees
    PyTorch's dtype error in every method, not a coupling refusal (microbatch) or "vmap cannot
    run this model" (until 2026-11-30)."""
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(RuntimeError, match="dtype") as caught:
        wb.per_sample_gradients(model, nn.CrossEntropyLoss(reduction="none"), x, y,
                                method=method)
    assert not isinstance(caught.value, wb.WorkbenchError)
