"""The functional API's loss_fn followed op by op, as the optimizer follows a loop's loss
(``per_sample.recording.loss_coupling``): a per-record loss that reads a statistic of the
whole batch is refused by its structure, not only by the halves check's values.

The invariant: *record i's loss is a function of record i alone*. Until 2026-12-02 the
functional API saw a loss_fn's batch statistics only through ``selfcheck.check_separable``,
which compares loss values at the pass's tolerance; a model computing partly in float32 has
float32's (1e-3), so a router's balance term times 1e-4 (the losses moved by 2.4e-5) passed
ghost clipping, book-keeping and einsum, while the optimizer (``dpsgd/loss_terms.py``) and
micro-batching refused it. The family: the optimizer's table of batch statistics
(``tests/dpsgd/test_invariant_statistics.py``) written as per-record losses, each at full
size and scaled down to 1e-4 beside the record's own loss, and a reduction over the records
with gradient (a balance term on the batch's mean probabilities). Their neighbours stay
exact against micro-batching: per-record normalisations, constants, an accuracy logged from
the outputs, and a global max subtracted before a softmax (shift-invariant: no gradient
flows through it).

Probe AH (the same day) found the next ring: couplings with gradient that no reduction shows
(a Gram matrix, a roll, a cdist, a cumulative sum whose value a straight-through term
cancels), accepted at 1e-4 under float32's tolerance and at any size with ``check=False``.
``recording.loss_rows_coupled`` sees them all by the loss's Jacobian: record i's loss has
gradient on record i's rows alone, so ∂(Σ u_i L_i)/∂o_j = u_j ∂(Σ L_i)/∂o_j."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.errors import LossCouplingError

C = 0.5
W = torch.tensor([0.3, 2.0, 1.0, 0.7], dtype=torch.float64)


class Mixed(nn.Module):
    """float64 parameters; the head's scores computed in float32 (as Hugging Face's routers
    and norms are), so the pass's tolerance is float32's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 4)
        self.double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).float().softmax(1).log().double()


def data(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (n,), generator=g))


def ce(o, t):
    return F.nll_loss(o, t, reduction="none")  # o: log-probabilities


STATISTICS = {  # o (n, 4) log-probabilities, t (n,) -> a term reading the whole batch
    "label weights over their sum": lambda o, t: W[t] * ce(o, t) / W[t].sum(),
    "ignore count": lambda o, t: ce(o, t) * (t != 2) / (t != 2).sum(),
    "ignore count as a number": lambda o, t: ce(o, t) / float((t != 2).sum()),
    "batch max of targets": lambda o, t: (o[:, 0] - t.double() / t.max()) ** 2,
    "detached loss sum": lambda o, t: ce(o, t) / ce(o, t).detach().sum(),
    "norm of detached outputs": lambda o, t: ce(o, t) * o.detach().norm(),
    "targets centred": lambda o, t: (o[:, 0] - (t - t.double().mean())) ** 2,
    "softmax over the batch of detached scores": lambda o, t: ce(o, t) * o.detach()[:, 0]
    .softmax(0),
    "a scale chosen by an if on the labels": lambda o, t: (1.0 if (t == 2).any() else 3.0)
    * ce(o, t),
    "router balance: counts times mean probabilities": lambda o, t: ce(o, t) + 4 * (
        F.one_hot(o.argmax(1), 4).double().mean(0) * o.exp().mean(0)).sum(),
    "router balance: squared mean probabilities": lambda o, t: ce(o, t) + 4 * (
        o.exp().mean(0) ** 2).sum(),
}


def small(term):
    """The record's own loss plus 1e-4 of the coupled one: under float32's 1e-3."""
    return lambda o, t: ce(o, t) + 1e-4 * term(o, t)


@pytest.mark.parametrize("scale", ["full", "1e-4"])
@pytest.mark.parametrize("case", sorted(STATISTICS))
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_loss_reading_the_whole_batch_is_refused(method, case, scale):
    loss_fn = STATISTICS[case] if scale == "full" else small(STATISTICS[case])
    with pytest.raises(LossCouplingError, match="statistic of the|loss_fn couples"):
        wb.clipped_grad_sum(Mixed(), loss_fn, *data(), C, method=method)


FINE = {
    "per-record mask count": lambda o, t: ce(o, t) * (t != 2) / 3.0,
    "label weights, a constant denominator": lambda o, t: W[t] * ce(o, t) / 4.0,
    "an accuracy logged from the outputs": lambda o, t: ce(o, t) * (
        1.0 + 0.0 * float((o.argmax(1) == t).sum())),
    "a global max subtracted before the softmax": lambda o, t: F.cross_entropy(
        o - o.max(), t, reduction="none"),
}


@pytest.mark.parametrize("case", sorted(FINE))
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_per_record_and_constant_terms_stay_exact(method, case):
    m, (x, y) = Mixed(), data()
    want = wb.clipped_grad_sum(m, FINE[case], x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(m, FINE[case], x, y, C, method=method, check="always")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)  # float32 inside


ROWS = {  # o, t -> a term with gradient on other records' rows
    "cumulative sum cancelled in value": lambda o, t: (lambda s: s - (s + 0).detach())(
        o[:, 0].cumsum(0)),
    "softmax over the records": lambda o, t: o[:, 0].softmax(0),
    "Gram matrix": lambda o, t: (o @ o.T).sum(1),
    "roll": lambda o, t: (o - o.roll(1, 0)).pow(2).sum(1),
    "flip": lambda o, t: (o * o.flip(0)).sum(1),
    "cdist": lambda o, t: torch.cdist(o, o).sum(1),
    "contrastive over the batch": lambda o, t: -F.log_softmax(o @ o.T, dim=1).diagonal(),
    "balance on the probabilities the loss reads": lambda o, t: 4 * (o.exp().mean(0) ** 2)
    .sum() + 0 * o[:, 0],
}


def own_and(term, scale):
    return lambda o, t: ce(o, t) + scale * term(o, t)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("case", sorted(ROWS))
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_loss_reading_other_records_rows_is_refused_with_or_without_the_check(
        method, case, check):
    """float64 at 1e-4 (a value check at float64's tolerance sees some; the Jacobian all),
    with and without the self-check."""
    m, (x, y) = Mixed(), data()
    m.forward = lambda z: torch.log_softmax(m.b(torch.tanh(m.a(z))), 1)  # float64 inside
    with pytest.raises(LossCouplingError, match="couples the records|statistic of the"):
        wb.clipped_grad_sum(m, own_and(ROWS[case], 1e-4), x, y, C, method=method,
                            check=check)


@pytest.mark.parametrize("case", sorted(ROWS))
def test_full_strength_couplings_are_refused_in_float32_without_the_check(case):
    with pytest.raises(LossCouplingError, match="couples the records|statistic of the"):
        wb.clipped_grad_sum(Mixed(), own_and(ROWS[case], 1.0), *data(), C, method="ghost",
                            check=False)
