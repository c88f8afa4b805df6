"""A batch-free call (``tok + pos(arange(T))``, per_sample/broadcast.py) followed by dropout:
the optimizer's self-check must accept the model in every mode, with or without
skip_weight_grads and with two backward passes per step (a refusal of book-keeping, norm
14.04 vs 13.99, was reported on this model; not reproduced since)."""

import pytest
import torch
from torch.nn import functional as F

from tests.dpsgd.test_skip_weights import Tied, data
from workbench.dpsgd import MODES, DPOptimizer


@pytest.mark.parametrize("mode", [*MODES, "auto"])
@pytest.mark.parametrize("skip,accumulate", [(False, 1), (True, 2)])
def test_positions_then_dropout_train_in_every_mode(mode, skip, accumulate):
    torch.manual_seed(0)
    model = Tied(dropout=0.3, pos=True).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.3,
                      max_grad_norm=0.7, expected_batch_size=6, method=mode,
                      generator=torch.Generator().manual_seed(2))
    opt.skip_weight_grads = skip
    batches = data(3 * accumulate)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        for k in range(3):
            opt.zero_grad()
            for x, y in batches[k * accumulate:(k + 1) * accumulate]:
                F.cross_entropy(model(x), y).backward()
            opt.step()  # the self-check compares with micro-batching under the same masks
    finally:
        opt.detach()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
