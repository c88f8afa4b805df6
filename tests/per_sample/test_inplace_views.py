"""A layer's output that is a *view* (F.linear on (n, T, d) returns addmm's (n·T, p) result
viewed as (n, T, p)) and is written in place afterwards (``nn.ReLU(inplace=True)``, ``h +=
y``, ``h[..., 0] = 0``, Swin-V2's position-bias MLP): autograd rebuilds the graph of its base
without the output's old node, so the edge and the tensor hooks taken at the call never see
its gradient. The layer's per-sample gradient was then silently zero (einsum with
``check=False``, the optimizer's first step with ``verify=False``); now b is read at the
view's base (``per_sample/views.py``) and every layer here keeps its rule, exact. An output
that is not a view (Conv2d's, a Linear on (n, d)) keeps its node: the write's node leads to
the old one. (A *partial* view written in place is in ``test_layer_outputs.py``.)"""

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import (
    assert_agree,
    assert_clipping_agrees,
    assert_optimizer_matches_microbatch,
    mse_per_sample,
    random_batch,
)

T, D = 4, 3


class Written(nn.Module):  # a Linear on (n, T, d), its output written in place
    def __init__(self, how):
        super().__init__()
        self.how, self.fc, self.out = how, nn.Linear(D, 8), nn.Linear(8, D)

    def forward(self, x):  # (n, T, D)
        h = self.fc(x)
        if self.how == "relu_module":
            h = nn.functional.relu(h, inplace=True)
        elif self.how == "relu_":
            h.relu_()
        elif self.how == "iadd":
            h += x.sum(-1, keepdim=True)
        elif self.how == "setitem":
            h[..., 0] = 0.0
        elif self.how == "alias":  # a write into another view of the same storage
            h[:, 0].mul_(2.0)
        elif self.how == "out_of_place":
            h = torch.relu(h)
        return self.out(torch.tanh(h))


class Bias(nn.Module):  # Swin-V2's continuous position bias: an MLP on a constant table
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=True), nn.Linear(8, D))
        self.register_buffer("table", torch.randn(1, T, 2))

    def forward(self, x):  # (n, T, D) + (1, T, D)
        return torch.tanh(x + self.mlp(self.table))


MODELS = {
    **{how: lambda how=how: Written(how) for how in
       ("relu_module", "relu_", "iadd", "setitem", "alias", "out_of_place")},
    "two_dims": lambda: nn.Sequential(nn.Flatten(1), nn.Linear(T * D, 8),
                                      nn.ReLU(inplace=True), nn.Linear(8, D * T)),
    "swinv2_bias": lambda: nn.Sequential(Bias(), nn.Linear(D, D)),
}
FALLBACK = {"swinv2_bias": {"0.mlp.0"}}  # batch-free, written in place: no broadcast meeting


def problem(name, n=5, seed=0):
    torch.manual_seed(seed)
    model = MODELS[name]().double()
    x, y = random_batch((n, T, D), (n, T, D), seed)
    if name == "two_dims":
        y = y.flatten(1)
    return model, x, y


@pytest.mark.parametrize("name", MODELS)
def test_a_view_output_written_in_place_keeps_its_rule_exactly(name):
    model, x, y = problem(name)
    assert_agree(model, mse_per_sample, x, y, check=False)  # no self-check to catch a zero
    assert_clipping_agrees(model, mse_per_sample, x, y)
    routes = wb.ghost_routes(model, mse_per_sample, x, y)
    fallback = {layer for layer, route in zip(routes["layer"], routes["route"])
                if "fallback" in route}
    assert fallback == FALLBACK.get(name, set()), routes


@pytest.mark.parametrize("name", ["relu_module", "swinv2_bias"])
@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_optimizer_reads_no_zero_for_a_view_written_in_place(name, mode):
    """The optimizer's tensor hooks missed the gradient as the edges did: without the
    self-check, the first step's clipped sum held a zero for ``fc``'s parameters."""
    model, _, _ = problem(name)
    batches = [problem(name, n=n, seed=seed)[1:] for seed, n in ((0, 3), (1, 5))]
    assert_optimizer_matches_microbatch(model, mse_per_sample, batches, method=mode,
                                        verify=False)  # must not need the self-check


def test_validate_model_says_what_an_in_place_activation_costs():
    notes = [str(p) for p in wb.validate_model(Written("relu_module").train())
             if "in-place" in str(p)]
    assert not notes  # F.relu(inplace=True) in a forward is not a module validate can see
    notes = [str(p) for p in wb.validate_model(MODELS["swinv2_bias"]())
             if "in-place" in str(p)]
    assert notes and "hooks are safe" in notes[0]


def test_a_view_output_keeps_its_own_backprop_in_hooks_mode():
    """b of a Linear on (n, T, d) (a view of its (n·T, p) product) comes from the output's own
    tensor hook when it fires: a Tensor of its own that the loss's factor can rescale in place
    (``owned.py``), not the base's gradient reshaped (a view: one more copy per call; the DP
    LSTM's peak went from 1.13x to 1.3x a plain step). After an in-place write the hook does
    not fire and b is read at the base's node (views.py Eq. 1); either way it is dL/do."""
    from workbench.per_sample.hooks import ActivationRecorder

    writes = {"out_of_place": lambda h: torch.relu(h), "relu_": lambda h: torch.relu(h),
              "iadd": lambda h: h + torch.ones(()), "setitem": lambda h: torch.cat(
                  [torch.zeros_like(h[..., :1]), h[..., 1:]], -1)}
    for how, write in writes.items():
        model, x, y = problem(how)
        if how == "iadd":
            write = lambda h, x=x: h + x.sum(-1, keepdim=True)  # noqa: E731
        with ActivationRecorder({"fc": model.fc}, capture="hooks") as recorder:
            mse_per_sample(model(x), y).sum().backward()
            (call,) = recorder.calls["fc"]
            assert call.views is not None  # fc's output is a whole view of its base
            (g,) = call.grads
        o = model.fc(x).detach().requires_grad_()  # b = dL/do, o as fc returned it
        own = how == "out_of_place"  # the output's own hook fired: its b as it is
        assert g is not None and g._base is None, how
        assert g.shape == (o.shape if own else (o.shape[0] * T, 8)), how  # else the base's
        loss = mse_per_sample(model.out(torch.tanh(write(o))), y).sum()
        torch.testing.assert_close(g.reshape(o.shape), torch.autograd.grad(loss, o)[0],
                                   rtol=1e-12, atol=0)
