"""The optimizer's ``.grad`` check, one parameter at a time (``dpsgd/path_check.py``), and the
memory of the first, self-checked step it and the record probe (``selfcheck.probe_sketch``)
take part in."""

import warnings

import pytest
import torch
from torch import nn

from workbench.bench.peak_memory import peak_bytes, tensor_bytes
from workbench.dpsgd import DPOptimizer, path_check
from workbench.dpsgd.path_check import PathCheck, stats
from workbench.errors import UnattributedGradientError
from workbench.per_sample import selfcheck, sketch
from workbench.per_sample.recording import Recording

TOL64 = selfcheck.TOLERANCE[torch.float64]


def _direct(u, o, alpha):
    return float((u.double() - alpha * o.double()).pow(2).sum())


@pytest.mark.parametrize("chunk", [7, path_check.CHUNK])
def test_four_numbers_give_the_distance_at_every_factor(monkeypatch, chunk):
    """||u - α o||² = r + (α - α_p)² ||o||² for any α, from chunks of any size."""
    monkeypatch.setattr(path_check, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    u, o = (torch.randn(13, 5, generator=g, dtype=torch.float64) for _ in range(2))
    r, a, oo, uu = stats(u, o)
    assert uu == pytest.approx(float(u.pow(2).sum()), rel=1e-13)
    assert oo == pytest.approx(float(o.pow(2).sum()), rel=1e-13)
    for alpha in (-1.0, 0.0, 0.3, 1.0, 2.5):
        assert r + (alpha - a) ** 2 * oo == pytest.approx(_direct(u, o, alpha), rel=1e-12)
    r, a, oo, uu = stats(None, o)  # .grad None: u = 0
    assert (r, a, uu) == (0.0, 0.0, 0.0) and oo == pytest.approx(float(o.pow(2).sum()))
    r, a, oo, uu = stats(u, torch.zeros_like(u))  # no path: r = ||u||², no curvature
    assert oo == 0.0 and r == pytest.approx(uu)


def _params(k, n=300, dtype=torch.float64):
    g = torch.Generator().manual_seed(k)
    return {f"p{i}": nn.Parameter(torch.randn(n, generator=g, dtype=dtype)) for i in range(k)}


def _paths(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {id(p): torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params.values()}


def _checked(k, grad=lambda o: o.clone(), arrive=None, **options):
    """k parameters whose .grad is ``grad(Σ_i g_i)``, each path gradient added (those in
    ``arrive``: all by default) to a PathCheck(``options``): (params, check)."""
    params = _params(k)
    paths = _paths(params)
    for p in params.values():
        p.grad = grad(paths[id(p)])
    check = PathCheck(params, **options)
    for key in list(paths)[:arrive]:
        check.add(key, paths[key])
    return params, check


@pytest.mark.parametrize("hold", [False, True])
def test_a_rescaled_grad_passes_in_float64_over_many_parameters(hold):
    """.grad = 0.37 Σ_i g_i (clip_grad_norm_ after backward) over 400 float64 parameters, to
    1e-13: within float64's tolerance of 1e-7 relative. An expansion Σ ||u||² - 2α⟨u, o⟩ +
    α²||o||² would subtract numbers 1e16 times the result."""
    _, check = _checked(400, lambda o: 0.37 * o * (1 + 1e-13 * torch.randn_like(o)), hold=hold)
    check.verdict(TOL64)  # no error


@pytest.mark.parametrize("hold", [False, True])
def test_a_term_outside_the_output_is_named(hold):
    params, check = _checked(50, lambda o: 0.37 * o, hold=hold, arrive=0)
    params["p17"].grad = params["p17"].grad + 1e-4 * params["p17"].detach()  # an L2 penalty
    for key, g in _paths(params).items():  # the same Σ_i g_i, added after
        check.add(key, g)
    with pytest.raises(UnattributedGradientError, match=r"mostly in p17"):
        check.verdict(TOL64)


def test_a_parameter_no_path_reached_is_compared_with_zero():
    _, check = _checked(3, arrive=2)  # p2's path gradient never arrives: Σ_i g_i = 0 there
    with pytest.raises(UnattributedGradientError, match="p2"):
        check.verdict(TOL64)


def test_free_lets_each_compared_grad_go_and_keeps_the_verdict():
    params, check = _checked(4, free=True)
    assert all(p.grad is None for p in params.values())
    check.verdict(TOL64)


# --- the optimizer's first, self-checked step ----------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))


def test_first_checked_step_holds_one_parameter_beside_grad_not_models():
    """A model whose weight dominates a plain SGD step (profiler bytes, deterministic): the
    first DP step compared ``.grad`` with Σ_i g_i over whole float64 copies of both, held every
    Σ_i g_i, the probe's whole g_i, and the noise beside all the sums: 4.94x a plain step (2.0
    MiB of parameters, n = 8). Now each parameter is compared in 128 KiB chunks as its Σ_i g_i
    is complete, its ``.grad`` then let go, the probe's g_i sketched as it arrives and each
    sum freed once noised: 1.57x; and since the default skips the weight gradients from the
    first step (``skip_weights.py``; the smallest layer's kept there), 1.49x, the second
    step's (the clipped sums beside the noise of the one big weight)."""
    x, y = torch.randn(8, 1024), torch.randint(0, 8, (8,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    plain_m, dp_m = _mlp(), _mlp()
    plain_opt = torch.optim.SGD(plain_m.parameters(), lr=0.1)
    opt = DPOptimizer(torch.optim.SGD(dp_m.parameters(), lr=0.1), dp_m, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=8, loss_reduction="sum")

    def step(model, o):
        def run():
            o.zero_grad()
            loss(model(x), y).backward()
            o.step()
        return run

    cpu, resident = torch.device("cpu"), tensor_bytes(plain_m, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = peak_bytes(step(dp_m, opt), cpu, resident)
        step(plain_m, plain_opt)()
        plain = peak_bytes(step(plain_m, plain_opt), cpu, resident)
    assert all(p.grad is not None for p in dp_m.parameters())  # the private gradient
    assert first <= 1.55 * plain, f"first step {first / plain:.2f}x a plain step"


def test_the_first_step_still_refuses_a_penalty_and_a_rescaled_grad_passes():
    """The streamed comparison keeps the check: an L2 penalty in the loss raises at the first
    step; clip_grad_norm_ on .grad between backward and step (one common factor) passes."""
    x, y = torch.randn(6, 1024), torch.randint(0, 8, (6,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    for penalty, rescale in ((1e-3, False), (0.0, True)):
        model = _mlp().double()
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=6,
                          loss_reduction="sum")
        opt.zero_grad()
        out = loss(model(x.double()), y) + penalty * sum(p.pow(2).sum() for p in
                                                         model.parameters())
        out.backward()
        if rescale:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        if penalty:
            with pytest.raises(UnattributedGradientError, match="weight_decay"):
                opt.step()
        else:
            opt.step()


class _Tied(nn.Module):
    """A table used twice (embedding and head) and a layer no path reaches."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.unused = nn.Linear(2, 2)

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        return h @ self.emb.weight.t()


def test_the_sketched_probe_is_the_whole_probe_sketched():
    """``probe_sketch`` sketches each parameter's g_i as autograd produces it (the tied table
    once, its two uses summed; the unreached parameter as zero), equal to sketching the
    probe's whole g_i."""
    from workbench.clipping.ghost import record_batch

    torch.manual_seed(0)
    model = _Tied().double()
    ids, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out.transpose(1, 2), t, reduction="none").sum(1)

    rec = record_batch(model, loss_fn, ids, y)
    assert isinstance(rec, Recording)
    whole = selfcheck.as_sketch(rec, selfcheck.probe(rec, model, loss_fn, ids, y))
    sketched = selfcheck.probe_sketch(rec, model, loss_fn, ids, y)
    assert sketched.numbers().keys() == whole.numbers().keys()
    assert sketch.differences(sketched, whole, TOL64, 1e-15) == []
    unused = sketched.numbers()[id(model.unused.weight)]
    assert all(v == 0.0 for v in unused)
    assert all(p.grad is None for p in model.parameters())  # the hooks left nothing behind
    assert all(not p._backward_hooks for p in model.parameters())


def test_a_tied_parameter_is_compared_once_and_a_late_part_is_an_error():
    p = nn.Parameter(torch.randn(5, dtype=torch.float64))
    o = torch.randn(5, dtype=torch.float64)
    p.grad = o.clone()
    check = PathCheck({"emb.weight": p, "head.weight": p})  # one tensor, two names
    check.add(id(p), o)
    check.verdict(TOL64)
    with pytest.raises(RuntimeError, match="emb.weight arrived after"):
        check.add(id(p), o)
