"""The Fast-DPSGD IMDb LSTM of the model zoo: its size, its layers, its per-sample gradients."""

import torch
from torch import nn

from tests.helpers import assert_agree
from workbench import layers, models


def test_parameter_count_and_the_400_extra_biases():
    model = models.imdb_lstm()
    assert models.count_parameters(model) == models.ZOO["imdb_lstm"].num_params == 1_081_402
    lstm = model.lstm
    assert isinstance(lstm, layers.DPLSTM) and (lstm.input_size, lstm.hidden_size) == (100, 100)
    assert lstm.bias_hh_l0.numel() == 400  # the second bias: 1,081,402 - 1,081,002
    assert "1,081,002" in models.imdb_lstm.__doc__ and "400" in models.imdb_lstm.__doc__
    assert model.emb.weight.shape == (10_004, 100) and model.fc1.weight.shape == (2, 100)


def test_same_function_as_the_torch_nn_lstm_version():
    torch.manual_seed(0)
    model = models.imdb_lstm().double().eval()
    reference = nn.Sequential(model.emb, model.lstm.to_torch(), models.RNNOutput(), model.mean,
                              model.fc1)
    tokens, _ = models.example_batch("imdb_lstm", 3, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(tokens[:, :20]), reference(tokens[:, :20]), rtol=0, atol=1e-12)


def test_per_sample_gradients_match_microbatch():
    torch.manual_seed(0)
    model = models.imdb_lstm().double()
    tokens, labels = models.example_batch("imdb_lstm", 3,
                                          generator=torch.Generator().manual_seed(1))
    assert_agree(model, nn.CrossEntropyLoss(reduction="none"), tokens[:, :12], labels,
                 methods=("einsum",), strict=True)
