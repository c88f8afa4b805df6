"""The engine around the samplers: sharing, freezing, fallback, registry, errors, cleanup."""

import warnings

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import assert_agree, mse_per_sample, random_batch
from workbench.per_sample import einsum as einsum_module

CE = nn.CrossEntropyLoss(reduction="none")


class Twice(nn.Module):
    """One Linear called twice in one forward pass."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class Tied(nn.Module):
    """One Parameter used by two modules (tied input/output embedding)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x))).sum(1)


class ScaleShift(nn.Module):
    """A custom layer with its own parameters and no built-in sampler. One ``addcmul``: a plain
    ``x * scale + shift`` would take the broadcast rule's scale and shift calls
    (``rules/broadcast.py``), leaving nothing to vmap."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.shift = nn.Parameter(torch.zeros(d))

    def forward(self, x, power=1):
        return torch.addcmul(self.shift, x ** power, self.scale)


def test_module_called_twice_sums_contributions():
    torch.manual_seed(0)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_agree(Twice().double(), CE, x, y)


def test_parameter_shared_by_two_modules():
    torch.manual_seed(0)
    model = Tied().double()
    x, y = torch.randint(0, 7, (6, 3)), torch.randint(0, 7, (6,))
    grads = assert_agree(model, CE, x, y)
    assert list(grads) == ["emb.weight"]


def test_frozen_parameters_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.LayerNorm(3)).double()
    model[0].weight.requires_grad_(False)
    model[3].requires_grad_(False)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    grads = assert_agree(model, CE, x, y)
    assert set(grads) == {"0.bias", "2.weight", "2.bias"}


def test_unused_parameters_get_zero_rows():
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)}).double()
    model.forward = lambda x: model["used"](x)
    x, y = random_batch((4, 3), (4, 2))
    grads = assert_agree(model, mse_per_sample, x, y)
    assert grads["unused.weight"].abs().max() == 0


def test_fallback_layer_uses_vmap_with_one_warning():
    torch.manual_seed(0)
    einsum_module._WARNED.clear()
    model = nn.Sequential(nn.Linear(3, 4), ScaleShift(4), nn.Linear(4, 2)).double()
    x, y = random_batch((6, 3), (6, 2))
    with pytest.warns(UserWarning, match=r"ScaleShift at 1 has no registered grad sampler"):
        assert_agree(model, mse_per_sample, x, y, methods=("einsum",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call stays silent
        wb.per_sample_gradients(model, mse_per_sample, x, y)


def test_fallback_passes_keyword_arguments():
    torch.manual_seed(0)
    einsum_module._WARNED.clear()

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.ss = ScaleShift(3)

        def forward(self, x):
            return self.ss(x, power=2)

    x, y = random_batch((5, 3), (5, 3))
    with pytest.warns(UserWarning):
        assert_agree(Wrap().double(), mse_per_sample, x, y)


def test_strict_raises_for_layer_without_sampler():
    model = nn.Sequential(nn.Linear(3, 4), ScaleShift(4))
    x, y = random_batch((2, 3), (2, 4), dtype=torch.float32)
    with pytest.raises(wb.UnsupportedLayerError, match=r"ScaleShift at 1.*register_grad_sampler"):
        wb.per_sample_gradients(model, mse_per_sample, x, y, strict=True)


def test_registered_custom_sampler_is_used():
    torch.manual_seed(0)
    calls = []

    @wb.register_grad_sampler(ScaleShift)
    def scale_shift_sampler(layer, activations, backprops):
        calls.append(layer)
        x = activations[0]
        return {"scale": x * backprops, "shift": backprops}  # o = x*s + t

    try:
        model = nn.Sequential(nn.Linear(3, 4), ScaleShift(4), nn.Linear(4, 2)).double()
        x, y = random_batch((6, 3), (6, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_agree(model, mse_per_sample, x, y, methods=("einsum",), strict=True)
        assert len(calls) == 1
    finally:
        del wb.GRAD_SAMPLERS[ScaleShift]


def test_register_grad_sampler_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        wb.register_grad_sampler(int)
    with pytest.raises(TypeError, match="at least one layer type"):
        wb.register_grad_sampler()


def test_tuple_inputs_and_no_targets():
    torch.manual_seed(0)

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

        def forward(self, u, v):
            return self.a(u) * self.b(v)

    u, v = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    assert_agree(TwoInputs().double(), lambda out, _: (out ** 2).sum(1), (u, v), None)


def test_dropout_model_runs_for_every_method():
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    for method in wb.METHODS:
        grads = wb.per_sample_gradients(model, CE, x, y, method=method)
        assert grads["0.weight"].shape == (4, 8, 3)


# ---- errors ----------------------------------------------------------------------------------

def small():
    torch.manual_seed(0)
    return nn.Linear(3, 2), torch.randn(4, 3), torch.randint(0, 2, (4,))


@pytest.mark.parametrize("method", wb.METHODS)
def test_scalar_loss_is_rejected(method):
    model, x, y = small()
    with pytest.raises(wb.LossShapeError, match="reduction='none'"):
        wb.per_sample_gradients(model, nn.CrossEntropyLoss(), x, y, method=method)


def test_loss_with_extra_dims_is_rejected():
    model, x, _ = small()
    with pytest.raises(wb.LossShapeError, match=r"shape \(4,\); got shape \(4, 2\)"):
        wb.per_sample_gradients(model, lambda o, t: o ** 2, x, None)


@pytest.mark.parametrize("method", wb.METHODS)
def test_batch_size_mismatch(method):
    model, x, y = small()
    with pytest.raises(ValueError, match="n = 4 on dim 0, targets has 3"):
        wb.per_sample_gradients(model, CE, x, y[:3], method=method)


@pytest.mark.parametrize("method", wb.METHODS)
def test_empty_batch(method):
    model, x, y = small()
    with pytest.raises(ValueError, match="empty batch"):
        wb.per_sample_gradients(model, CE, x[:0], y[:0], method=method)


def test_unknown_method():
    model, x, y = small()
    with pytest.raises(ValueError, match=r"method must be one of .*got 'ghosts'"):
        wb.per_sample_gradients(model, CE, x, y, method="ghosts")


def test_inputs_of_wrong_type():
    model, _, y = small()
    with pytest.raises(TypeError, match="inputs must be a Tensor"):
        wb.per_sample_gradients(model, CE, [[1.0, 2.0, 3.0]], y)


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(4), nn.SyncBatchNorm(4),
                                   nn.InstanceNorm1d(4, track_running_stats=True)])
@pytest.mark.parametrize("method", wb.METHODS)
def test_sample_mixing_layers_raise(layer, method):
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(layer), nn.Linear(4, 2))
    x, y = torch.randn(4, 3, 5) if "Instance" in type(layer).__name__ else torch.randn(4, 3), None
    with pytest.raises(wb.SampleMixingError, match=rf"{type(layer).__name__} at 1\.0 .*fix"):
        wb.per_sample_gradients(model, mse_per_sample, x, y, method=method)


# ---- nothing left behind ---------------------------------------------------------------------

def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
               for m in model.modules())


@pytest.mark.parametrize("method", wb.METHODS)
def test_model_state_untouched(method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.grad = torch.ones_like(model[0].weight)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    wb.per_sample_gradients(model, CE, x, y, method=method)
    assert hook_count(model) == 0
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_hooks_removed_when_the_call_raises():
    model, x, y = small()
    with pytest.raises(wb.LossShapeError):
        wb.per_sample_gradients(model, nn.CrossEntropyLoss(), x, y, method="einsum")
    assert hook_count(model) == 0
    with pytest.raises(RuntimeError):
        wb.per_sample_gradients(model, CE, torch.randn(4, 5), y, method="einsum")
    assert hook_count(model) == 0
    grads = wb.per_sample_gradients(model, CE, x, y)  # still usable
    assert grads["weight"].shape == (4, 2, 3)


def test_inplace_activation_after_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    assert_agree(model, CE, x, y)


@pytest.mark.parametrize("layer,x", [
    (nn.LSTM(3, 4, batch_first=True), torch.randn(2, 5, 3)),
    (nn.GRU(3, 4), torch.randn(5, 2, 3)),
])
def test_fused_recurrent_layers_raise_instead_of_silent_zeros(layer, x):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = layer

        def forward(self, x):
            return self.rnn(x)[0].flatten(1).sum(1, keepdim=True)

    with pytest.raises(wb.UnsupportedLayerError, match=r"at rnn returns a tuple.*wb.fix_model"):
        wb.per_sample_gradients(Head(), lambda o, t: o.sum(1), x, None)
    with pytest.raises(wb.UnsupportedLayerError, match="wb.fix_model"):
        wb.per_sample_grad_norms(Head(), lambda o, t: o.sum(1), x, None, method="ghost")
