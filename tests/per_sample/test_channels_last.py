"""A layer without a rule re-run on its recorded channels_last input: PyTorch 2.13's CPU
GroupNorm backward on an input that requires no grad crashes the process there (timm's
``GroupNorm1Act`` in a channels_last model: a segmentation fault in microbatch and
book-keeping until 2026-11-29). The re-runs now take the input in the default layout
(``checks.dense``). Each case runs in a subprocess, so a regression fails the test instead of
killing the suite."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import sys, torch, warnings
    import torch.nn.functional as F
    from torch import nn
    import workbench as wb
    from workbench.dpsgd import DPOptimizer
    warnings.simplefilter("ignore")

    class GroupNormAct(nn.Module):  # its own affine, F.group_norm: no rule, re-run
        def __init__(self, c):
            super().__init__()
            self.weight = nn.Parameter(1 + 0.1 * torch.randn(c))
            self.bias = nn.Parameter(0.1 * torch.randn(c))

        def forward(self, x):
            return F.silu(F.group_norm(x, 2, self.weight, self.bias))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), GroupNormAct(8),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    model = model.double().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 3, (4,))
    loss = lambda o, t: F.cross_entropy(o, t, reduction="none")
    want = wb.clipped_grad_sum(model, loss, x.contiguous(), y, 0.5, method="microbatch")
    mode = sys.argv[1]
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                      noise_multiplier=0.0, max_grad_norm=0.5, expected_batch_size=1.0,
                      method=mode, loss_reduction="sum")
    opt.zero_grad()
    loss(model(x), y).sum().backward()
    opt.step()
    err = max(float((p.grad - want[k]).norm() / want[k].norm())
              for k, p in model.named_parameters())
    got = wb.clipped_grad_sum(model, loss, x, y, 0.5, method="ghost" if mode == "auto"
                              else "bookkeeping" if mode == "bookkeeping" else "einsum")
    err = max(err, max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want))
    print("ERR", err)
''')


@pytest.mark.parametrize("mode", ["microbatch", "einsum", "bookkeeping"])
def test_a_rule_less_group_norm_on_channels_last_inputs(mode):
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    err = float(done.stdout.split("ERR")[-1])
    assert err < 1e-9
