import torch
from torch import nn

import workbench as wb


def test_validate_lists_every_problem_with_paths():
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8),
        nn.Sequential(nn.InstanceNorm2d(8, affine=True, track_running_stats=True)),
        nn.Flatten(), nn.Bilinear(2, 2, 2),
    )
    problems = wb.validate_model(model)
    assert [(p.path, p.layer, p.blocking) for p in problems] == [
        ("1", "BatchNorm2d", True), ("2.0", "InstanceNorm2d", True), ("4", "Bilinear", False)]
    assert "wb.fix_model" in str(problems[0])
    assert wb.validate_model(nn.Linear(2, 2)) == []


def test_fix_model_replaces_mixing_layers_and_keeps_original():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 48, 3), nn.BatchNorm2d(48),
                          nn.InstanceNorm2d(48, affine=True, track_running_stats=True))
    with torch.no_grad():
        model[1].weight.uniform_()
    fixed = wb.fix_model(model)
    assert isinstance(model[1], nn.BatchNorm2d)  # the original is untouched
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_groups == 16  # gcd(32, 48)
    assert torch.equal(fixed[1].weight, model[1].weight)
    assert not fixed[2].track_running_stats
    assert wb.validate_model(fixed) == []
    x = torch.randn(3, 1, 6, 6)
    grads = wb.per_sample_gradients(fixed, lambda o, t: o.flatten(1).sum(1), x, None)
    assert grads["1.weight"].shape == (3, 48)


def test_fix_model_on_a_bare_batchnorm():
    fixed = wb.fix_model(nn.BatchNorm1d(6))
    assert isinstance(fixed, nn.GroupNorm) and fixed.num_groups == 2
