"""Behaviour probes run a GPU layer's forward on a CPU twin (``rules._rule.cpu_twin``).

On an H200 (2026-11-30) OPT's positional embedding, an ``nn.Embedding`` subclass whose forward
takes an attention mask, given a behaviour rule's float probe, indexed out of range: on the
CPU an IndexError that the probe catches ("does not match"), on CUDA a device-side assert
that no ``except`` catches and that ended CUDA for the process (every later step and model
failed). This machine has no GPU: these tests pin the twin's contract on the CPU and on the
meta device (the stand-in for a device whose tensors are not the CPU's).
"""

import pytest
import torch
from torch import nn

from workbench.rules import _rule
from workbench.rules._rule import PROBE_ERRORS, cpu_twin, probe_forward


class Offset(nn.Embedding):  # OPT's learned positional embedding, in miniature
    def forward(self, mask):
        positions = mask.long().cumsum(1) * mask.long() - 1
        return super().forward(positions + 2)


def test_a_cpu_layer_is_probed_as_itself():
    layer = nn.Linear(3, 2)
    assert cpu_twin(layer) is layer
    a = torch.randn(4, 3)
    assert torch.equal(probe_forward(layer, a), layer(a))


def test_an_out_of_range_probe_raises_a_probe_error_on_the_cpu():
    with pytest.raises(PROBE_ERRORS):
        probe_forward(Offset(4, 2), torch.ones(2, 9))


def test_a_layer_that_cannot_come_to_the_cpu_does_not_match():
    """A layer whose tensors cannot be copied to the CPU (meta here) is "no match" (the exact
    per-layer fallback), never probed where it lives."""
    layer = nn.Linear(3, 2, device="meta")
    with pytest.raises(PROBE_ERRORS):
        probe_forward(layer, torch.randn(4, 3))


def test_the_twin_holds_cpu_copies_and_leaves_the_layer_alone(monkeypatch):
    """The copy path, exercised on the CPU by declaring the layer's tensors off the CPU:
    the twin computes the layer's function on CPU copies, the output comes back to the
    layer's device, and the layer's own parameters are untouched and unshared."""
    layer = nn.Linear(3, 2)
    monkeypatch.setattr(_rule, "_off_cpu", lambda tensors: True)
    twin = cpu_twin(layer)
    assert twin is not layer and twin.weight is not layer.weight
    assert torch.equal(twin.weight, layer.weight) and twin.weight.requires_grad
    a = torch.randn(4, 3)
    assert torch.equal(probe_forward(layer, a), layer(a))
    with torch.no_grad():
        twin.weight.add_(1.0)
    assert not torch.equal(twin.weight, layer.weight)


@pytest.mark.realmodels
@pytest.mark.parametrize("name", ["bit", "timm_resnet_gn", "llama", "timm_convnext"])
def test_every_behaviour_rule_decides_alike_on_the_twin(name, monkeypatch):
    """The behaviour probes (affine layouts, a norm with its activation, a standardised
    convolution; some swap the layer's parameters for probe values first) match the same
    layers when run on the CPU twin as on the layer itself: on a GPU a layer keeps its fast
    rule."""
    import torch.nn as tnn

    from workbench.realzoo import PROBLEMS
    from workbench.rules import affine, linear, norm_activation, std_conv

    def verdicts():
        model = PROBLEMS[name].build(torch.float32)
        return {path: (std_conv.std_conv_eps(m) if isinstance(m, tnn.modules.conv._ConvNd)
                       else None, norm_activation.norm_activation(m), affine.layout_of(m),
                       linear.is_transposed_linear(m))
                for path, m in model.named_modules()}

    direct = verdicts()
    assert any(any(v is not None and v is not False for v in row) for row in direct.values())
    monkeypatch.setattr(_rule, "_off_cpu", lambda tensors: True)
    assert verdicts() == direct
