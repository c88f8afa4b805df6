"""A user's module and tensor hooks are part of the model's function, and every method reads
each recorded call as that function computes it.

The invariant: a recorded call's rule reads (a, b) with a the inputs ``forward`` received and
b the gradient of the output ``forward`` returned, as it flows into the layer; every re-run
of the call alone computes that same ``forward``. Until 2026-11-29 four hooks broke it, each
silently with the self-check off (float64, against one record at a time):

- a forward hook returning a new output (``o * 2``): recorded after it, b was read past the
  hook's op (einsum, ghost, book-keeping and every optimizer mode 30-51% off);
- a forward pre-hook scaling the input: the per-layer vmap re-ran the call through
  ``__call__``, so the pre-hook ran twice (32% off);
- a tensor hook on a layer's output registered by a forward hook (``o.register_hook(lambda
  g: 0.5 * g)``): read before it by the optimizer's gradient hook (26% off, every mode) or,
  in the functional API, by autograd's capture at an edge whose node the pass runs through
  (100% off); the per-layer vmap's re-run registered it again (16%);
- a tensor hook the loop puts on the model's output (``out.register_hook(lambda g: 2 * g)``):
  read before it (33% off, every optimizer mode).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.dpsgd.test_invariant import ALL_MODES, C, N, batch
from workbench.dpsgd import DPOptimizer
from workbench.errors import UnsupportedLayerError
from workbench.methods import CLIP_METHODS

TOL = 1e-9
X, Y = batch()


class RuleLess(nn.Module):
    """No grad rule: the per-layer vmap re-runs its calls."""

    def __init__(self, d=8):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, h):
        return h * self.w + torch.sin(h * self.w)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), RuleLess(), nn.Linear(8, 4)).double()


def scale_output(m, i):
    return m[i].register_forward_hook(lambda mod, a, o: o * 2)


def scale_input(m, i):
    return m[i].register_forward_pre_hook(lambda mod, a: (a[0] * 2,))


def scale_gradient(m, i):
    def hook(mod, a, o):
        o.register_hook(lambda g: 0.5 * g)
    return m[i].register_forward_hook(hook)


def scale_grad_output(m, i):
    return m[i].register_full_backward_pre_hook(lambda mod, go: (go[0] * 0.5,))


HOOKS = {f"{f.__name__} on {i}": (f, i) for f in (scale_output, scale_input, scale_gradient,
                                                   scale_grad_output) for i in (0, 2, 3)}


def hooked(name):
    f, i = HOOKS[name]
    m = model()
    f(m, i)
    return m


def reference(m, out_hook=None):
    """{name: (n, *shape)}: each record's gradient, alone, through the same hooks."""
    params = dict(m.named_parameters())
    rows = []
    for i in range(N):
        out = m(X[i:i + 1])
        if out_hook is not None:
            out.register_hook(out_hook)
        rows.append(torch.autograd.grad(F.cross_entropy(out, Y[i:i + 1], reduction="sum"),
                                        list(params.values())))
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def clipped(ref):
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in ref.values()))
    c = (C / norms).clamp(max=1.0)
    return {k: (g * c.view(-1, *[1] * (g.dim() - 1))).sum(0) for k, g in ref.items()}


def losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def worst(got, want):
    return max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)


def refused_by_vmap(hook, method):
    """torch.func.vmap cannot run a module's full backward hooks (an autograd.Function
    without setup_context): method='vmap' over the whole model refuses, naming the others."""
    return method == "vmap" and hook.startswith("scale_grad_output")


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("method", wb.METHODS)
@pytest.mark.parametrize("hook", list(HOOKS))
def test_per_sample_gradients_through_user_hooks(hook, method, check):
    m = hooked(hook)
    if refused_by_vmap(hook, method):
        with pytest.raises(UnsupportedLayerError, match="'einsum' or 'microbatch'"):
            wb.per_sample_gradients(m, losses, X, Y, method=method, check=check)
        return
    got = wb.per_sample_gradients(m, losses, X, Y, method=method, check=check)
    assert worst(got, reference(m)) <= TOL


@pytest.mark.parametrize("method", CLIP_METHODS)
@pytest.mark.parametrize("hook", list(HOOKS))
def test_clipped_sums_through_user_hooks(hook, method):
    m = hooked(hook)
    if refused_by_vmap(hook, method):
        with pytest.raises(UnsupportedLayerError, match="'einsum' or 'microbatch'"):
            wb.clipped_grad_sum(m, losses, X, Y, max_grad_norm=C, method=method, check=False)
        return
    got = wb.clipped_grad_sum(m, losses, X, Y, max_grad_norm=C, method=method, check=False)
    got = got[0] if isinstance(got, tuple) else got
    assert worst(got, clipped(reference(m))) <= TOL


def step(m, mode, verify, out_hook=None, steps=2):
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.verify = verify
    try:
        for _ in range(steps):
            opt.zero_grad()
            out = m(X)
            if out_hook is not None:
                out.register_hook(out_hook)
            F.cross_entropy(out, Y, reduction="sum").backward()
            opt.step()
        return {k: p.grad.clone() for k, p in m.named_parameters()}
    finally:
        opt.detach()


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("hook", list(HOOKS))
def test_optimizer_steps_through_user_hooks(hook, mode, verify):
    m = hooked(hook)
    want = clipped(reference(m))
    assert worst(step(m, mode, verify), want) <= TOL


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_optimizer_reads_b_after_the_loops_hook_on_the_output(mode, verify):
    m = model()
    want = clipped(reference(m, out_hook=lambda g: 2 * g))
    assert worst(step(m, mode, verify, out_hook=lambda g: 2 * g), want) <= TOL


def test_output_hooks_from_the_model_and_the_loop_together_are_refused():
    """No recorded gradient of the output seeds the exact twins then (``_root_hooks``)."""
    m = hooked("scale_gradient on 3")
    with pytest.raises(RuntimeError, match="registered inside its forward pass"):
        step(m, "auto", True, out_hook=lambda g: 2 * g, steps=1)


def test_a_global_forward_hook_is_warned_once(monkeypatch):
    """A global module forward hook runs before the recording's on every layer: an output it
    replaced would be read as the layer's own. Warned once; the loss window's own global
    hooks (observers) are not."""
    from torch.nn.modules import module as module_hooks

    from workbench.per_sample import hooks
    monkeypatch.setattr(hooks, "_WARNED_GLOBAL", [])
    handle = module_hooks.register_module_forward_hook(lambda mod, a, o: None)
    try:
        with pytest.warns(UserWarning, match="global module forward hook"):
            wb.per_sample_gradients(model(), losses, X, Y, method="einsum")
    finally:
        handle.remove()
    import warnings
    monkeypatch.setattr(hooks, "_WARNED_GLOBAL", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model(), "auto", True)  # the loss window's global hooks: no warning


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_on_a_parameter_is_warned_once(kind):
    """The optimizer computes each record's gradient from activations and backprops: a
    parameter's own gradient hook (a pruning mask) acts on nothing it releases."""
    import warnings
    m = model()
    mask = torch.ones_like(m[0].weight)
    mask[0] = 0
    getattr(m[0].weight, kind)((lambda g: g * mask) if kind == "register_hook"
                               else (lambda p: None))
    with pytest.warns(UserWarning, match="parameter 0.weight has a gradient hook"):
        step(m, "auto", False, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model(), "auto", True)  # none of its own: the optimizer's hooks are not the user's


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping", "auto"])
def test_two_optimizers_on_one_models_parts_are_not_user_hooks(mode):
    """Each optimizer's gradient hooks on the model's output are a recording's, not a user's
    (``recorded._root_hooks`` knows any recorder's): the backward pass runs, and the first
    part steps clipped on its own (the second then finds its parameters written by that
    step after its pass: refused by name, ``state_replay``)."""
    m = model()
    ref = reference(m)
    parts = [["0.weight", "0.bias"], ["2.w", "3.weight", "3.bias"]]
    opts = [DPOptimizer(torch.optim.SGD([dict(m.named_parameters())[k] for k in names], lr=0.0),
                        m, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1.0,
                        method=mode, loss_reduction="sum") for names in parts]
    try:
        for opt in opts:
            opt.zero_grad()
        F.cross_entropy(m(X), Y, reduction="sum").backward()
        opts[0].step()
        got = {k: p.grad for k, p in m.named_parameters()}
        assert worst(got, clipped({k: ref[k] for k in parts[0]})) <= TOL
    finally:
        for opt in opts:
            opt.detach()
