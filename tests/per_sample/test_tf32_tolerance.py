"""The self-checks compare float32 at TF32's precision where the device rounds to it.

On an H200 (2026-11-30) the CIFAR-10 CNN's per-sample gradients differed from their exact
twins by 3.2e-3 relative under PyTorch's default flags (cuDNN convolutions in TF32): past
float32's 1e-3, and every convolutional model was refused on a GPU. ``precision.tolerance``
is the one place the checks take their tolerance from; these tests pin what it reads.
"""

import pytest
import torch

import workbench as wb
from workbench.errors import PerSampleCheckError
from workbench.per_sample import precision

CUDA = torch.device("cuda")  # a device object only: nothing here runs on a GPU


@pytest.fixture
def flags():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.get_float32_matmul_precision())
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def test_cpu_float32_keeps_its_tolerance(flags):
    torch.backends.cudnn.allow_tf32 = True
    assert precision.reduced_float32(torch.device("cpu")) is None
    assert precision.tolerance_of(torch.float32, torch.device("cpu")) == 1e-3


def test_cudnn_tf32_default_widens_float32_on_cuda_only(flags):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    assert "cudnn.allow_tf32" in precision.reduced_float32(CUDA)
    assert precision.tolerance_of(torch.float32, CUDA) == precision.TOLERANCE[torch.float16]
    assert precision.tolerance_of(torch.float64, CUDA) == 1e-7  # float64 never rounds to TF32
    torch.backends.cudnn.allow_tf32 = False
    assert precision.reduced_float32(CUDA) is None
    assert precision.tolerance_of(torch.float32, CUDA) == 1e-3
    torch.backends.cuda.matmul.allow_tf32 = True  # which PyTorch reads as precision "high"
    assert precision.tolerance_of(torch.float32, CUDA) == 5e-2


def test_matmul_precision_below_highest_widens_any_device(flags):
    torch.set_float32_matmul_precision("high")
    assert "'high'" in precision.reduced_float32(torch.device("cpu"))
    assert precision.tolerance_of(torch.float32, torch.device("cpu")) == 5e-2
    torch.set_float32_matmul_precision("highest")
    assert precision.tolerance_of(torch.float32, torch.device("cpu")) == 1e-3


class _Rec:
    def __init__(self, dtype, device):
        self.dtype, self.device, self.autocast, self.lowered = dtype, device, None, None


def test_a_recording_is_checked_and_described_at_its_devices_precision(flags):
    torch.backends.cudnn.allow_tf32 = True
    rec = _Rec(torch.float32, CUDA)
    assert precision.tolerance(rec) == 5e-2
    assert "TF32" in precision.described(rec) and "allow_tf32" in precision.described(rec)
    cpu = _Rec(torch.float32, torch.device("cpu"))
    assert precision.tolerance(cpu) == 1e-3 and precision.described(cpu) == "torch.float32"
    rec.autocast = torch.bfloat16  # autocast's own dtype decides: TF32 adds nothing to it
    assert precision.tolerance(rec) == 5e-2 and precision.described(rec) == "torch.bfloat16"


class TwiceLinear(torch.nn.Linear):  # its registered rule is off by 2 on the weight
    pass


@wb.register_grad_sampler(TwiceLinear)
def _twice(layer, activations, backprops):
    a, b = activations[0], backprops
    return {"weight": 2 * torch.einsum("ni,nj->nij", b, a), "bias": b}


def test_float32_checks_still_catch_a_wrong_rule_at_the_widened_tolerance(flags):
    """A rule off by 2x is 100% off: far past TF32's tolerance (5%)."""
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    model = torch.nn.Sequential(TwiceLinear(4, 3))
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    with pytest.raises(PerSampleCheckError, match="TF32"):
        wb.per_sample_gradients(model, lambda o, t: ((o - t) ** 2).sum(1), x, y,
                                method="einsum")


def test_the_message_names_the_fix(flags):
    torch.backends.cudnn.allow_tf32 = True
    words = precision.described(_Rec(torch.float32, CUDA))
    assert "allow_tf32 = False" in words and "float32's" in words
