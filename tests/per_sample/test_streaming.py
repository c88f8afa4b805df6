"""The streamed backward pass (per_sample/streaming.py) against the one-shot one (hooks.py).

Its slow twin is ``ActivationRecorder.backward``: one ``autograd.grad`` over every recorded
edge, all backprops returned at the end. Streaming must hand over every call the loss reached
exactly once, with the same b (float64, exact up to summation order: 1e-12 relative), and
capture (hold to the end) only the calls whose node leads to no other recorded call.
"""

import pytest
import torch
from torch import nn

from workbench.clipping.ghost import _covered
from workbench.models import sequence_cross_entropy, tiny_gpt
from workbench.per_sample.recording import record
from workbench.per_sample.streaming import frontier, reaches, stream_backward


class TwoOutputs(nn.Module):
    """A layer returning (used, unused) from two different nodes, then a shared layer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.shared = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.b(x)  # recorded, never reaches the loss
        return self.shared(self.shared(h)) + h


def gpt_case():
    model = tiny_gpt(11, block_size=8, n_layer=2, n_head=2, n_embd=8,
                     generator=torch.Generator().manual_seed(0)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)
    return model, sequence_cross_entropy, x, y


def two_outputs_case():
    torch.manual_seed(0)
    model = TwoOutputs().double()
    return model, lambda out, _: out.pow(2).sum(1), torch.randn(5, 3, dtype=torch.float64), None


def keyed(rec):
    """{(path, k): call} over every recorded call."""
    return {(path, k): call for path in rec.layers
            for k, call in enumerate(rec.recorder.calls[path])}


@pytest.mark.parametrize("case", [gpt_case, two_outputs_case])
def test_streamed_backprops_equal_the_one_shot_pass(case):
    model, loss_fn, x, y = case()
    ref = record(model, loss_fn, x, y, covered=_covered)
    ref.recorder.backward(ref.losses.sum())
    expected = {key: call.backprops for key, call in keyed(ref).items()
                if call.backprops is not None}
    rec = record(model, loss_fn, x, y, covered=_covered)
    by_call = {id(call): key for key, call in keyed(rec).items()}
    seen = []

    def on_call(call):
        seen.append(by_call[id(call)])
        b, ref_b = call.backprops, expected[by_call[id(call)]]
        scale = ref_b.abs().max().item() or 1.0
        assert ((b - ref_b).abs().max() / scale).item() <= 1e-12

    stream_backward(rec.recorder.all_calls(), rec.losses.sum(), on_call)
    assert sorted(seen) == sorted(expected)  # each reached call once, no other
    assert all(call.backprops is None for call in rec.recorder.all_calls())  # none kept


def test_only_the_first_layers_are_captured():
    """tiny_gpt: every node but the token embedding's leads to another recorded call, so
    autograd holds one (n, T, C) gradient to the end, not one per layer."""
    model, loss_fn, x, y = gpt_case()
    rec = record(model, loss_fn, x, y, covered=_covered)
    layer_of = {id(call): path for path, calls in rec.recorder.calls.items() for call in calls}
    passed, captured = frontier(rec.recorder.all_calls())
    assert [layer_of[id(c)] for c in captured] == ["wte"]
    assert len(passed) == len(rec.recorder.all_calls()) - 1


def test_reaches_follows_paths_not_just_edges():
    x = torch.randn(3, requires_grad=True)
    a = x * 2
    b = torch.tanh(a) * 3  # b's node -> tanh's node -> a's node
    c = x + 1  # a side branch: reaches no other target
    nodes = [a.grad_fn, b.grad_fn, c.grad_fn]
    assert reaches(nodes, nodes) == [False, True, False]


def test_hooks_are_removed_after_the_pass():
    model, loss_fn, x, y = two_outputs_case()
    rec = record(model, loss_fn, x, y, covered=_covered)
    calls = []
    stream_backward(rec.recorder.all_calls(), rec.losses.sum(), calls.append, retain_graph=True)
    first = len(calls)
    torch.autograd.grad(rec.losses.sum(), list(model.parameters()), allow_unused=True)
    assert first == 3 and len(calls) == first  # a.x, shared twice; the second pass: no hook
