"""A model output computed over the whole batch that the per-record loss reads: a router's
load-balancing term (Mixtral's ``aux_loss`` with ``output_router_logits=True``), 0-dim or one
value per expert. Its gradient reaches the parameters through every record's rows, so no
per-record gradient of the batch's loss exists. Until 2026-12-02 the functional API's batched
methods accepted it wherever the self-check's tolerance hid it: a router computed in float32
inside a float64 model (as Hugging Face's routers are) passed ghost clipping at float32's
1e-3 while 59% off on Mixtral's router weight. The invariant: *a record's loss reaches the
parameters only through that record's rows*; one check per path enforces it in the functional
API and in the optimizer alike (``per_sample.checks.scalar_output_problem`` for a 0-dim
output, ``batch_reductions.refuse_reached`` for a sum or mean over the records in any output
of one or more dims). Micro-batching and vmap run each record alone, so the term is that
record's own: they stay exact against a one-record loop (their documented meaning).

The neighbours that are fine stay exact: the same term computed per record and returned with
one row per record, and a 0-dim output the loss never reads (a model's own ``loss`` beside
the logits)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.dpsgd import DPOptimizer

C = 0.5
E = 4


class Routed(nn.Module):
    """A body, a router whose probabilities are computed in ``router_dtype`` and a head;
    ``aux``: "scalar" (0-dim, Mixtral's shape), "vector" (one value per expert, (E,)),
    "rows" (each record's own term, (n,)), "unread" (0-dim, returned, never read)."""

    def __init__(self, aux, router_dtype=torch.float32, k=0.01):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.gate, self.head = nn.Linear(6, 8), nn.Linear(8, E), nn.Linear(8, 3)
        self.aux, self.router_dtype, self.k = aux, router_dtype, k

    def forward(self, x):
        h = torch.tanh(self.body(x))
        p = F.softmax(self.gate(h).to(self.router_dtype), -1).to(h.dtype)  # (n, E)
        chosen = F.one_hot(p.argmax(-1), E).to(p.dtype)  # no gradient
        if self.aux == "rows":
            term = self.k * E * (chosen * p).sum(1)  # record i's own, (n,)
        else:
            term = self.k * E * chosen.mean(0) * p.mean(0)  # over the batch, (E,)
            if self.aux != "vector":
                term = term.sum()
        return self.head(h), term


def reads_aux(out, y):
    logits, term = out
    extra = term if term.dim() == 1 and term.shape[0] == y.shape[0] else term.sum()
    return F.cross_entropy(logits, y, reduction="none") + extra


def logits_only(out, y):
    return F.cross_entropy(out[0], y, reduction="none")


def data(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,),
                                                                                generator=g)


def one_at_a_time(model, loss_fn, x, y):
    """g_i of each record run alone, float64, written here (not the library's microbatch)."""
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                list(params.values())) for i in range(len(x))]
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


@pytest.mark.parametrize("router_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_scalar_over_the_batch_read_by_the_loss_is_refused(method, router_dtype):
    m = Routed("scalar", router_dtype).double()
    with pytest.raises(wb.LossShapeError, match="0-dim output of the model"):
        wb.clipped_grad_sum(m, reads_aux, *data(), C, method=method)
    with pytest.raises(wb.LossShapeError, match="0-dim output of the model"):
        wb.per_sample_grad_norms(m, reads_aux, *data(), method="ghost" if method == "ghost"
                                 else "einsum")


@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_a_vector_over_the_batch_read_by_the_loss_is_refused(method):
    m = Routed("vector").double()
    with pytest.raises(wb.SampleMixingError, match="mean over dim 0 \\(the records\\)"):
        wb.clipped_grad_sum(m, reads_aux, *data(), C, method=method)


@pytest.mark.parametrize("aux", ["scalar", "vector"])
@pytest.mark.parametrize("mode", ["vmap", "einsum", "bookkeeping", "auto"])
def test_the_optimizer_refuses_both(aux, mode):
    m = Routed(aux).double()
    x, y = data()
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=8.0, method=mode,
                      loss_reduction="sum")
    try:
        with pytest.raises((wb.LossShapeError, wb.SampleMixingError)):
            opt.zero_grad()
            reads_aux(m(x), y).sum().backward()
            opt.step()
    finally:
        opt.detach()


def test_microbatching_runs_each_record_alone():
    """The twin's meaning: record i's loss with record i alone (its router term over one
    record), exact against the one-record loop. (The vector's rows are sliced as records by
    the twin's loss check, which then refuses the loss as coupled: a clear error too.)"""
    m = Routed("scalar").double()
    x, y = data()
    want = one_at_a_time(m, reads_aux, x, y)
    got = wb.per_sample_gradients(m, reads_aux, x, y, method="microbatch")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("aux,loss_fn", [("rows", reads_aux), ("unread", logits_only),
                                         ("scalar", logits_only)])
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_per_record_terms_and_unread_scalars_stay_exact(aux, loss_fn, method):
    m = Routed(aux, torch.float64).double()  # a float32 router: exact to float32's rounding
    x, y = data()
    want = wb.clipped_grad_sum(m, loss_fn, x, y, C, method="microbatch")
    got = wb.clipped_grad_sum(m, loss_fn, x, y, C, method=method, check="always")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)
