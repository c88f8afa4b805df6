"""Which loss call sets each record's factor (``loss_watch._exit``, ``_factors``), and the
records a loss averages over (probe AI, 2026-12-02: every loss in ``torch.nn``, module and
functional, over several steps; six silent cases, each tested here with its neighbours).

- A loss module with ``reduction="none"`` reduces nothing: the loop's reduction decides,
  never the module's weighted mean (its D / N_i had been applied to ``l.mean()``).
- A user's criterion around torch's losses counts as those losses, at any depth: its
  ``F.cross_entropy(o, y)`` divides by the non-ignored count.
- torch's own entry point under ``F.cross_entropy`` called directly is that loss.
- Rows that are not record-major (a time-major flattening) cannot take per-record
  denominators: refused where the mean has class weights or ignored positions.
- A mean over the records a mask of the data kept divides by their count: refused; their
  sum passes.
- Anything computed from a reduction with gradient, detached later, is a statistic.
Every accepted case is checked against the float64 per-record twin over steps whose later
batches hold what the first did not (ignored labels), every refused one names the cause.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dpsgd.test_invariant import C, mlp
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import LossCouplingError

N, D, K, V, T = 6, 5, 4, 7, 5
W = torch.tensor([0.3, 2.0, 1.0, 0.7], dtype=torch.float64)


def steps_of(seed=1, n=N, ignored=((), (0, 2), (1,))):
    """Batches (x, y) whose later ones carry ignored labels (-100) the first does not."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for drop in ignored:
        x = torch.randn(n, D, generator=g, dtype=torch.float64)
        y = torch.randint(0, K, (n,), generator=g)
        y[list(drop)] = -100
        out.append((x, y))
    return out


def twin(model, own, x, y):
    params, total = list(model.parameters()), 0
    for i in range(x.shape[0]):
        g = torch.autograd.grad(own(model(x[i:i + 1]), y[i:i + 1]), params, allow_unused=True)
        g = torch.cat([torch.zeros_like(p).flatten() if t is None else t.flatten()
                       for p, t in zip(params, g)])
        total = total + min(1.0, C / max(float(g.norm()), 1e-300)) * g
    return total


def run(loss, own, mode="auto", reduction="mean", batches=None):
    """Each step's released sum against the twin of record i's own loss ``own``."""
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction=reduction)
    try:
        for x, y in batches or steps_of():
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            want = twin(model, own, x, y)
            assert float((got - want).norm()) <= 1e-9 * max(1.0, float(want.norm()))
    finally:
        opt.detach()


def own_mean(o, y):  # record i's own loss for a per-record mean (Eq. 1 of per_sample/loss.py)
    return F.cross_entropy(o, y, reduction="sum")


class Wrapped(nn.Module):  # a user's criterion around the functional loss
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, o, y):
        return F.cross_entropy(o, y, **self.options)


class Holding(nn.Module):  # a user's criterion holding torch's loss module
    def __init__(self):
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, o, y):
        return 2.0 * self.ce(o, y)


def own_weighted(o, y):  # one row per record: its class weight, no denominator (Eq. 1)
    return F.cross_entropy(o, y, weight=W, reduction="sum")


EXACT = {  # (the loop's loss, record i's own loss)
    "module 'none', then mean, ignored labels later": (
        lambda o, y: nn.CrossEntropyLoss(reduction="none")(o, y).mean(), own_mean),
    "NLL module 'none', then mean": (
        lambda o, y: nn.NLLLoss(reduction="none")(o.log_softmax(1), y).mean(),
        lambda o, y: F.nll_loss(o.log_softmax(1), y, reduction="sum")),
    "module 'none' with class weights, then mean": (
        lambda o, y: nn.CrossEntropyLoss(weight=W, reduction="none")(o, y).mean(),
        own_weighted),
    "user criterion wrapping F.cross_entropy": (Wrapped(), own_mean),
    "user criterion wrapping F.cross_entropy with class weights": (Wrapped(weight=W),
                                                                   own_weighted),
    "user criterion holding nn.CrossEntropyLoss": (Holding(),
                                                   lambda o, y: 2.0 * own_mean(o, y)),
    "torch._C._nn.cross_entropy_loss with weights": (
        lambda o, y: torch._C._nn.cross_entropy_loss(o, y, W, 1, -100, 0.0), own_weighted),
    "per-record means of the kept records, summed": (
        lambda o, y: o[y != -100].pow(2).mean(1).sum() + F.cross_entropy(
            o[y != -100], y[y != -100], reduction="sum"),
        lambda o, y: o.pow(2).mean(1).sum() * (y != -100).double().sum()
        + F.cross_entropy(o, y, reduction="sum")),
    "the sum over the records a mask kept": (
        lambda o, y: F.cross_entropy(o[y != -100], y[y != -100], reduction="sum"),
        lambda o, y: F.cross_entropy(o, y, reduction="sum")),
}


@pytest.mark.parametrize("mode", ["auto", "bookkeeping"])
@pytest.mark.parametrize("case", sorted(EXACT))
def test_each_record_takes_its_own_loss_over_the_steps(case, mode):
    loss, own = EXACT[case]
    run(loss, own, mode, reduction="sum" if "sum" in case else "mean")


def lm_batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (n, T), generator=g)
    y = torch.randint(0, V, (n, T), generator=g)
    y[torch.rand(n, T, generator=g) < 0.4] = -100
    return x, y


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, 4), nn.Linear(4, V)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


@pytest.mark.parametrize("spelling, n", [("flattened time-major", 3),
                                         ("flattened time-major", T),
                                         ("classes on dim 1, time-major", T)])
def test_time_major_rows_with_a_weighted_mean_are_refused(spelling, n):
    """The per-record denominators need record-major rows; at n = T the shapes agree (the
    (T, V, n) spelling runs only there: torch's own shape check refuses it otherwise)."""
    model = LM().double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0)
    x, y = lm_batches(n)
    try:
        o = model(x)
        with pytest.raises(LossCouplingError, match="not record-major"):
            if spelling == "flattened time-major":
                F.cross_entropy(o.transpose(0, 1).reshape(-1, V), y.T.reshape(-1)).backward()
            else:
                nn.CrossEntropyLoss()(o.permute(1, 2, 0), y.T).backward()
    finally:
        opt.detach()


REFUSED = {
    "mse over the records a mask kept": lambda o, y: F.mse_loss(
        o[y > 0, 0], y[y > 0].double()),
    "mean of the kept records' losses": lambda o, y: F.cross_entropy(
        o, y.clamp(min=0), reduction="none")[y != 1].mean(),
    "kept through nonzero": lambda o, y: o[(y > 0).nonzero()[:, 0]].pow(2).mean(),
    "kept through torch.where": lambda o, y: o[torch.where(y > 0)[0]].pow(2).mean(),
    "the kept records' sum over their count": lambda o, y: F.cross_entropy(
        o[y > 1], y[y > 1], reduction="sum") / len(y[y > 1]),
    "KL to the batch's mean, detached after expand_as": lambda o, y: F.kl_div(
        o.log_softmax(1), o.softmax(1).mean(0, keepdim=True).expand_as(o).detach(),
        reduction="batchmean"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_loss_over_a_data_dependent_set_of_records_is_refused(case):
    batches = steps_of(ignored=((),))
    with pytest.raises(LossCouplingError, match="statistic of the whole batch"):
        run(REFUSED[case], own_mean, batches=batches)
