"""Ghost clipping's second backward pass runs the forward pass again (clipping/ghost.py,
``rerun_losses``): with dropout it must draw the batch's own masks, and leave the caller's
random state as one forward pass leaves it."""

import torch
from torch import nn

import workbench as wb
from tests.helpers import relative_error

CE = nn.CrossEntropyLoss(reduction="none")


def test_ghost_with_dropout_equals_bookkeeping_on_the_same_masks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    results, after = {}, {}
    for method in ("bookkeeping", "ghost"):  # one forward pass each, from the same state
        torch.manual_seed(1)
        results[method] = wb.clipped_grad_sum(model, CE, x, y, 0.2, method=method)
        after[method] = torch.rand(3)  # the caller's random stream after the call
    for name, g in results["bookkeeping"].items():
        assert relative_error(results["ghost"][name], g) <= 1e-12, name
    assert torch.equal(after["ghost"], after["bookkeeping"])


def test_ghost_rerun_frees_the_first_forward_pass():
    """Nothing of the norm pass is held while the forward pass runs again: the recorder's
    calls are cleared (their inputs a, and the graph's edges)."""
    from workbench.clipping import engine as ghost  # ghost_clipped_sum's home

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    seen = []
    rerun = ghost.rerun_losses

    def spy(rec, *args):
        seen.append(sum(len(calls) for calls in rec.recorder.calls.values()))
        return rerun(rec, *args)

    ghost.rerun_losses = spy
    try:
        got = wb.clipped_grad_sum(model, CE, x, y, 0.2, method="ghost")
    finally:
        ghost.rerun_losses = rerun
    assert seen == [0]
    want = wb.clipped_grad_sum(model, CE, x, y, 0.2, method="microbatch")
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-12, name
