"""A Python number read from the batch in the loss window carries where it came from
(``loss_terms.BatchNumber``), through Python's arithmetic, into any op of the window: a loss
scaled by it weights every record by the others (probe AL: ``loss * (1 + (y == 0).mean()
.item())`` released 1.21-1.50x the clipped sum, ``loss / loss.item()`` 0.84-0.93x, silently,
until 2026-12-02). Logging such numbers, or scaling by numbers of no batch, stays exact.

Invariant: the released sum is Σ_i clip(g_i) of per-record losses whose weights depend on no
other record. Each case runs three steps, every optimizer mode, in float64, σ = 0; the exact
cases are compared with a one-record-at-a-time reference."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.dpsgd import MODES
from workbench.errors import LossCouplingError, UnsupportedLayerError

SCALED = {
    "1 + a statistic of the targets": lambda out, y, loss:
        loss * (1 + (y == 0).double().mean().item()),
    "the loss's own value": lambda out, y, loss: loss / loss.item(),
    "2 + the outputs' mean": lambda out, y, loss: loss * (2 + out.detach().mean().item()),
    "a record's output": lambda out, y, loss: loss * out[0, 0].item(),
    "a statistic, then math": lambda out, y, loss:
        loss * ((y == 1).double().mean().item() ** 2 + 0.5),
    # a count (an int), tolist(), rounding: carried too (BatchInt; 2026-12-02, evening)
    "1 + a count of the targets": lambda out, y, loss: loss * (1 + (y == 0).sum().item()),
    "1 + correct predictions / 8": lambda out, y, loss:
        loss * (1 + (out.argmax(1) == y).sum().item() / 8),
    "1 + tolist() of a statistic": lambda out, y, loss:
        loss * (1 + (y == 0).double().mean().tolist()),
    "1 + an element of tolist()": lambda out, y, loss:
        loss * (1 + out.detach().mean(0).tolist()[0]),
    "round, floor of an output mean": lambda out, y, loss:
        loss * round(1 + out.detach().mean().item(), 3) * math.floor(3 + out[0, 0].item()),
    # float(t): a plain number, followed by value (BatchStatistics.float_read)
    "float() of the loss": lambda out, y, loss: loss / float(loss),
    "1 + float() of an accuracy": lambda out, y, loss:
        loss * (1 + float((out.argmax(1) == y).double().mean())),
    "1 - float() of a statistic": lambda out, y, loss:
        loss * (1 - float((y == 0).double().mean())),
    "a sum over int() of a count": lambda out, y, loss:
        (F.cross_entropy(out, y, reduction="none") * (y != 0)).sum() / int((y != 0).sum()),
    "1e-3 + float() of the losses' std": lambda out, y, loss:
        loss / (1e-3 + float(F.cross_entropy(out, y, reduction="none").detach().std())),
}
LOGGED = {
    "accuracy logged": lambda out, y, loss, log: log.append(
        (out.argmax(1) == y).double().mean().item()) or loss,
    "loss logged, then a constant": lambda out, y, loss, log: log.append(loss.item()) or loss * 0.5,
    "a schedule's number": lambda out, y, loss, log: loss * (1.0 + 0.1 * len(log)),
    "float() of the accuracy logged": lambda out, y, loss, log: log.append(
        float((out.argmax(1) == y).double().mean())) or loss,
    "correct predictions counted": lambda out, y, loss, log: log.append(
        (out.argmax(1) == y).sum().item() + (log[-1] if log else 0)) or loss,
    "float() of the loss logged, then a constant": lambda out, y, loss, log: log.append(
        float(loss)) or loss * 0.5,
}


def run(term, mode, logged=False):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 6, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (40,), generator=g))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=0.0, max_grad_norm=0.3, method=mode,
        sampling_generator=torch.Generator().manual_seed(3))
    log, worst = [], 0.0
    for x, y in (b for _, b in zip(range(3), loader)):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss = term(out, y, loss, log) if logged else term(out, y, loss)
        loss.backward()
        opt.step()
        if logged:  # against the reference: Σ_i clip(factor ∇ℓ_i) / B
            with torch.no_grad():
                for p, q in zip(ref.parameters(), before):
                    p.copy_(q)
            factor = {"loss logged, then a constant": 0.5,
                      "float() of the loss logged, then a constant": 0.5,
                      "a schedule's number": 1.0 + 0.1 * len(log)}.get(term.__name__, 1.0)
            total = [torch.zeros_like(p) for p in ref.parameters()]
            for i in range(len(x)):
                gi = torch.autograd.grad(factor * F.cross_entropy(ref(x[i:i + 1]), y[i:i + 1]),
                                         list(ref.parameters()))
                norm = torch.sqrt(sum(t.pow(2).sum() for t in gi))
                c = min(1.0, 0.3 / float(norm))
                for t, u in zip(total, gi):
                    t += c * u
            B = opt.expected_batch_size
            for p, t in zip(model.parameters(), total):
                worst = max(worst, float((p.grad - t / B).norm() / (t / B).norm()))
    return worst


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(SCALED))
def test_a_loss_scaled_by_a_number_read_from_the_batch_is_refused(case, mode):
    with pytest.raises(LossCouplingError, match="read (from|by|back)"):
        run(SCALED[case], mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(LOGGED))
def test_numbers_logged_or_of_no_batch_stay_exact(case, mode):
    term = LOGGED[case]
    term.__name__ = case
    assert run(term, mode, logged=True) < 1e-9


FUNCTIONAL = {
    "1 + float() of an accuracy": lambda o, t: F.cross_entropy(o, t, reduction="none") * (
        1 + float((o.argmax(1) == t).double().mean())),
    "1 + a count's item()": lambda o, t: F.cross_entropy(o, t, reduction="none") * (
        1 + (t == 0).sum().item()),
    "tolist() of the outputs' mean": lambda o, t: F.cross_entropy(o, t, reduction="none") * (
        2 + o.detach().mean().tolist()),
}


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("method", ["vmap", "einsum", "ghost", "bookkeeping"])
@pytest.mark.parametrize("case", sorted(FUNCTIONAL))
def test_the_functional_api_refuses_a_loss_scaled_by_a_number_read_from_the_batch(
        case, method, check):
    """(Micro-batching runs loss_fn on each record alone: the number is the record's own.
    vmap cannot read a number at all: UnsupportedLayerError.)"""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (13,), generator=g)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with pytest.raises(LossCouplingError if method != "vmap" else (
            LossCouplingError, UnsupportedLayerError)):
        wb.clipped_grad_sum(model, FUNCTIONAL[case], x, y, 1.0, method=method, check=check)
