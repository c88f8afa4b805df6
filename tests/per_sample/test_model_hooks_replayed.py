"""The model's own module hooks are state every re-run replays (``state_replay._model_hooks``).

Hugging Face's output capture (``capture_outputs``: Whisper's audio classifier, Wav2Vec2's and
HuBERT's ``ForSequenceClassification`` ask for every hidden state for their weighted layer
sum) registers forward hooks on the encoder's layers at the first call that asks, and marks
the model with an attribute. A re-run of the forward (the self-check's probe, the halves,
micro-batching's n passes, ghost's second pass, the fallback) put the pass's starting
bindings back, so the attribute went and the hooks stayed: the re-run installed them again,
every hidden state was captured twice, then three times, and the weighted sum failed on one
record (``tensor a (4) must match the size of tensor b (2)``). A fresh model, one that had
not run before the workbench's first call, was refused in every method and optimizer mode as
a model that "cannot run on one record alone" until 2026-12-01; ``Lazy`` below is that
spelling without transformers (``tests/per_sample/test_audio_models.py`` runs the real ones).
Against an independent float64 loop over one record at a time.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from tests.helpers import one_at_a_time_grads
from workbench.dpsgd import MODES, DPOptimizer

D, K, LAYERS = 4, 3, 2


class Lazy(nn.Module):
    """A weighted sum over every layer's output, collected by forward hooks the model registers
    on its first call (flagged by an attribute), as transformers' ``capture_outputs`` does."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))
        self.weights = nn.Parameter(torch.randn(LAYERS + 1))
        self.head = nn.Linear(D, K)
        self.collected = None

    def _install(self):
        def hook(module, args, out):
            if self.collected is not None:
                if not self.collected:
                    self.collected.append(args[0])
                self.collected.append(out)
        for layer in self.layers:
            layer.register_forward_hook(hook)
        self.installed = True

    def forward(self, x):
        if not getattr(self, "installed", False):
            self._install()
        self.collected = []
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        states, self.collected = torch.stack(self.collected, 1), None  # (n, LAYERS + 1, D)
        return self.head((states * self.weights.softmax(0)[:, None]).sum(1))


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=torch.float64), \
        torch.randint(0, K, (n,), generator=g)


@pytest.fixture(autouse=True)
def _float64(float64_default):  # (tests/conftest.py)
    yield


def fresh():
    torch.manual_seed(0)
    return Lazy()


def clipped(grads, C):
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    c = (C / norms).clamp(max=1.0)
    return {k: torch.einsum("n,n...->...", c, g) for k, g in grads.items()}


def rel(got, want):
    num = sum((got[k] - want[k]).pow(2).sum() for k in want)
    return float(num.sqrt() / sum(w.pow(2).sum() for w in want.values()).sqrt())


@pytest.mark.parametrize("n", [4, 6])
@pytest.mark.parametrize("method", ["microbatch", "vmap", "einsum", "ghost", "bookkeeping"])
def test_a_fresh_model_installing_its_hooks_is_exact(method, n):
    """The first call of the model is the workbench's: its hooks installed once, exact."""
    x, y = batch(n, n)
    want = one_at_a_time_grads(copy.deepcopy(fresh()), loss_fn, x, y)
    model = fresh()
    if method in ("ghost", "bookkeeping"):
        got, want = wb.clipped_grad_sum(model, loss_fn, x, y, 0.5, method=method), \
            clipped(want, 0.5)
    else:
        got = wb.per_sample_gradients(model, loss_fn, x, y, method=method)
    assert rel(got, want) < 1e-10
    hooks = [len(layer._forward_hooks) - sum(getattr(h, "workbench", False) for h in
                                             layer._forward_hooks.values())
             for layer in model.layers]
    assert hooks == [1] * LAYERS  # the model's own hooks once each, as one pass leaves them


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_the_optimizer_on_a_fresh_model_is_exact(mode):
    model, twin = fresh(), fresh()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=1.0, loss_reduction="sum",
                      method=mode)
    for step, n in enumerate((4, 6, 4)):
        x, y = batch(n, 10 + step)
        want = clipped(one_at_a_time_grads(twin, loss_fn, x, y), 0.5)
        opt.zero_grad()
        loss_fn(model(x), y).sum().backward()
        opt.step()
        got = {k: p.grad for k, p in model.named_parameters()}
        assert rel(got, want) < 1e-10, (step, rel(got, want))
        twin.load_state_dict(model.state_dict())
