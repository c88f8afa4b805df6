"""The hand-written backpropagation through time (layers/bptt.py) against its slow twin, the
autograd loops of recurrence.py (``backward_through_time="autograd"``): same outputs, final
states and gradients (weights, inputs, initial states) in float64, for every cell and option,
and both ports (W_hh's gradient directly, or through one recorded call)."""


import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from tests.helpers import assert_agree, mse_per_sample
from tests.layers.wrappers import RNN_OPTIONS, RNNModel, options_id, relative_error
from workbench.layers import DPGRU, DPLSTM, DPRNN, bptt, bptt_forward

KINDS = {
    "rnn_tanh": (DPRNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (DPRNN, {"nonlinearity": "relu"}),
    "gru": (DPGRU, {}),
    "lstm": (DPLSTM, {}),
}
d, H = 3, 4


def make(kind, dtype=torch.float64, **options):
    cls, extra = KINDS[kind]
    torch.manual_seed(0)
    return cls(d, H, **extra, **options).to(dtype)


def outputs_and_gradients(dp, x, hx, form, seed=3):
    """Outputs, final states and d(random linear loss)/d(parameters, x, h0[, c0])."""
    dp.backward_through_time = form
    out, state = dp(x, hx)
    states = state if isinstance(state, tuple) else (state,)
    out = out.data if isinstance(out, PackedSequence) else out
    g = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum()
               for t in (out, *states))
    leaves = [x.data if isinstance(x, PackedSequence) else x]
    leaves += [] if hx is None else list(hx) if isinstance(hx, tuple) else [hx]
    grads = torch.autograd.grad(loss, [*dp.parameters(), *leaves])
    return [out, *states, *grads]


def assert_twins_agree(dp, x, hx, tol=1e-12):
    fast = outputs_and_gradients(dp, x, hx, "bptt")
    slow = outputs_and_gradients(dp, x, hx, "autograd")
    for k, (a, b) in enumerate(zip(fast, slow)):
        assert a.shape == b.shape, k
        assert relative_error(a, b) <= tol, (k, relative_error(a, b))


def initial_states(kind, LD, n, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    h0, c0 = (torch.randn(LD, n, H, generator=g, dtype=dtype, requires_grad=True)
              for _ in range(2))
    return (h0, c0) if kind == "lstm" else h0




@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("options", RNN_OPTIONS, ids=options_id)
def test_bptt_equals_the_autograd_loops(kind, options):
    dp = make(kind, **options)
    n, T = 3, 5
    shape = (n, T, d) if options["batch_first"] else (T, n, d)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert_twins_agree(dp, x, None)
    LD = options["num_layers"] * (2 if options["bidirectional"] else 1)
    assert_twins_agree(dp, x, initial_states(kind, LD, n))  # h0 (and c0) learn too


@pytest.mark.parametrize("kind", KINDS)
def test_bptt_packed_sequences_and_dropout(kind):
    dp = make(kind, num_layers=2, bidirectional=True)
    x = torch.randn(4, 5, d, dtype=torch.float64, requires_grad=True)
    packed = pack_padded_sequence(x, torch.tensor([3, 5, 1, 3]), batch_first=True,
                                  enforce_sorted=False)
    assert_twins_agree(dp, packed, initial_states(kind, 4, 4))
    dp = make(kind, num_layers=3, dropout=0.5)  # the same masks: same seed before each twin
    x = torch.randn(4, 5, d, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    fast = outputs_and_gradients(dp, x, None, "bptt")
    torch.manual_seed(7)
    slow = outputs_and_gradients(dp, x, None, "autograd")
    assert all(relative_error(a, b) <= 1e-12 for a, b in zip(fast, slow))


@pytest.mark.parametrize("kind", KINDS)
def test_per_sample_gradients_through_both_ports(kind):
    # einsum records the parts: the U port (hh called once on all states); vmap runs the
    # autograd loops (torch.func); micro-batching runs bptt's W port on each sample
    dp = make(kind, num_layers=2, bidirectional=True, batch_first=True)
    model = RNNModel(dp)
    x = torch.randn(3, 4, d, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn(model(x).shape, dtype=torch.float64)
    assert_agree(model, mse_per_sample, x, y, strict=True)
    assert_agree(model, mse_per_sample, x, y, methods=("einsum",), strict=True)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_with_the_fast_tanh(kind):
    # per-step tensors above FAST_TANH_MIN: tanh as 2σ(2x) - 1
    cls, extra = KINDS[kind]
    torch.manual_seed(0)
    dp = cls(16, 128, batch_first=True, **extra)
    x = torch.randn(96, 6, 16, requires_grad=True)
    assert x.shape[0] * 128 >= bptt_forward.FAST_TANH_MIN
    fast = outputs_and_gradients(dp, x, None, "bptt")
    slow = outputs_and_gradients(dp, x, None, "autograd")
    for a, b in zip(fast, slow):  # float32: eps 1.2e-7, sums over ~1e3 terms
        assert relative_error(a, b) <= 1e-4


def test_fast_tanh_error_bound():
    x = torch.linspace(-20, 20, 100_001)
    assert x.numel() >= bptt_forward.FAST_TANH_MIN
    assert (bptt_forward.tanh(x) - torch.tanh(x.double())).abs().max() <= 3e-7
    small = torch.linspace(-1, 1, 101)  # below the threshold: torch.tanh itself
    assert torch.equal(bptt_forward.tanh(small), torch.tanh(small))
    out = torch.empty_like(x)
    assert bptt_forward.tanh(x, out=out) is out


def test_double_backward_raises_instead_of_a_wrong_answer():
    dp = make("lstm")
    x = torch.randn(2, 3, d, dtype=torch.float64)
    out, _ = dp(x)
    with pytest.raises(RuntimeError, match="backward_through_time = 'autograd'"):
        torch.autograd.grad(out.square().sum(), list(dp.parameters()), create_graph=True)
    dp.backward_through_time = "autograd"  # the fix the message names
    out, _ = dp(x)
    grads = torch.autograd.grad(out.square().sum(), list(dp.parameters()), create_graph=True)
    assert all(g.requires_grad for g in grads)


def test_in_place_change_of_the_output_leaves_the_gradient_exact():
    dp = make("gru", batch_first=True)
    x = torch.randn(2, 3, d, dtype=torch.float64)
    results = {}
    for form in ("bptt", "autograd"):
        dp.backward_through_time = form
        out, h = dp(x)
        out.mul_(2)  # the outputs are fresh tensors: bptt's saved states are untouched
        results[form] = torch.autograd.grad(out.sum() + h.sum(), list(dp.parameters()))
    for a, b in zip(*results.values()):
        assert relative_error(a, b) <= 1e-12


def test_transforms_and_autocast_use_the_autograd_loops():
    dp = make("lstm", batch_first=True)
    x = torch.randn(3, 4, d, dtype=torch.float64)
    assert bptt.fusable(x, dp.weight_hh_l0)
    seen = []
    torch.func.vmap(lambda xi: seen.append(bptt.fusable(xi)) or xi)(x)
    assert seen == [False]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not bptt.fusable(x)
    out = torch.func.vmap(lambda xi: dp(xi.unsqueeze(0))[0])(x)  # runs, via the loops
    dp.backward_through_time = "autograd"
    assert relative_error(out.squeeze(1), dp(x)[0]) <= 1e-12


def test_backward_through_time_must_be_a_known_form():
    dp = make("rnn_tanh")
    dp.backward_through_time = "fast"
    with pytest.raises(ValueError, match="backward_through_time"):
        dp(torch.randn(2, 3, d, dtype=torch.float64))


def test_unrecorded_layer_runs_one_node_per_layer_and_direction():
    # the point of bptt: a handful of autograd nodes, not ~15 per time step
    dp = make("lstm", num_layers=2, bidirectional=True)
    x = torch.randn(5, 3, d, dtype=torch.float64)
    nodes = {}
    for form in ("bptt", "autograd"):
        dp.backward_through_time = form
        nodes[form] = graph_nodes(dp(x)[0].grad_fn)
    assert sum(type(node).__name__ == "BPTTBackward" for node in nodes["bptt"]) == 4  # L D
    assert 4 * len(nodes["bptt"]) < len(nodes["autograd"])  # T = 5 steps here


def graph_nodes(fn) -> set:
    seen, stack = set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return seen


@pytest.mark.parametrize("keep_output", [False, True])
def test_u_port_frees_its_unread_output_only_when_nobody_else_holds_it(keep_output,
                                                                       monkeypatch):
    """The U port's hooked call U = hh(H_prev) is an input of the BPTT node for its gradient
    edge only: its (n, T, G H) memory is freed before the node runs, unless someone else
    (here a forward hook of the user's) holds U; gradients stay exact either way."""
    dp = make("lstm", batch_first=True)
    kept, sizes = [], []
    apply = bptt.BPTT.apply
    monkeypatch.setattr(bptt.BPTT, "apply", lambda *a: sizes.append(a[4].untyped_storage()
                                                                    .nbytes()) or apply(*a))
    dp.parts["hh_l0"].register_forward_hook(  # something records hh: the U port
        lambda module, args, out: kept.append(out) if keep_output else None)
    x = torch.randn(3, 5, d, dtype=torch.float64)
    out, _ = dp(x)
    assert sizes == [3 * 5 * 4 * H * 8 if keep_output else 0]
    if keep_output:
        Hp = torch.cat([torch.zeros(3, 1, H, dtype=torch.float64), out[:, :-1]], dim=1)
        torch.testing.assert_close(kept[0], Hp @ dp.weight_hh_l0.t(), rtol=1e-12, atol=1e-14)
    fast = torch.autograd.grad(out.square().sum(), list(dp.parameters()))
    dp.backward_through_time = "autograd"
    slow = torch.autograd.grad(dp(x)[0].square().sum(), list(dp.parameters()))
    for a, b in zip(fast, slow):
        assert relative_error(a, b) <= 1e-12
