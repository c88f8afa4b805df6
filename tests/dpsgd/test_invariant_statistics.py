"""The invariant when the loop normalises the loss by a statistic of the batch's *data*
(``dpsgd/loss_terms.py``): class weights by label over their batch sum, an ignore-index count,
a mask from targets or inputs, a batch scale of the targets, a detached loss sum. None of them
moves the output coupling test (the statistic carries no gradient), each moves the clipped
sum by more than C when one record is removed; the engine refuses them at ``loss.backward()``
in every mode, and accepts the per-record and constant normalisations next to them, exactly."""

import pytest
import torch
import torch.nn.functional as F

from tests.dpsgd.test_invariant import (
    ALL_MODES,
    C,
    W,
    assert_invariant,
    batch,
    mlp,
    released,
    twin,
)
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import LossCouplingError


def ce(o, t):
    return F.cross_entropy(o, t, reduction="none")  # (n,)


def masked(o, t):
    m = t != 2  # a label-derived mask (an ignore-index count)
    return (ce(o, t) * m).sum() / m.sum()


COUPLED = {  # name: the loop's batch loss
    "label weights over their sum": lambda o, t: (W[t] * ce(o, t)).sum() / W[t].sum(),
    "ignore count": masked,
    "ignore count as a number": lambda o, t: (ce(o, t) * (t != 2)).sum() / float((t != 2).sum()),
    "batch max of targets": lambda o, t: F.mse_loss(o[:, 0], t.double() / t.max()),
    "detached loss sum": lambda o, t: ce(o, t).sum() / ce(o, t).detach().sum(),
    "norm of detached outputs": lambda o, t: ce(o, t).mean() * o.detach().norm(),
    "targets centred": lambda o, t: F.mse_loss(o[:, 0], t - t.double().mean()),
    "inverse batch class frequency as weight=": lambda o, t: F.cross_entropy(
        o, t, weight=1.0 / (torch.bincount(t, minlength=4).double() + 1)),
    "softmax over the batch of detached logits": lambda o, t: (
        ce(o, t) * o.detach()[:, 0].softmax(0)).sum(),
    # silent until 2026-12-01: ``.data`` (not told from other properties), a fused batch norm
    # (a distillation teacher left in train mode), a reduction over the records moved to dim 1
    "loss mean over its .data": lambda o, t: ce(o, t).mean() / ce(o, t).mean().data,
    "soft targets through a train-mode batch norm": lambda o, t: F.cross_entropy(
        o, F.batch_norm(o.detach(), None, None, training=True).softmax(1)),
    "a scale chosen by an if on the labels": lambda o, t: (
        1.0 if (t == 2).any() else 3.0) * ce(o, t).mean(),
    "weights over the records of the transposed logits": lambda o, t: (
        ce(o, t) * o.detach().T.softmax(1)[0]).mean(),
}


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("case", sorted(COUPLED))
def test_batch_statistics_of_the_data_are_refused(case, mode):
    x, y = batch()
    with pytest.raises(LossCouplingError, match="statistic of the whole batch"):
        released(mlp(), COUPLED[case], x, y, mode)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_a_mask_from_the_inputs_is_refused(mode):
    x, y = batch()

    def loss(o, t):
        m = x[:, 0] > 0
        return (ce(o, t) * m).sum() / m.sum()

    with pytest.raises(LossCouplingError, match="sum\\(\\) over the records"):
        released(mlp(), loss, x, y, mode)


def unchecked(loss, x, y):
    """The released sum with the engine's checks off (``verify = False``, benchmarks only)."""
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method="einsum")
    opt.verify, opt.recorder.watch.check = False, False
    try:
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    finally:
        opt.detach()


@pytest.mark.parametrize("case", ["label weights over their sum", "ignore count"])
def test_the_refused_statistics_do_move_the_sum_by_more_than_c(case):
    """Why they are refused: with the engine's checks off, removing one record moves the
    released sum by more than C (the invariant's measure)."""
    x, _ = batch(n=6, seed=3)
    y = torch.tensor([0, 0, 0, 0, 2, 1])  # W[0] = 0.3 against W[1] = 2; one record not counted
    full = unchecked(COUPLED[case], x, y)
    moved = [float((full - unchecked(COUPLED[case], x[keep], y[keep])).norm())
             for keep in (torch.arange(6) != j for j in range(6))]
    assert max(moved) > C, moved


@pytest.mark.parametrize("mode", ["einsum", "vmap", "bookkeeping"])
def test_per_record_and_constant_normalisations_are_accepted_and_exact(mode):
    x, y = batch()
    T = 3
    tokens = torch.stack([y, (y + 1) % 4, y * 0 + 2], 1)  # (n, T) targets per position

    def per_record(o, t):  # each record's own mask count: a per-record mean, then a mean
        z = o[:, None, :].expand(-1, T, -1).reshape(-1, o.shape[1])
        m = (tokens != 2).double()
        per = (F.cross_entropy(z, tokens.reshape(-1), reduction="none").view(-1, T) * m)
        return (per.sum(1) / m.sum(1).clamp(min=1)).mean()

    ref_model = mlp()
    got = released(ref_model, per_record, x, y, mode)
    params = list(ref_model.parameters())
    ref = 0
    for i in range(x.shape[0]):  # the twin: record i's own per-record mean, alone
        o = ref_model(x[i:i + 1])
        z = o[:, None, :].expand(-1, T, -1).reshape(-1, o.shape[1])
        m = (tokens[i] != 2).double()
        li = (F.cross_entropy(z, tokens[i], reduction="none") * m).sum() / m.sum().clamp(min=1)
        g = torch.cat([t.flatten() for t in torch.autograd.grad(li, params)])
        ref = ref + min(1.0, C / float(g.norm())) * g
    assert float((got - ref).norm()) <= 1e-9 * float(ref.norm())


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_an_accuracy_count_next_to_a_constant_denominator_passes(mode):
    """An accuracy count read in the window (here equal to the constant) is the outputs', not
    a normalisation: the loss divided by the constant n is the ordinary mean, exact."""
    x, y = batch()

    def loss(o, t):
        correct = float((o.argmax(1) == t).sum())  # logged, as loops do
        assert correct >= 0
        return F.cross_entropy(o, t, reduction="sum") / 6

    # with a record removed (n = 5) the constant 6 is no longer n: under loss_reduction=
    # "mean" each g_i would carry n / 6 (refused, record_reduction.py); under "sum" the
    # constant is a constant
    assert_invariant(mlp, loss, lambda o, t: F.cross_entropy(o, t, reduction="sum") / 6, x, y,
                     mode, reduction="sum")
    model = mlp()
    assert torch.allclose(released(model, loss, x, y, mode),
                          twin(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y))


FUNCTIONAL = {  # per-record terms (n,) normalised by a statistic of the batch's data
    "label weights over their sum": lambda o, t: W[t] * ce(o, t) / W[t].sum(),
    "ignore count": lambda o, t: ce(o, t) * (t != 2) / (t != 2).sum(),
    "batch max of targets": lambda o, t: (o[:, 0] - t.double() / t.max()) ** 2,
}


@pytest.mark.parametrize("method", ["einsum", "ghost", "clipped"])
@pytest.mark.parametrize("case", sorted(FUNCTIONAL))
def test_functional_api_refuses_a_data_statistic_in_loss_fn(case, method):
    """The functional API calls loss_fn itself and follows it op by op as the optimizer
    follows a loop's loss (``per_sample.recording.loss_coupling``, the statistics' own
    message), before the loss on each half of the batch (``selfcheck.check_separable``) and
    the probe (record alone) can see it."""
    import workbench as wb
    from workbench.errors import LossCouplingError, PerSampleCheckError

    x, y = batch()
    with pytest.raises((PerSampleCheckError, LossCouplingError),
                       match="statistic of the whole batch"):
        if method == "einsum":
            wb.per_sample_gradients(mlp(), FUNCTIONAL[case], x, y, method=method)
        elif method == "ghost":
            wb.per_sample_grad_norms(mlp(), FUNCTIONAL[case], x, y, method=method)
        else:
            wb.clipped_grad_sum(mlp(), FUNCTIONAL[case], x, y, C)


# One record's rows against the other records' values without gradient (2026-12-02): no
# reduction over the records and no second derivative across them, so neither the statistics
# above nor the coupling test saw these; each was released at full strength.
CROSSED = {
    "Gram with a detached side": lambda o, t: (o @ o.detach().T).pow(2).mean(),
    "InfoNCE on detached keys": lambda o, t: F.cross_entropy(o @ o.detach().T,
                                                             torch.arange(len(o))),
    "mm with the detached side first": lambda o, t: torch.mm(o.detach(), o.T).pow(2).mean(),
    "einsum against detached rows": lambda o, t: torch.einsum(
        "ik,jk->ij", o, o.detach()).pow(2).mean(),
    "cosine similarity to every detached row": lambda o, t: F.cosine_similarity(
        o[:, None], o.detach()[None], dim=-1).mean(),
    "differences to every detached row": lambda o, t: (
        o[:, None] - o.detach().unsqueeze(0)).pow(2).mean(),
    "cdist to the detached outputs": lambda o, t: torch.cdist(o, o.detach()).mean(),
    "class sums of the detached outputs as targets": lambda o, t: F.mse_loss(
        o, F.one_hot(t, 4).double() @ (F.one_hot(t, 4).double().T @ o.detach())),
    "every record's targets broadcast": lambda o, t: (
        o[:, None, 0] - t.double()[None]).pow(2).mean(),
}


@pytest.mark.parametrize("mode", ["auto", "einsum", "bookkeeping"])
@pytest.mark.parametrize("case", sorted(CROSSED))
def test_a_record_against_the_others_values_is_refused(case, mode):
    x, y = batch()
    with pytest.raises(LossCouplingError, match="statistic of the whole batch"):
        released(mlp(), CROSSED[case], x, y, mode)


@pytest.mark.parametrize("case", ["InfoNCE on detached keys", "cdist to the detached outputs"])
def test_the_crossed_values_do_move_the_sum_by_more_than_c(case):
    x, y = batch(n=6, seed=3)
    full = unchecked(CROSSED[case], x, y)
    moved = [float((full - unchecked(CROSSED[case], x[keep], y[keep])).norm())
             for keep in (torch.arange(6) != j for j in range(6))]
    assert max(moved) > C * (1 + 1e-6), moved


P = torch.tensor([[1.0, 0.0, -1.0, 0.5], [0.0, 2.0, 0.0, -1.0], [0.3, 0.3, 0.3, 0.3]],
                 dtype=torch.float64)  # fixed prototypes: no record's data

UNCROSSED = {  # (the loop's loss, record i's own loss): each record against its own values
    "products with a fixed matrix": (lambda o, t: (o @ P.T).pow(2).mean(),
                                     lambda o, t: (o @ P.T).pow(2).sum() / 3),
    "cosine similarity to fixed prototypes": (
        lambda o, t: F.cosine_similarity(o[:, None], P[None], dim=-1).mean(),
        lambda o, t: F.cosine_similarity(o[:, None], P[None], dim=-1).sum() / 3),
    "per-record weights broadcast over the classes": (
        lambda o, t: (o.pow(2) * (t.double() + 1)[:, None]).mean(),
        lambda o, t: (o.pow(2) * (t.double() + 1)[:, None]).sum() / 4),
    "a record's own detached outputs": (
        lambda o, t: (o * o.detach().softmax(1)).sum(1).mean(),
        lambda o, t: (o * o.detach().softmax(1)).sum()),
}


@pytest.mark.parametrize("mode", ["auto", "bookkeeping"])
@pytest.mark.parametrize("case", sorted(UNCROSSED))
def test_a_record_against_its_own_or_fixed_values_is_exact(case, mode):
    x, y = batch()
    loss, own = UNCROSSED[case]
    assert_invariant(mlp, loss, own, x, y, mode)
