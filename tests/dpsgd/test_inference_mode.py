"""An evaluation under ``torch.inference_mode()`` between DP steps (probe AL): the pass is
not recorded (its tensors carry no version counter and no graph: nothing of it reaches a
loss), so the loop runs and its steps release what the same loop with a ``no_grad``
evaluation releases. It crashed with "Inference tensors do not track version counter" in
the recorder's row tags until 2026-12-02."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb


def run(evaluation, method):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 6, dtype=torch.float64), torch.randint(0, 3, (40,)))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=0.0, max_grad_norm=0.5, method=method)
    held_out = torch.randn(5, 6, dtype=torch.float64)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        model.eval()
        with evaluation():
            model(held_out)
            model(x)  # the training batch too
        model.train()
        if step == 2:
            break
    return [p.detach().clone() for p in model.parameters()], len(engine.accountant)


@pytest.mark.parametrize("method", ["auto", "einsum", "bookkeeping", "microbatch"])
def test_an_inference_mode_evaluation_between_steps_changes_nothing(method):
    inference, inference_steps = run(torch.inference_mode, method)
    plain, plain_steps = run(torch.no_grad, method)
    assert inference_steps == plain_steps == 3
    for a, b in zip(inference, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
