"""The DP layers under every clipping method: norms and clipped sums equal micro-batching's.

Ghost clipping and book-keeping read each part's (activations, backprops) directly; the
one-call form of the recurrence (recurrence.py) keeps W_hh's backward local to its part.
"""

import pytest
import torch

import workbench as wb
from tests.helpers import mse_per_sample
from tests.layers.wrappers import AttentionModel, PackedRNNModel, RNNModel, relative_error
from workbench.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention


def models():
    torch.manual_seed(0)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    rnn = PackedRNNModel(DPGRU(8, 4, num_layers=2, bidirectional=True).double())
    attention = AttentionModel(DPMultiheadAttention(8, 2, add_bias_kv=True, batch_first=True))
    return {"gru_packed": (rnn, (x, torch.tensor([3, 5, 1, 2]))),
            "attention": (attention.double(), (x,))}


@pytest.mark.parametrize("name", ["gru_packed", "attention"])
def test_norms_and_clipped_sums_match_microbatch(name):
    model, inputs = models()[name]
    with torch.no_grad():
        y = torch.randn_like(model(*inputs))
    ref = wb.per_sample_grad_norms(model, mse_per_sample, inputs, y, method="microbatch")
    got = wb.per_sample_grad_norms(model, mse_per_sample, inputs, y, method="ghost")
    assert relative_error(got, ref) <= 1e-9
    C = ref.median().item()  # half the samples clipped
    expected = wb.clipped_grad_sum(model, mse_per_sample, inputs, y, C, method="microbatch")
    for method in ("ghost", "bookkeeping"):
        got = wb.clipped_grad_sum(model, mse_per_sample, inputs, y, C, method=method)
        for key, g in got.items():
            assert relative_error(g, expected[key]) <= 1e-9, (method, key)


def more_models():
    torch.manual_seed(1)
    x = torch.randn(4, 6, 8, dtype=torch.float64)
    k = torch.randn(4, 3, 5, dtype=torch.float64)
    return {
        "lstm": (RNNModel(DPLSTM(8, 4, batch_first=True)), (x,)),
        "rnn_relu_bidirectional": (RNNModel(DPRNN(8, 3, nonlinearity="relu", bidirectional=True,
                                                  batch_first=True)), (x,)),
        "attention_kdim_vdim": (AttentionModel(DPMultiheadAttention(8, 2, kdim=5, vdim=5,
                                                                    batch_first=True)), (x, k, k)),
        "attention_self": (AttentionModel(DPMultiheadAttention(8, 4, batch_first=True)), (x,)),
    }


@pytest.mark.parametrize("name", list(more_models()))
def test_parts_take_ghost_routes_and_match_microbatch(name):
    model, inputs = more_models()[name]
    model = model.double()
    with torch.no_grad():
        y = torch.randn_like(model(*inputs))
    routes = wb.ghost_routes(model, mse_per_sample, inputs, y)
    assert "fast gradient clipping" not in set(routes["route"]), routes
    assert "materialise (shared)" not in set(routes["route"]), routes
    ref = wb.per_sample_grad_norms(model, mse_per_sample, inputs, y, method="microbatch")
    got = wb.per_sample_grad_norms(model, mse_per_sample, inputs, y, method="ghost")
    assert relative_error(got, ref) <= 1e-9
    C = ref.median().item()
    expected = wb.clipped_grad_sum(model, mse_per_sample, inputs, y, C, method="microbatch")
    for method in ("ghost", "bookkeeping"):
        got = wb.clipped_grad_sum(model, mse_per_sample, inputs, y, C, method=method)
        for key, g in got.items():
            assert relative_error(g, expected[key]) <= 1e-9, (method, key)
