"""Every re-run of the forward pass reads the model's state as the batch's pass read it
(``per_sample/state_replay.py``).

A forward pass that writes the model's state without the batch's values (the old
``torch.nn.utils.spectral_norm``'s power iteration, a call counter, an attribute rebound, a
buffer written through ``.data``) is legitimate, but every exact twin re-runs the forward after
the pass: the self-check's probe, the whole-model fallback, ghost clipping's second pass,
micro-batching's n passes. Until 2026-11-29 they read what the pass left: with the self-check
off the optimizer's clipped sums of a spectral-normed layer were 22% off (685% where the
spectral-normed layer is the model itself: its pre-hook ran before the optimizer's pass
began), and a `.data`-written buffer's 124% off, silently; with it on, every such model was
refused by a self-check that blamed the rules. A spectral-normed weight read by a rule after
the pass ran one more power iteration per read (the state drifted from a plain loop's). The
reference here is independent: one record at a time, the state put back by hand before each
(buffers, attributes) and left as one pass leaves it.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.dpsgd import DPOptimizer
from workbench.errors import UnsupportedLayerError
from workbench.per_sample.state_replay import PassLog, Snapshot, replayed

D, C = 4, 0.5


class Counter(nn.Module):  # a buffer counting calls, read by the same call
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (1 + 0.1 * self.calls)


class Rebound(nn.Module):  # a Python float rebound at each call
    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(D, D), 1.0

    def forward(self, x):
        self.scale = self.scale * 1.5
        return self.lin(x) * self.scale


class ThroughData(nn.Module):  # a buffer written through an alias, from the weights
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("u", torch.ones(D))

    def forward(self, x):
        self.u.data.copy_(torch.tanh(self.lin.weight.detach() @ self.u + 0.3))
        return self.lin(x) * self.u


class Saved(nn.Module):  # the written buffer itself saved by autograd (mul), not a copy of it
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("gain", torch.ones(D))

    def forward(self, x):
        with torch.no_grad():
            self.gain.mul_(1.25)
        return torch.tanh(self.lin(x)) * self.gain


class Unseen(nn.Module):  # a write no torch-function mode sees
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        with torch._C.DisableTorchFunction():
            self.calls.add_(1)
        return self.lin(x) * (1 + 0.1 * self.calls)


class CountingParametrization(nn.Module):  # torch.nn.utils.parametrize, writing its buffer
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, W):
        if self.training:
            with torch.no_grad():
                self.count += 1
        return W * (1 + 0.5 * self.count)


def make(kind):
    torch.manual_seed(1)
    if kind == "parametrized counter":  # the layer re-runs of microbatch and vmap advanced
        # it once per record until 2026-11-29 (count 5 at n = 3 after one pass, not 2)
        first = nn.Linear(D, 6)
        nn.utils.parametrize.register_parametrization(first, "weight",
                                                      CountingParametrization())
        return nn.Sequential(first, nn.Tanh(), nn.Linear(6, 2)).double()
    if kind == "root spectral_norm":  # its pre-hook runs before any the optimizer adds after
        return nn.utils.spectral_norm(nn.Linear(D, 2)).double()
    if kind == "spectral_norm":  # the old API: power iteration in a pre-hook, in place
        first = nn.utils.spectral_norm(nn.Linear(D, 6))
    elif kind == "parametrized spectral_norm":
        first = nn.utils.parametrizations.spectral_norm(nn.Linear(D, 6))
    else:
        first = nn.Sequential({"counter": Counter, "rebound": Rebound, "data": ThroughData,
                               "saved": Saved, "unseen": Unseen}[kind](), nn.Linear(D, 6))
    return nn.Sequential(first, nn.Tanh(), nn.Linear(6, 2)).double()


KINDS = ["spectral_norm", "root spectral_norm", "parametrized spectral_norm", "counter",
         "rebound", "data", "saved", "parametrized counter"]


def _state(model):
    return ({k: b.clone() for k, b in model.named_buffers()},
            {id(m): {k: v for k, v in vars(m).items() if not k.startswith("_")}
             for m in model.modules()})


def _put_back(model, state):
    buffers, attrs = state
    for k, b in model.named_buffers():
        b.data.copy_(buffers[k])
    for m in model.modules():
        vars(m).update(attrs[id(m)])


def reference(model, x, y):
    """(clipped sum, state after one pass): records one at a time from the same state."""
    start = _state(model)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(x)):
        _put_back(model, start)
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        rows.append(torch.autograd.grad(loss, params))
    _put_back(model, start)
    model(x)  # the state one pass leaves
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in row)) for row in rows])
    f = (C / norms).clamp(max=1.0)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    return {k: sum(f[i] * rows[i][j] for i in range(len(x))) for j, k in enumerate(names)}


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("method", ["auto", "bookkeeping", "einsum", "microbatch", "vmap"])
@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_exact_over_steps(kind, method, verify):
    model, twin = make(kind), make(kind)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum",
                      method=method)
    opt.verify = verify
    try:
        gen = torch.Generator().manual_seed(3)
        for n in (5, 3, 5):
            x = torch.randn(n, D, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 2, (n,), generator=gen)
            want = reference(twin, x, y)
            opt.zero_grad()
            loss_fn(model(x), y).sum().backward()
            opt.step()
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[k], rtol=1e-10, atol=1e-12)
            for (k, b), (_, t) in zip(model.named_buffers(), twin.named_buffers()):
                torch.testing.assert_close(b, t, rtol=0, atol=0, msg=k)  # one pass's state
    finally:
        opt.detach()


@pytest.mark.parametrize("method", ["microbatch", "vmap", "einsum", "ghost", "bookkeeping"])
@pytest.mark.parametrize("kind", KINDS)
def test_functional_exact(kind, method):
    model, twin = make(kind), make(kind)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, D, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (5,), generator=gen)
    want = reference(twin, x, y)
    if method == "vmap" and kind in ("counter", "saved", "parametrized counter"):  # torch.func
        # refuses the write
        with pytest.raises(UnsupportedLayerError, match="update buffers in place"):
            wb.clipped_grad_sum(model, loss_fn, x, y, C, method=method)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost warning
        got = wb.clipped_grad_sum(model, loss_fn, x, y, C, method=method)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    if kind != "rebound":  # a rebinding forward under vmap leaves a batched float: not state
        for (k, b), (_, t) in zip(model.named_buffers(), twin.named_buffers()):
            torch.testing.assert_close(b, t, rtol=0, atol=0, msg=k)


def test_unseen_write_refused_when_rerun():
    """A write no mode sees cannot be replayed: a re-run that needs it is refused by name
    (the self-check's probe, at the first step), nothing stepped."""
    model = make("unseen")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum")
    before = [p.detach().clone() for p in model.parameters()]
    try:
        x, y = torch.randn(3, D, dtype=torch.float64), torch.tensor([0, 1, 0])
        opt.zero_grad()
        loss_fn(model(x), y).sum().backward()
        with pytest.raises(UnsupportedLayerError, match=r"0\.0\.calls.*could not see"):
            opt.step()
    finally:
        opt.detach()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_replay_swaps_copies_and_puts_everything_back():
    """Inside: the values and bindings the pass read, in copies; after: the very tensors and
    bindings the pass left (the batch's saved tensors untouched), also after an error."""
    model = make("counter")
    counter = model[0][0]
    log = PassLog(model)
    from workbench.per_sample.hooks import ActivationRecorder
    from workbench.per_sample.uses import UseTracker  # the mode that calls ``before``
    with ActivationRecorder({}) as rec:
        tracker = UseTracker({}, rec)
        tracker.state = log
        with tracker:
            model(torch.randn(2, D, dtype=torch.float64))
        tracker.state = None
    log.close()
    left = counter.calls
    assert float(left) == 1.0
    with pytest.raises(ZeroDivisionError), replayed(log):
        assert float(counter.calls) == 0.0 and counter.calls is not left
        model(torch.randn(2, D, dtype=torch.float64))  # the re-run writes the copy
        1 / 0
    assert counter.calls is left and float(left) == 1.0 and left._version == 1


def test_snapshot_rewinds_bindings_and_values():
    model = make("rebound")
    snap = Snapshot(model)
    model(torch.randn(2, D, dtype=torch.float64))
    assert model[0][0].scale == 1.5
    snap.rewind()
    assert model[0][0].scale == 1.0


class Temperature(nn.Module):  # reads a buffer that the loop anneals
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("t", torch.ones(()))

    def forward(self, x):
        return self.lin(x) / self.t


def _tempered():
    torch.manual_seed(0)
    return nn.Sequential(Temperature(), nn.Tanh(), nn.Linear(D, 2)).double()


@pytest.mark.parametrize("where", ["between backward and step", "after step"])
def test_state_written_after_the_pass_is_refused_when_rerun(where):
    """A loop that writes state between the pass and ``step()``: the value the pass read is
    gone, so a re-run (here the first step's self-check) is refused by name, nothing stepped;
    written after ``step()`` (the fix the message names), every step is exact."""
    model, twin = _tempered(), _tempered()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum")
    gen = torch.Generator().manual_seed(5)
    try:
        for _ in range(2):
            x = torch.randn(4, D, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 2, (4,), generator=gen)
            want = reference(twin, x, y)
            opt.zero_grad()
            loss_fn(model(x), y).sum().backward()
            if where == "between backward and step":
                with torch.no_grad():
                    model[0].t.mul_(1.5)
                with pytest.raises(UnsupportedLayerError, match=r"0\.t was written in place "
                                                                r"after the forward pass"):
                    opt.step()
                assert opt._sums == {}  # nothing of the refused batch kept
                return
            opt.step()
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[k], rtol=1e-10, atol=1e-12)
            with torch.no_grad():
                model[0].t.mul_(1.5)
                twin[0].t.mul_(1.5)
    finally:
        opt.detach()


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_two_backward_passes_per_step(kind, verify):
    """Gradient accumulation: each pass's re-runs read that pass's state (the second pass
    wrote over the first's), and .grad sums both passes' clipped sums."""
    model, twin = make(kind), make(kind)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum")
    opt.verify = verify
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(2):
            opt.zero_grad()
            want = {}
            for n in (4, 3):
                x = torch.randn(n, D, generator=gen, dtype=torch.float64)
                y = torch.randint(0, 2, (n,), generator=gen)
                for k, g in reference(twin, x, y).items():
                    want[k] = want[k] + g if k in want else g
                loss_fn(model(x), y).sum().backward()
            opt.step()
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[k], rtol=1e-10, atol=1e-12)
    finally:
        opt.detach()


def test_a_buffer_written_between_backward_and_step_is_warned_once():
    """A running loss kept in a model buffer by the loop (``loss_avg.mul_().add_(loss)``): a
    function of the records in the released model, which no taint follows after the forward
    pass; warned by name, once, and the step (no re-run: the check off) is still exact."""
    model, twin = _tempered(), _tempered()
    model.register_buffer("loss_avg", torch.zeros((), dtype=torch.float64))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum")
    opt.verify = False
    gen = torch.Generator().manual_seed(5)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                x = torch.randn(4, D, generator=gen, dtype=torch.float64)
                y = torch.randint(0, 2, (4,), generator=gen)
                want = reference(twin, x, y)
                opt.zero_grad()
                loss = loss_fn(model(x), y).sum()
                loss.backward()
                with torch.no_grad():
                    model.loss_avg.mul_(0.9).add_(0.1 * loss.detach())
                opt.step()
                for k, p in model.named_parameters():
                    torch.testing.assert_close(p.grad, want[k], rtol=1e-10, atol=1e-12)
    finally:
        opt.detach()
    mine = [w for w in caught if "'loss_avg' was written in place between" in str(w.message)]
    assert len(mine) == 1, [str(w.message)[:80] for w in caught]


class ReadOutside(nn.Module):  # lin.weight read outside lin: the whole-model fallback re-runs
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.head = nn.Linear(D, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) + 0.5 * torch.tanh(x @ self.lin.weight.T)))


@pytest.mark.parametrize("how", ["through .data", "under no_grad"])
@pytest.mark.parametrize("verify", [True, False])
def test_parameters_written_after_the_pass_are_refused_at_a_later_step(how, verify):
    """Weight decay by hand between backward and ``step()`` re-ran the fallback at other
    weights than the batch's: through ``.data`` (no version counter moves) 5% off with the
    check off, silently, until 2026-11-29. A clean first step is exact; the second, with the
    write, is refused by name and keeps nothing."""
    model, twin = ReadOutside().double(), ReadOutside().double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, loss_reduction="sum")
    opt.verify = verify
    gen = torch.Generator().manual_seed(5)
    try:
        for step in range(2):
            x = torch.randn(4, D, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 2, (4,), generator=gen)
            want = reference(twin, x, y)
            opt.zero_grad()
            loss_fn(model(x), y).sum().backward()
            if step == 0:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the fallback's cost warning
                    opt.step()
                for k, p in model.named_parameters():
                    torch.testing.assert_close(p.grad, want[k], rtol=1e-10, atol=1e-12)
                continue
            for p in model.parameters():  # decoupled weight decay, by hand, before step()
                if how == "through .data":
                    p.data.mul_(0.9)
                else:
                    with torch.no_grad():
                        p.mul_(0.9)
            with pytest.raises(UnsupportedLayerError, match=r"lin\.weight.*written in place "
                                                            r"after the forward pass"):
                opt.step()
            assert opt._sums == {}
    finally:
        opt.detach()
