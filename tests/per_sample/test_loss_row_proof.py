"""The functional API's loss window proves a per-record loss by its ops (``dpsgd/loss_rows.py``,
as the optimizer does) and then skips the Jacobian test's two backward passes
(``recording.loss_rows_coupled``); every loss that reads another record's rows with gradient
is left unproved, so the test still runs on it and refuses it.

Invariant: record i's loss has gradient on record i's rows of the outputs alone. The proof
covers what losses are made of (elementwise ops, reductions along other dims than 0, loss
functions, gathers along dim 1); anything else (a product over the records, a roll, a flip, a
permutation, a distance between records, a stack of rows, a transpose) is left to the test.
Legitimate losses are compared with micro-batching in float64; coupled ones must be refused
with the check on and off."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import RTOL
from workbench.errors import LossCouplingError
from workbench.per_sample import recording

N = 5


def assert_close(got, want):
    torch.testing.assert_close(got, want, rtol=RTOL[torch.float64], atol=1e-12)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,),
                                                                              generator=g)


def _straight_through_cumsum(o, y):
    s = o.sum(1).cumsum(0)
    return o.pow(2).sum(1) + 1e-3 * (s - s.detach())  # zero in value, coupled in gradient


COUPLED = {
    "gram": lambda o, y: (o @ o.T).sum(1),
    "roll": lambda o, y: o.roll(1, 0).pow(2).sum(1),
    "flip": lambda o, y: o.flip(0).pow(2).sum(1),
    "permutation": lambda o, y: o[torch.tensor([1, 0, 2, 3, 4])].pow(2).sum(1),
    "cdist": lambda o, y: torch.cdist(o, o).sum(1),
    "cumsum, cancelled in value": _straight_through_cumsum,
    "centred over the records": lambda o, y: (o - o.mean(0)).pow(2).sum(1),
    "softmax over the records": lambda o, y: F.log_softmax(o, 0).sum(1),
    "row 0 subtracted": lambda o, y: (o - o[:1]).pow(2).sum(1),
    "batch mean added": lambda o, y: o.pow(2).sum(1) + o.pow(2).mean(),
    "rows stacked reversed": lambda o, y: torch.stack([o[i] for i in range(N - 1, -1, -1)])
    .pow(2).sum(1),
    "sum over the records broadcast": lambda o, y: (o * o.sum(0, keepdim=True)).sum(1),
}

LEGIT = {
    "cross-entropy": lambda o, y: F.cross_entropy(o, y, reduction="none"),
    "cross-entropy + output penalty": lambda o, y: F.cross_entropy(o, y, reduction="none")
    + 0.1 * o.pow(2).sum(1),
    "mse over one-hot": lambda o, y: F.mse_loss(o, torch.eye(3, dtype=o.dtype)[y],
                                                reduction="none").mean(1),
    "log-softmax gathered": lambda o, y: -F.log_softmax(o, 1).gather(1, y[:, None]).squeeze(1),
    "reshape and sum": lambda o, y: (o * 2).reshape(len(o), -1).sum(1),
}


@pytest.fixture
def tests_run(monkeypatch):
    count = {"n": 0}
    original = recording.loss_rows_coupled

    def counted(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(recording, "loss_rows_coupled", counted)
    return count


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
@pytest.mark.parametrize("name", sorted(COUPLED))
def test_a_loss_reading_other_records_rows_is_refused(name, method, check):
    x, y = batch()
    with pytest.raises(LossCouplingError):
        if method == "einsum":
            wb.per_sample_gradients(model(), COUPLED[name], x, y, method=method, check=check)
        else:
            wb.clipped_grad_sum(model(), COUPLED[name], x, y, 1.0, method=method, check=check)


@pytest.mark.parametrize("name", sorted(LEGIT))
def test_a_proved_per_record_loss_is_exact_without_the_jacobian_test(name, tests_run):
    x, y = batch()
    want = wb.per_sample_gradients(model(), LEGIT[name], x, y, method="microbatch")
    tests_run["n"] = 0
    for method in ("einsum", "vmap"):
        got = wb.per_sample_gradients(model(), LEGIT[name], x, y, method=method)
        for k in want:
            assert_close(got[k], want[k])
    got = wb.clipped_grad_sum(model(), LEGIT[name], x, y, 0.5, method="ghost")
    ref = wb.clipped_grad_sum(model(), LEGIT[name], x, y, 0.5, method="microbatch")
    for k in ref:
        assert_close(got[k], ref[k])
    assert tests_run["n"] == 0  # proved by its ops in every batched method


def test_an_unproved_legitimate_loss_still_passes_the_test(tests_run):
    """A transpose moves the records to dim 1, where the proof stops: the test runs, and a
    per-record sum over the features, read through ``o.t()``, passes it."""
    x, y = batch()
    fn = lambda o, y: o.t().sum(0)  # noqa: E731
    got = wb.per_sample_gradients(model(), fn, x, y, method="einsum")
    want = wb.per_sample_gradients(model(), fn, x, y, method="microbatch")
    for k in want:
        assert_close(got[k], want[k])
    assert tests_run["n"] >= 1


def test_a_gradient_hook_in_the_loss_leaves_the_loss_to_the_test(tests_run):
    """A hook registered in the window may combine rows in the backward pass whatever the ops
    did: the proof is not used, the test runs (and finds a hook mixing the records)."""
    x, y = batch()

    def fn(o, y):
        o = o * 1.0
        o.register_hook(lambda g: g + g.roll(1, 0))
        return F.cross_entropy(o, y, reduction="none")

    with pytest.raises(LossCouplingError):
        wb.per_sample_gradients(model(), fn, x, y, method="einsum")
    assert tests_run["n"] >= 1
