"""Every spelling of the backward pass gets the loss window's checks (``backward_calls.py``).

The invariant: a backward pass from the private model's outputs that writes the parameters'
``.grad`` is checked (attribution, batch statistics, reduction, coupling) on the objective it
differentiates, L = Σ_k ⟨v_k, l_k⟩, whatever starts it; a pass into inputs alone is no pass
of the step; a second-order pass is refused. Until 2026-11-29 only ``loss.backward()`` on a
scalar was read: ``losses.backward(ones)`` skipped the checks with a warning,
``torch.autograd.backward((loss,))`` silently (a loss coupling its records through logits
centred over the batch was released), and FGSM's ``torch.autograd.grad(loss, x)`` was
recorded as a pass of the step (refused, blaming an L2 penalty)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.dpsgd.test_invariant import ALL_MODES, C, N, batch, mlp
from workbench.dpsgd import DPOptimizer
from workbench.dpsgd.backward_calls import backward_call, objective
from workbench.errors import LossCouplingError

TOL = 1e-9
X, Y = batch()
WEIGHTS = torch.linspace(0.5, 2.0, N, dtype=torch.float64)


def optimizer(model, mode, reduction="sum", **kw):
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                       noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1.0,
                       method=mode, loss_reduction=reduction, **kw)


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def twin(model, record_loss, x=X):
    """Σ_i clip_C(∇ record_loss(i)), one record at a time."""
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(x.shape[0]):
        g = torch.cat([t.flatten() for t in torch.autograd.grad(record_loss(model, i), params)])
        total += min(1.0, C / float(g.norm())) * g
    return total


def per_record(model, x=X, y=Y):
    return F.cross_entropy(model(x), y, reduction="none")


def centred(model, x=X, y=Y):  # logits centred over the batch: record i reads the others
    out = model(x)
    return F.cross_entropy(out - out.mean(0), y, reduction="none")


SPELLINGS = {  # name: (start the pass from per-record losses ls (n,), record i's own factor)
    "ls.backward(ones)": (lambda ls: ls.backward(torch.ones_like(ls)), lambda i: 1.0),
    "ls.backward(gradient=weights)": (lambda ls: ls.backward(gradient=WEIGHTS),
                                     lambda i: float(WEIGHTS[i])),
    "autograd.backward((ls.sum(),))": (lambda ls: torch.autograd.backward((ls.sum(),)),
                                      lambda i: 1.0),
    "autograd.backward(ls.sum())": (lambda ls: torch.autograd.backward(ls.sum()), lambda i: 1.0),
    "autograd.backward([ls], [weights])": (lambda ls: torch.autograd.backward([ls], [WEIGHTS]),
                                          lambda i: float(WEIGHTS[i])),
    "autograd.backward(ls, grad_tensors=)": (
        lambda ls: torch.autograd.backward(ls, grad_tensors=torch.ones_like(ls)), lambda i: 1.0),
    "two losses in one call": (
        lambda ls: torch.autograd.backward([ls[:3].sum(), ls[3:]], [None, torch.ones(N - 3,
                                                                     dtype=ls.dtype)]),
        lambda i: 1.0),
}


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_spelling_of_backward_is_exact(spelling, mode):
    start, factor = SPELLINGS[spelling]
    model = mlp()
    ref = twin(model, lambda m, i: factor(i) * F.cross_entropy(m(X[i:i + 1]), Y[i:i + 1],
                                                               reduction="sum"))
    opt = optimizer(model, mode)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "coupling test could not run" any more
            opt.zero_grad()
            start(per_record(model))
            opt.step()
        assert float((flat_grad(model) - ref).norm()) <= TOL * float(ref.norm())
    finally:
        opt.detach()


@pytest.mark.parametrize("mode", ["bookkeeping", "auto"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_spelling_of_backward_refuses_a_coupled_loss(spelling, mode):
    start, _ = SPELLINGS[spelling]
    model = mlp()
    opt = optimizer(model, mode)
    try:
        opt.zero_grad()
        with pytest.raises(LossCouplingError, match="depend on the other records"):
            start(centred(model))
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    finally:
        opt.detach()


@pytest.mark.parametrize("mode", ["bookkeeping", "auto"])
def test_gradient_argument_reads_as_the_reduction_it_is(mode):
    """backward(ones) is a sum, backward(ones / n) a mean: each refused under the other
    loss_reduction, exact under its own."""
    for reduction, v, ok in (("mean", torch.ones_like, False),
                             ("mean", lambda ls: torch.full_like(ls, 1 / ls.shape[0]), True)):
        model = mlp()
        opt = optimizer(model, mode, reduction=reduction)
        try:
            opt.zero_grad()
            losses = per_record(model)
            if not ok:
                with pytest.raises(LossCouplingError, match="sums the records' terms"):
                    losses.backward(v(losses))
                continue
            losses.backward(v(losses))
            opt.step()
            ref = twin(mlp(), lambda m, i: F.cross_entropy(m(X[i:i + 1]), Y[i:i + 1]))
            assert float((flat_grad(model) - ref).norm()) <= TOL * float(ref.norm())
        finally:
            opt.detach()


def test_gradient_argument_from_a_batch_statistic_is_refused():
    """Per-record weights normalised over the batch's labels couple the records through the
    gradient argument itself."""
    model = mlp()
    opt = optimizer(model, "auto")
    try:
        opt.zero_grad()
        losses = per_record(model)
        w = torch.tensor([0.3, 2.0, 1.0, 0.7], dtype=torch.float64)[Y]
        with pytest.raises(LossCouplingError, match="statistic of the whole batch"):
            losses.backward(w / w.sum())
    finally:
        opt.detach()


def fgsm(model, x, y, how):
    xr = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(xr), y, reduction="sum")
    if how == "grad":
        g, = torch.autograd.grad(loss, xr)
    else:
        loss.backward(inputs=[xr])
        g = xr.grad
    return (x + 0.1 * g.sign()).detach()


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("how", ["grad", "backward inputs="])
def test_adversarial_inputs_pass_is_not_a_step_pass(how, mode):
    """FGSM: the input gradient's backward pass runs through the private model but writes no
    parameter's .grad; each step trains on the adversarial inputs alone, exactly."""
    model = mlp()  # lr = 0: the weights stay, one reference for both steps
    ref = twin(model, lambda m, i: F.cross_entropy(
        m(fgsm(m, X[i:i + 1], Y[i:i + 1], "grad")), Y[i:i + 1], reduction="sum"))
    opt = optimizer(model, mode)
    try:
        for _ in range(2):
            opt.zero_grad()
            adversarial = fgsm(model, X, Y, how)
            F.cross_entropy(model(adversarial), Y, reduction="sum").backward()
            opt.step()
            assert float((flat_grad(model) - ref).norm()) <= TOL * float(ref.norm())
    finally:
        opt.detach()


@pytest.mark.parametrize("mode", ["einsum", "auto"])
def test_loss_reading_a_second_order_gradient_is_refused_by_name(mode):
    """A gradient penalty: torch.autograd.grad with create_graph=True from the outputs, read
    by the loss; the same gradient taken and not read (a log) leaves the step exact."""
    for read in (True, False):
        model = mlp()
        ref = twin(model, lambda m, i: F.cross_entropy(m(X[i:i + 1]), Y[i:i + 1],
                                                       reduction="sum"))
        opt = optimizer(model, mode)
        try:
            opt.zero_grad()
            xr = X.clone().requires_grad_(True)
            out = model(xr)
            g, = torch.autograd.grad(out.sum(), xr, create_graph=True)
            loss = F.cross_entropy(out, Y, reduction="sum")
            if read:
                with pytest.raises(LossCouplingError, match="create_graph=True"):
                    (loss + g.square().sum()).backward()
                continue
            loss.backward()
            opt.step()
            assert float((flat_grad(model) - ref).norm()) <= TOL * float(ref.norm())
        finally:
            opt.detach()


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_gradients_taken_aside_leave_the_step_exact(mode):
    """torch.autograd.grad into the parameters (a gradient norm for a log) between the
    forward pass and backward: no pass of the step."""
    model = mlp()
    ref = twin(model, lambda m, i: F.cross_entropy(m(X[i:i + 1]), Y[i:i + 1], reduction="sum"))
    opt = optimizer(model, mode)
    try:
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="skip_weight_grads = False"):
            torch.autograd.grad(per_record(model).sum(), list(model.parameters()))
        opt.skip_weight_grads = False
        opt.zero_grad()
        loss = F.cross_entropy(model(X), Y, reduction="sum")
        norms = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        assert all(float(n.norm()) > 0 for n in norms)
        loss.backward()
        opt.step()
        assert float((flat_grad(model) - ref).norm()) <= TOL * float(ref.norm())
    finally:
        opt.detach()


def test_backward_call_reads_every_entry_point():
    t = torch.ones(3, requires_grad=True)
    v = torch.full((3,), 2.0)
    call = backward_call(torch.Tensor.backward, (t,), {"gradient": v, "inputs": None})
    assert call.roots[0][0] is t and call.roots[0][1] is v and call.inputs is None
    call = backward_call(torch.autograd.backward, ((t,),), {"grad_tensors": (v,),
                                                            "inputs": (t,)})
    assert call.roots[0][1] is v and call.inputs == (t,) and not call.grad
    call = backward_call(torch.autograd.grad, ((t,), (t,)),
                         {"grad_outputs": None, "create_graph": True})
    assert call.grad and call.create_graph and call.kind({id(t)}) == "second order"
    assert backward_call(torch.autograd.grad, ((t,), (t,)), {}).kind({id(t)}) == "aside"
    call = backward_call(torch.Tensor.backward, (t,), {"inputs": [t]})
    assert call.kind({id(t)}) == "restricted" and call.kind(set()) == "aside"
    ops = []

    def through(f, *a):
        ops.append(f.__name__)
        return f(*a)

    assert float(objective([(t, torch.full((3,), 0.25))], through).detach()) == 0.75
    assert ops == ["sum", "div"]  # 1/4 everywhere: a sum divided by 4, the mean's spelling


@pytest.mark.parametrize("mode", ["microbatch", "bookkeeping", "auto"])
def test_pass_restricted_to_parameters_is_refused_by_name(mode):
    """autograd runs only the nodes leading to the named inputs: the layers whose weights
    the optimizer keeps out of the graph sent no backprops (a failed self-check, or with
    the check off wrong clipped sums)."""
    for verify in (True, False):
        model = mlp()
        opt = optimizer(model, mode)
        opt.verify = verify
        try:
            opt.zero_grad()
            loss = per_record(model).sum()
            with pytest.raises(RuntimeError, match="whole backward pass of the loss"):
                loss.backward(inputs=list(model.parameters()))
        finally:
            opt.detach()


def test_step_after_gradients_taken_aside_only_is_an_error():
    """torch.autograd.grad into the parameters, written to .grad by hand: no backward pass
    of the step ran, said as such."""
    model = mlp()
    opt = optimizer(model, "auto")
    opt.skip_weight_grads = False
    try:
        opt.zero_grad()
        params = list(model.parameters())
        for p, g in zip(params, torch.autograd.grad(per_record(model).sum(), params)):
            p.grad = g
        with pytest.raises(RuntimeError, match="without a backward"):
            opt.step()
    finally:
        opt.detach()
