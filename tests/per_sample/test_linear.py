import pytest
import torch
from torch import nn

from tests.helpers import assert_agree, mse_per_sample, random_batch


@pytest.mark.parametrize("lead", [(), (5,), (3, 4)], ids=["2d", "seq", "two-leading"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_microbatch(lead, bias):
    torch.manual_seed(0)
    model = nn.Linear(6, 4, bias=bias).double()
    x, y = random_batch((7, *lead, 6), (7, *lead, 4))
    assert_agree(model, mse_per_sample, x, y)


def test_linear_float32_tolerance():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 3))
    x, y = random_batch((16, 10, 32), (16, 10, 3), dtype=torch.float32)
    assert_agree(model, mse_per_sample, x, y)


def test_mlp_classifier():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(9, 3, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (9,))
    assert_agree(model, nn.CrossEntropyLoss(reduction="none"), x, y)
