"""Audit findings of a probe (2026-11-30), each passed or unexplained before:

- ``audit_gradients`` passed vmap on a model that couples records (x - x.mean(0)): the
  reference runs each record alone, and so does vmap; now a failed "model" row says why;
- with dropout in training mode every correct method failed, relative error ~1, with no
  word of why: refused up front, naming model.eval();
- ``audit_dp_step`` raised a bare AttributeError for a step returning a NumPy array;
- ``audit_sampling`` passed a loader that skips empty Poisson batches at small N.
(The bug zoo's three new steps are in test_mechanism.py.)"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.audit import audit_dp_step, audit_gradients, audit_sampling
from workbench.dpsgd.sampling import PoissonBatchSampler


def loss(o, t):
    return F.cross_entropy(o, t, reduction="none")


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,),
                                                                               generator=g)


class Centred(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x - x.mean(0))


def test_a_model_coupling_records_fails_the_gradient_audit_with_the_reason():
    result = audit_gradients(Centred(), loss, *batch(), methods=("vmap",))
    assert not result.passed
    row = result.table[result.table.method == "model"].iloc[0]
    assert "couples the records" in row.error and not row.passed


def test_a_model_drawing_random_numbers_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).train()
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        audit_gradients(model, loss, *batch())
    assert audit_gradients(model.eval(), loss, *batch()).passed  # in evaluation mode: fine


def test_a_step_returning_numpy_is_refused_by_name():
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        audit_dp_step(lambda G: np.zeros(G.shape[1]), 8, 4, 1.0, 1.0, trials=20)


def _poisson_loader(N, q, skip_empty):
    seeds = iter(range(1, 10 ** 6))

    def make(dataset):
        sampler = PoissonBatchSampler(len(dataset), q,
                                      generator=torch.Generator().manual_seed(next(seeds)))

        class Loader:
            def __iter__(self):
                for idx in sampler:
                    if skip_empty and not idx:
                        continue
                    yield torch.tensor(idx, dtype=torch.long)

        return Loader()
    return make


@pytest.mark.parametrize("N, q", [(100, 0.02), (60, 0.03)])
def test_a_loader_skipping_empty_batches_is_rejected(N, q):
    assert audit_sampling(_poisson_loader(N, q, False), N, q).passed
    result = audit_sampling(_poisson_loader(N, q, True), N, q)
    assert not result.passed and "batch sizes" in result.summary
