"""Every model of the zoo: einsum and vmap equal micro-batching in float64."""

import pytest
import torch
from torch import nn

from tests.helpers import assert_agree
from workbench import models


@pytest.mark.parametrize("name", list(models.ZOO))
def test_zoo_model_matches_microbatch(name):
    torch.manual_seed(0)
    model = models.make_model(name).double()
    n = 2 if name == "cifar10_cnn" else 4
    x, y = models.example_batch(name, n, generator=torch.Generator().manual_seed(0),
                                dtype=torch.float64)
    if x.dtype == torch.int64:
        x = x[:, :32]  # shorter reviews keep the reference loop fast; same layers
    assert_agree(model, nn.CrossEntropyLoss(reduction="none"), x, y)
