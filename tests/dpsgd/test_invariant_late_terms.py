"""What a step's verdict covers: every thing in the step that can change the gradient of the
loss, and where that gradient may flow.

The optimizer verifies a step's per-sample gradients (record probe, halves, ``.grad`` against
Σ_i g_i) only on a new call signature and trusts later steps with the same one. The
invariant: a step whose forward pass, loss window (the ops between the model's output and
``backward``) or gradient hooks differ from the checked step's is checked again; and the
loss's gradient flows only into the private model (its outputs, or its parameters read
directly, which the ``.grad`` check refuses), never into a trainable tensor outside it.

Until 2026-11-30, silently wrong (float64, against one record at a time, probe L):

- a tensor hook on an activation switched on at a later step (``h.register_hook(lambda g:
  g.mean(0, keepdim=True).expand_as(g) * 5)``): 0.90 off; a rescale by the batch's norm:
  0.035 off. The same hooks from step 0 were refused;
- a loss term reading a parameter (an L2 penalty, ``out / model.temp``, ``x @ W.T``)
  switched on at a later step: dropped from the release (0.70, 0.15, 0.65 off), refused from
  step 0;
- ``F.cross_entropy(model(x) + aux(x), y)`` with ``aux`` a trainable model outside the
  private one: ``aux`` trained on the batch's unclipped, unnoised gradient, no error;
- a loss coupling the records through the outputs switched on at a later step: the coupling
  test ran once per output shape.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import (
    LoopError,
    LossCouplingError,
    PerSampleCheckError,
    UnattributedGradientError,
)

C, D, K, STEPS, LATE = 0.7, 5, 4, 4, 2
TOL = 1e-9  # float64: the engine's sum against the twin's, relative to max(1, |twin|)


class Net(nn.Module):
    """Linear, tanh, Linear; ``hook(h)`` (if set) runs on the activation with gradient."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(D, 8), nn.Linear(8, K)
        self.temp = nn.Parameter(torch.tensor(2.0))
        self.hook = None
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.hook is not None and h.requires_grad:
            self.hook(h)
        return self.b(h)


def batches(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n + s % 2, D, generator=g, dtype=torch.float64),
             torch.randint(0, K, (n + s % 2,), generator=g)) for s in range(STEPS)]


def twin(model, loss_of, x, y):
    """Σ_i clip_C(∇ℓ_i), ℓ_i = loss_of(model, x_i, y_i), one record at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0
    for i in range(x.shape[0]):
        g = torch.autograd.grad(loss_of(model, x[i:i + 1], y[i:i + 1]), params,
                                allow_unused=True)
        g = torch.cat([torch.zeros_like(p).flatten() if t is None else t.flatten()
                       for p, t in zip(params, g)])
        total = total + min(1.0, C / max(float(g.norm()), 1e-300)) * g
    return total


def train(model, step_of, mode="einsum", params=None):
    """STEPS steps with σ = 0, lr = 0, B = 1: ``step_of(s, x, y)`` runs the loop's forward
    pass and backward; returns [(Σ_i c_i g_i released, x, y)]."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode)
    out = []
    try:
        for s, (x, y) in enumerate(batches()):
            opt.zero_grad()
            step_of(s, x, y)
            opt.step()
            out.append((torch.cat([p.grad.flatten() for p in params]), x, y))
    finally:
        opt.detach()
    return out


def rowmix(g):  # each row's backprop replaced by the batch's mean: couples the records
    return g.mean(0, keepdim=True).expand_as(g) * 5


def by_norm(g):  # every row divided by the batch's norm (a batch-norm-like rescale)
    return g / g.norm() * 1e-2


HOOKS = {
    "tensor rowmix": lambda h: h.register_hook(rowmix),
    "tensor by norm": lambda h: h.register_hook(by_norm),
    "node prehook": lambda h: h.grad_fn.register_prehook(lambda go: (rowmix(go[0]),)),
}


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("kind", list(HOOKS))
def test_gradient_hook_switched_on_later_is_checked_again(kind, mode):
    model = Net()

    def step_of(s, x, y):
        model.hook = HOOKS[kind] if s >= LATE else None
        F.cross_entropy(model(x), y).backward()

    with pytest.raises(PerSampleCheckError) as err:
        train(model, step_of, mode)
    assert "hook" in str(err.value), str(err.value)  # the message names the hook


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_linear_hook_switched_on_later_is_exact(mode):
    """A rescale by a constant (no record sees another): checked again and exact."""
    model = Net()

    def step_of(s, x, y):
        model.hook = (lambda h: h.register_hook(lambda g: g * 3)) if s >= LATE else None
        F.cross_entropy(model(x), y).backward()

    got = train(model, step_of, mode)
    for s, (g, x, y) in enumerate(got):
        model.hook = (lambda h: h.register_hook(lambda g: g * 3)) if s >= LATE else None
        want = twin(model, lambda m, xi, yi: F.cross_entropy(m(xi), yi), x, y)
        assert float((g - want).norm()) <= TOL * max(1.0, float(want.norm())), s


def test_loop_hook_on_output_switched_on_later_is_checked_again():
    """The loop's hook on the model's output is part of the loss: its coupling test runs
    again on the window with the hook (``loss_watch.coupling``)."""
    model = Net()

    def step_of(s, x, y):
        out = model(x)
        if s >= LATE:
            out.register_hook(rowmix)
        F.cross_entropy(out, y).backward()

    with pytest.raises(LossCouplingError, match="register_hook on a tensor of shape"):
        train(model, step_of)


def test_coupled_loss_term_switched_on_later_is_refused():
    """The coupling test's key holds the window's ops: a weight over the batch's outputs
    (a softmax over dim 0) from step LATE on was released on the first window's verdict."""
    model = Net()

    def step_of(s, x, y):
        out = model(x)
        if s >= LATE:
            out = out * torch.softmax(out[:, 0], 0)[:, None] * out.shape[0]
        F.cross_entropy(out, y).backward()

    with pytest.raises(LossCouplingError, match="depend on the other records"):
        train(model, step_of)


TERMS = {  # name: (the loss from step LATE on, what the refusal names)
    "l2": (lambda m, o, x, y: F.cross_entropy(o, y) + 0.5 * (m.b.weight ** 2).sum(),
           "b.weight"),
    "temperature": (lambda m, o, x, y: F.cross_entropy(o / m.temp, y), "temp"),
    "by hand": (lambda m, o, x, y: F.cross_entropy(o, y) + (x @ m.a.weight.T).pow(2).mean(),
                "a.weight"),
}


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("term", list(TERMS))
def test_parameter_term_switched_on_later_is_refused(term, mode):
    model = Net()
    loss, name = TERMS[term]

    def step_of(s, x, y):
        out = model(x)
        (loss(model, out, x, y) if s >= LATE else F.cross_entropy(out, y)).backward()

    with pytest.raises(UnattributedGradientError, match=name):
        train(model, step_of, mode)


@pytest.mark.parametrize("where", ["sum_outputs", "sum_losses", "before"])
def test_trainable_model_outside_the_private_one_is_refused(where):
    model = Net()
    torch.manual_seed(9)
    aux = nn.Linear(D, K).double()

    def step_of(s, x, y):
        if where == "sum_outputs":
            loss = F.cross_entropy(model(x) + aux(x), y)
        elif where == "sum_losses":
            loss = F.cross_entropy(model(x), y) + F.cross_entropy(aux(x), y)
        else:  # the other model called before the private one
            a = aux(x)
            loss = F.cross_entropy(a + model(x), y)
        loss.backward()

    with pytest.raises(LoopError, match=r"Linear\.weight|\(4, 5\)") as err:
        train(model, step_of)
    assert "detach" in str(err.value)
    assert aux.weight.grad is None  # refused before the backward pass


def test_learnable_tensor_outside_the_private_model_is_refused():
    model = Net()
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)

    def step_of(s, x, y):
        F.cross_entropy(model(x) * scale, y).backward()

    with pytest.raises(LoopError, match=r"shape \(\)"):
        train(model, step_of)


def test_constants_frozen_models_and_no_grad_teachers_are_exact():
    """No refusal where no gradient leaves the private model: a frozen model, a teacher under
    no_grad, a tensor without requires_grad, and a parameter of the private model outside
    the optimizer (its .grad is dropped)."""
    model = Net()
    torch.manual_seed(9)
    frozen = nn.Linear(D, K).double().requires_grad_(False)
    teacher = nn.Linear(D, K).double()
    shift = torch.linspace(-1, 1, K, dtype=torch.float64)

    def loss_of(m, x, y):
        with torch.no_grad():
            t = teacher(x).softmax(-1)
        o = m(x) + frozen(x) + shift
        return F.cross_entropy(o, y) + 0.1 * F.kl_div(o.log_softmax(-1), t,
                                                      reduction="batchmean")

    params = [p for n, p in model.named_parameters() if n != "temp"]
    with pytest.warns(UserWarning, match="temp require"):
        got = train(model, lambda s, x, y: loss_of(model, x, y).backward(), params=params)
    for s, (g, x, y) in enumerate(got):
        want = twin(model, loss_of, x, y)[1:]  # temp (the root's own, first): dropped
        assert float((g - want).norm()) <= TOL * max(1.0, float(want.norm())), s
