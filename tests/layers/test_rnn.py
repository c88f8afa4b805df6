"""DPRNN, DPGRU, DPLSTM: drop-in equal to torch.nn, and per-sample gradients equal to
micro-batching in float64, for every supported option."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import workbench as wb
from tests.helpers import assert_agree, mse_per_sample
from tests.layers.wrappers import (
    RNN_OPTIONS,
    PackedRNNModel,
    RNNModel,
    flat_state,
    options_id,
    relative_error,
)
from workbench.errors import UnsupportedLayerError
from workbench.layers import DPGRU, DPLSTM, DPRNN

KINDS = {  # name -> (torch.nn class, DP class, extra constructor kwargs)
    "rnn_tanh": (nn.RNN, DPRNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNN, DPRNN, {"nonlinearity": "relu"}),
    "gru": (nn.GRU, DPGRU, {}),
    "lstm": (nn.LSTM, DPLSTM, {}),
}
d, H = 3, 4


def twins(kind, seed=0, **options):
    """(torch.nn layer, DP layer) with the same float64 weights."""
    torch_class, dp_class, extra = KINDS[kind]
    torch.manual_seed(seed)
    reference = torch_class(d, H, **extra, **options).double()
    return reference, dp_class.from_torch(reference)


def states(kind, layers_dirs, n, seed=1):
    """Random initial state(s) (L D, n, H): h0, or (h0, c0) for LSTM."""
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(layers_dirs, n, H, generator=g, dtype=torch.float64)
    c0 = torch.randn(layers_dirs, n, H, generator=g, dtype=torch.float64)
    return (h0, c0) if kind == "lstm" else h0


def assert_same_output(a, b, tol=1e-10):
    (out_a, state_a), (out_b, state_b) = a, b
    if isinstance(out_a, nn.utils.rnn.PackedSequence):
        assert torch.equal(out_a.batch_sizes, out_b.batch_sizes)
        for idx_a, idx_b in ((out_a.sorted_indices, out_b.sorted_indices),
                             (out_a.unsorted_indices, out_b.unsorted_indices)):
            assert (idx_a is None and idx_b is None) or torch.equal(idx_a, idx_b)
        out_a, out_b = out_a.data, out_b.data
    assert out_a.shape == out_b.shape
    assert relative_error(out_a, out_b) <= tol
    for s_a, s_b in zip(*(s if isinstance(s, tuple) else (s,) for s in (state_a, state_b))):
        assert s_a.shape == s_b.shape and relative_error(s_a, s_b) <= tol


# --- drop-in: names, init, state_dict, outputs --------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_same_names_shapes_init_and_state_dict(kind):
    torch_class, dp_class, extra = KINDS[kind]
    options = dict(num_layers=2, bidirectional=True, **extra)
    torch.manual_seed(0)
    reference = torch_class(d, H, **options)
    torch.manual_seed(0)
    dp = dp_class(d, H, **options)
    assert [(k, p.shape) for k, p in dp.named_parameters()] == \
        [(k, p.shape) for k, p in reference.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(dp.parameters(), reference.parameters()))
    assert list(dp.state_dict()) == list(reference.state_dict())
    back = torch_class(d, H, **options)
    back.load_state_dict(dp.state_dict())  # train with DP, serve with torch.nn
    x = torch.randn(5, 2, d)
    assert torch.equal(back(x)[0], reference(x)[0])




@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("options", RNN_OPTIONS, ids=options_id)
def test_outputs_equal_torch(kind, options):
    reference, dp = twins(kind, **options)
    n, T = 3, 5
    x = torch.randn((n, T, d) if options["batch_first"] else (T, n, d), dtype=torch.float64)
    assert_same_output(dp(x), reference(x))
    LD = options["num_layers"] * (2 if options["bidirectional"] else 1)
    hx = states(kind, LD, n)
    assert_same_output(dp(x, hx), reference(x, hx))


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input_equals_torch(kind):
    reference, dp = twins(kind, num_layers=2, bidirectional=True)
    x = torch.randn(5, d, dtype=torch.float64)
    assert_same_output(dp(x), reference(x))
    hx = states(kind, 4, 1)
    hx = tuple(h[:, 0] for h in hx) if kind == "lstm" else hx[:, 0]  # (L D, H)
    assert_same_output(dp(x, hx), reference(x, hx))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_sequence_equals_torch(kind, enforce_sorted):
    reference, dp = twins(kind, num_layers=2, bidirectional=True)
    lengths = torch.tensor([5, 3, 3, 1]) if enforce_sorted else torch.tensor([3, 5, 1, 3])
    x = torch.randn(4, 5, d, dtype=torch.float64)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
    assert_same_output(dp(packed), reference(packed))
    hx = states(kind, 4, 4)  # in the caller's sample order, as torch.nn expects
    assert_same_output(dp(packed, hx), reference(packed, hx))


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_between_layers(kind):
    reference, dp = twins(kind, num_layers=3, dropout=0.5)
    x = torch.randn(4, 5, d, dtype=torch.float64)
    dp.eval(), reference.eval()
    assert_same_output(dp(x), reference(x))  # no dropout in eval mode
    dp.train()
    torch.manual_seed(3)
    a = dp(x)[0]
    torch.manual_seed(3)
    assert torch.equal(dp(x)[0], a)  # reproducible from the seed
    assert relative_error(a, reference(x)[0]) > 1e-3  # and really dropping units


# --- per-sample gradients ------------------------------------------------------------------

def target_for(model, *inputs):
    with torch.no_grad():
        shape = model(*inputs).shape
    return torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_per_sample_gradients_stack(kind, batch_first):
    _, dp = twins(kind, num_layers=2, bidirectional=True, batch_first=batch_first)
    model = RNNModel(dp)
    x = torch.randn(3, 4, d, dtype=torch.float64)
    assert_agree(model, mse_per_sample, x, target_for(model, x), strict=True)


@pytest.mark.parametrize("kind", KINDS)
def test_per_sample_gradients_with_initial_state_and_no_bias(kind):
    _, dp = twins(kind, bidirectional=True, bias=False)
    model = RNNModel(dp)
    x = torch.randn(3, 4, d, dtype=torch.float64)
    hx = states(kind, 2, 3)
    inputs = (x, *(h.transpose(0, 1) for h in (hx if kind == "lstm" else (hx,))))
    assert_agree(model, mse_per_sample, inputs, target_for(model, *inputs))


@pytest.mark.parametrize("kind", KINDS)
def test_per_sample_gradients_packed(kind):
    _, dp = twins(kind, num_layers=2, bidirectional=True)
    model = PackedRNNModel(dp)
    x = torch.randn(4, 5, d, dtype=torch.float64)
    lengths = torch.tensor([3, 5, 1, 3])  # unsorted: results come back in this order
    inputs = (x, lengths)
    ref = assert_agree(model, mse_per_sample, inputs, target_for(model, *inputs),
                       methods=("einsum",))  # vmap cannot batch pack_padded_sequence
    assert ref["rnn.weight_ih_l0"][2].abs().sum() > 0  # a one-token sequence still learns


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_per_step_and_one_call_forms_agree(kind):
    _, dp = twins(kind, num_layers=2, bidirectional=True)
    model = PackedRNNModel(dp)
    inputs = (torch.randn(4, 5, d, dtype=torch.float64), torch.tensor([3, 5, 1, 3]))
    y = target_for(model, *inputs)
    results = {}
    for form in ("per_step", "one"):
        dp.recurrent_calls = form
        results[form] = wb.per_sample_gradients(model, mse_per_sample, inputs, y)
    for name, g in results["one"].items():
        assert relative_error(g, results["per_step"][name]) <= 1e-12, name
    x = inputs[0]  # and each form on its own, under every method (vmap included)
    for form in ("per_step", "one"):
        dp.recurrent_calls = form
        assert_agree(RNNModel(dp), mse_per_sample, x, target_for(RNNModel(dp), x))
    dp.recurrent_calls = "sometimes"
    with pytest.raises(ValueError, match="recurrent_calls"):
        dp(x)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_gradient_reaches_a_learned_initial_state(kind):
    # h0 computed by a Linear layer from the input: in the one-call form only the
    # (h - sg(h)) W_hh correction carries the gradient back to it
    _, dp = twins(kind, bidirectional=True)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.init = nn.Linear(d, 2 * H).double()
            self.rnn = dp

        def forward(self, x):
            h0 = self.init(x[:, 0]).view(-1, 2, H).transpose(0, 1).contiguous()  # (2, n, H)
            out, state = self.rnn(x.transpose(0, 1), (h0, torch.zeros_like(h0))
                                  if kind == "lstm" else h0)
            return torch.cat([out.transpose(0, 1).flatten(1), flat_state(state)], dim=1)

    model = Encoder()
    x = torch.randn(3, 4, d, dtype=torch.float64)
    grads = assert_agree(model, mse_per_sample, x, target_for(model, x), strict=True)
    assert grads["init.weight"].abs().sum() > 0


def test_dropout_per_sample_gradients_sum_to_the_batch_gradient():
    _, dp = twins("lstm", num_layers=2, dropout=0.5)
    model = RNNModel(dp)
    x = torch.randn(4, 5, d, dtype=torch.float64)
    y = target_for(model, x)
    torch.manual_seed(5)
    grads = wb.per_sample_gradients(model, mse_per_sample, x, y, method="einsum")
    torch.manual_seed(5)  # the same dropout masks
    params = dict(model.named_parameters())
    batch = torch.autograd.grad(mse_per_sample(model(x), y).sum(), list(params.values()))
    for name, g in zip(params, batch):
        assert relative_error(grads[name].sum(0), g) <= 1e-12, name


def test_frozen_recurrent_weight_still_carries_the_gradient_through_time():
    _, dp = twins("lstm", num_layers=2)
    dp.weight_hh_l0.requires_grad_(False)
    model = RNNModel(dp)
    x = torch.randn(3, 4, d, dtype=torch.float64)
    grads = assert_agree(model, mse_per_sample, x, target_for(model, x))
    assert "rnn.weight_hh_l0" not in grads and "rnn.weight_hh_l1" in grads


# --- conversions, sharing and errors --------------------------------------------------------

def test_parts_follow_conversions_and_assign_loads():
    _, dp = twins("lstm", num_layers=2)
    dp = dp.float()
    assert dp.parts["hh_l1"].weight is dp.weight_hh_l1 and dp.weight_hh_l1.dtype == torch.float32
    clone = copy.deepcopy(dp)
    assert clone.parts["ih_l0"].weight is clone.weight_ih_l0
    fresh = {k: v.clone() + 1 for k, v in dp.state_dict().items()}
    dp.load_state_dict(fresh, assign=True)
    assert dp.parts["ih_l0"].bias_hh is dp.bias_hh_l0 and torch.equal(dp.bias_hh_l0,
                                                                        fresh["bias_hh_l0"])
    assert set(dp.state_dict()) == set(fresh)  # the parts add no keys


@pytest.mark.parametrize("kind", KINDS)
def test_to_torch_round_trip(kind):
    reference, dp = twins(kind, num_layers=2, batch_first=True)
    dp.eval()
    back = dp.to_torch()
    assert type(back) is type(reference) and not back.training and back.batch_first
    x = torch.randn(2, 3, d, dtype=torch.float64)
    assert_same_output(back(x), dp(x))


def test_unsupported_options_and_bad_inputs_raise_clear_errors():
    with pytest.raises(UnsupportedLayerError, match="proj_size=2"):
        DPLSTM(3, 4, proj_size=2)
    with pytest.raises(UnsupportedLayerError, match="proj_size"):
        DPLSTM.from_torch(nn.LSTM(3, 4, proj_size=2))
    with pytest.raises(ValueError, match="nonlinearity"):
        DPRNN(3, 4, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="dropout"):
        DPGRU(3, 4, dropout=1.5)
    with pytest.raises(TypeError, match="expects an nn.GRU"):
        DPGRU.from_torch(nn.LSTM(3, 4))
    lstm = DPLSTM(3, 4, num_layers=2)
    with pytest.raises(ValueError, match=r"initial state has shape \(1, 2, 4\)"):
        lstm(torch.randn(5, 2, 3), (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)))
    with pytest.raises(TypeError, match="tuple"):
        lstm(torch.randn(5, 2, 3), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="input_size=3"):
        lstm(torch.randn(5, 2, 7))


def test_flat_state_helper_orders_batch_first():
    h = torch.arange(12.0).reshape(2, 3, 2)  # (L D, n, H)
    assert flat_state(h).shape == (3, 4) and torch.equal(flat_state(h)[1], h[:, 1].flatten())
