"""The model zoo: exact parameter counts, forward shapes on example batches, sane layers."""

import pytest
import torch
from torch import nn

from workbench.models import (
    ZOO,
    MeanOver,
    cifar10_cnn,
    count_parameters,
    digits_cnn,
    digits_mlp,
    example_batch,
    imdb_embedding,
    make_model,
    mnist_cnn,
)

# Counts from Yousefpour et al. 2021 (arXiv 2109.12298) / Fast-DPSGD's PyTorch models.
EXPECTED_PARAMS = {
    mnist_cnn: 26_010,
    cifar10_cnn: 605_226,
    imdb_embedding: 160_098,
    digits_cnn: 9_930,
    digits_mlp: 9_610,
}


@pytest.mark.parametrize(
    "factory, expected", EXPECTED_PARAMS.items(), ids=[f.__name__ for f in EXPECTED_PARAMS]
)
def test_parameter_count(factory, expected):
    assert count_parameters(factory()) == expected


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_entry_count_matches_model(name):
    assert count_parameters(make_model(name)) == ZOO[name].num_params


@pytest.mark.parametrize("name", sorted(ZOO))
def test_forward_on_example_batch(name):
    entry = ZOO[name]
    torch.manual_seed(0)
    model = make_model(name)
    inputs, targets = example_batch(name, 3, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == (3, *entry.input_shape) and targets.shape == (3,)
    assert targets.dtype == torch.int64 and targets.max() < entry.num_classes
    outputs = model(inputs)
    assert outputs.shape == (3, entry.num_classes)
    loss = nn.functional.cross_entropy(outputs, targets)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_example_batch_dtypes_and_generator():
    tokens, _ = example_batch("imdb_embedding", 2, generator=torch.Generator().manual_seed(1))
    assert tokens.dtype == torch.int64 and 0 <= tokens.min() and tokens.max() < 10_004
    images, _ = example_batch("digits_cnn", 4, dtype=torch.float64)
    assert images.dtype == torch.float64 and 0 <= images.min() and images.max() < 1
    first = example_batch("mnist_cnn", 2, generator=torch.Generator().manual_seed(7))
    second = example_batch("mnist_cnn", 2, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_float64_forward():
    model = digits_cnn().double()
    inputs, _ = example_batch("digits_cnn", 2, dtype=torch.float64)
    assert model(inputs).dtype == torch.float64


def test_mnist_cnn_tanh_variant_has_same_count():
    model = mnist_cnn(activation=nn.Tanh)
    assert count_parameters(model) == 26_010
    assert isinstance(model.act1, nn.Tanh)


def test_imdb_embedding_takes_any_length():
    tokens = torch.randint(0, 10_004, (2, 7))
    assert imdb_embedding()(tokens).shape == (2, 2)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_no_batchnorm_and_no_inplace(name):
    for module in make_model(name).modules():
        assert not isinstance(module, nn.modules.batchnorm._BatchNorm)
        assert not getattr(module, "inplace", False)


def test_mean_over_spatial_and_tokens():
    x = torch.arange(24.0).reshape(2, 3, 2, 2)
    assert torch.equal(MeanOver((2, 3))(x), x.mean(dim=(2, 3)))
    assert MeanOver(1)(torch.ones(2, 5, 4)).shape == (2, 4)


def test_count_parameters_skips_frozen():
    model = digits_mlp()
    model.fc1.requires_grad_(False)
    assert count_parameters(model) == 1_290
    assert count_parameters(model, trainable_only=False) == 9_610


def test_unknown_name_lists_choices():
    with pytest.raises(KeyError, match="digits_cnn"):
        example_batch("resnet", 2)


def test_bad_batch_size():
    with pytest.raises(ValueError, match="n=0"):
        example_batch("digits_mlp", 0)
