"""0-d parameters (a learned scale or temperature, CLIP's ``logit_scale``) and (n,) outputs.

A 0-d parameter's per-sample gradient is (n,), and a model returning one number per record
gives (n,) outputs; code that flattened "everything after dim 0" with ``flatten(1)`` raised
IndexError on both: the broadcast rule's norm (``x * self.scale`` used as it is: ghost and
book-keeping clipped sums, every optimizer mode), the optimizer's dot loss on (n,) outputs,
the clipping snapshot's per-layer tables, the audit CLI's mse loss. Every method and
optimizer mode, check on and off, n = 1 and 3.
"""

import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import (
    assert_agree,
    assert_clipped_sums_agree,
    assert_optimizer_matches_microbatch,
)


class Scaled(nn.Module):
    def __init__(self, per_record=False):
        super().__init__()
        self.lin, self.per_record = nn.Linear(3, 2), per_record
        self.scale, self.shift = nn.Parameter(torch.tensor(1.5)), nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        out = torch.tanh(self.lin(x)) * self.scale + self.shift  # used as they are
        return out.sum(1) if self.per_record else out  # (n,) or (n, 2)


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def mse(out, y):
    return (out - y) ** 2


def problem(per_record, n):
    torch.manual_seed(0)
    model = Scaled(per_record).double()
    x = torch.randn(n, 3, dtype=torch.float64)
    y = torch.randn(n, dtype=torch.float64) if per_record else torch.randint(0, 2, (n,))
    return model, (mse if per_record else ce), x, y


@pytest.mark.parametrize("per_record", [False, True])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("check", [True, False])
def test_functional_methods(per_record, n, check):
    model, loss, x, y = problem(per_record, n)
    assert_agree(model, loss, x, y, methods=("vmap", "einsum"), check=check)
    assert_clipped_sums_agree(model, loss, x, y, 0.05, check=check)


@pytest.mark.parametrize("per_record", [False, True])
@pytest.mark.parametrize("method", ["microbatch", "einsum", "bookkeeping", "auto"])
@pytest.mark.parametrize("verify", [True, False])
def test_optimizer_modes(per_record, method, verify):
    model, loss, _, _ = problem(per_record, 1)
    batches = [problem(per_record, n)[2:] for n in (1, 3, 2)]
    assert_optimizer_matches_microbatch(model, loss, batches, max_grad_norm=0.05,
                                        method=method, verify=verify)


def test_the_clipping_snapshot_takes_a_0d_parameter():
    from workbench.clipping.snapshot import clip_at, per_sample_snapshot

    model, loss, x, y = problem(False, 3)
    result = clip_at(per_sample_snapshot(model, loss, x, y), 0.05)
    norms = wb.per_sample_grad_norms(model, loss, x, y, method="microbatch")
    assert result.num_params == 6 + 2 + 1 + 1
    torch.testing.assert_close(torch.as_tensor(result.norms), norms, rtol=1e-9, atol=0)


def test_the_audit_mse_loss_takes_per_record_outputs():
    from workbench.audit.cli import LOSSES

    out, y = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(LOSSES["mse"](out, y), (out - y) ** 2)
