"""DPOptimizer.skip_weight_grads: the same updates with autograd's weight gradients skipped."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from workbench.dpsgd import MODES, DPOptimizer
from workbench.errors import UnattributedGradientError


class Tied(nn.Module):
    """Embedding, Linear, LayerNorm, Conv1d, dropout and a tied head ``F.linear(h, E)``."""

    def __init__(self, dropout=0.0, pos=True):
        super().__init__()
        self.with_pos = pos
        self.emb, self.fc, self.norm = nn.Embedding(11, 6), nn.Linear(6, 6), nn.LayerNorm(6)
        self.conv, self.drop = nn.Conv1d(6, 6, 3, padding=1), nn.Dropout(dropout)

        # a position-wise layer called without the batch (per_sample/broadcast.py)
        self.pos = nn.Embedding(5, 6)

    def forward(self, ids):  # (n, T)
        T = ids.shape[1]
        h = self.emb(ids)  # (n, T, 6)
        if self.with_pos:
            h = h + self.pos(torch.arange(T)).unsqueeze(0)
        h = self.norm(torch.relu(self.fc(self.drop(h))))
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return F.linear(h.mean(1), self.emb.weight)  # (n, 11), the tied head


def data(steps, n=6, T=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (n + k % 2, T), generator=g),
             torch.randint(0, 11, (n + k % 2,), generator=g)) for k in range(steps)]


def train(skip, mode, steps=3, penalty=0.0, dropout=0.0, accumulate=1):
    torch.manual_seed(0)
    model = Tied(dropout, pos=not dropout).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.3,
                      max_grad_norm=0.7, expected_batch_size=6, method=mode,
                      generator=torch.Generator().manual_seed(2))
    if skip is not None:  # None: the default
        opt.skip_weight_grads = skip
    batches = data(steps * accumulate)
    torch.manual_seed(3)  # the dropout masks
    for k in range(steps):
        opt.zero_grad()
        for x, y in batches[k * accumulate:(k + 1) * accumulate]:
            loss = F.cross_entropy(model(x), y)
            if penalty:
                loss = loss + penalty * model.fc.weight.pow(2).sum()
            loss.backward()
            if skip or skip is None:  # its own weight gradient was skipped, its uses
                # outside are not (the default: from the first step; it keeps the smallest
                # layer's there, the LayerNorm)
                assert model.fc.weight.grad is None or penalty
                assert model.emb.weight.grad is not None  # the tied head's use
        assert all(p.requires_grad for p in model.parameters())
        opt.step()
    opt.detach()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_same_updates_bitwise_in_every_mode(mode):
    for a, b in zip(train(False, mode), train(True, mode)):
        assert torch.equal(a, b), mode


def test_same_updates_with_dropout_and_two_backward_passes_per_step():
    # without the position embedding: with it and dropout the self-check refuses the batch
    # with or without skip_weight_grads (reported, not this file's subject)
    for a, b in zip(train(False, "bookkeeping", dropout=0.3, accumulate=2),
                    train(True, "bookkeeping", dropout=0.3, accumulate=2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("skip", [False, True])
def test_a_penalty_on_a_skipped_weight_is_still_refused(skip):
    with pytest.raises(UnattributedGradientError, match="fc.weight"):
        train(skip, "bookkeeping", penalty=0.1)


def linear_with_skip():
    model = nn.Sequential(nn.Linear(3, 2)).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=4)
    opt.skip_weight_grads = True
    return model, opt


def test_requires_grad_restored_when_the_forward_raises():
    model, opt = linear_with_skip()
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 5, dtype=torch.float64))  # wrong width: the matmul raises
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(TypeError, match="skip_weight_grads"):
        opt.skip_weight_grads = 1
    opt.detach()


def test_no_grad_and_eval_passes_are_untouched():
    model, opt = linear_with_skip()
    with torch.no_grad():
        out = model(torch.randn(4, 3, dtype=torch.float64))
    assert out.grad_fn is None
    opt.detach()
    out = model(torch.randn(4, 3, dtype=torch.float64))  # detached: ordinary autograd
    out.sum().backward()
    assert model[0].weight.grad is not None


def test_passes_outside_zero_grad_and_step_keep_their_gradients():
    model, opt = linear_with_skip()
    x = torch.randn(4, 3, dtype=torch.float64)
    opt.zero_grad()
    model(x).sum(1).mean().backward()  # the mean over records: loss_reduction="mean"
    assert model[0].weight.grad is None  # skipped inside the step's window
    opt.step()
    w = model[0].weight
    grad, = torch.autograd.grad(model(x).sum(), [w])  # after the step: an ordinary pass
    assert torch.equal(grad, torch.ones(2, 1, dtype=torch.float64) * x.sum(0))
    opt.detach()


def test_grad_scaler_is_refused_not_misread():
    model, opt = linear_with_skip()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt.zero_grad()
    scaler.scale(model(torch.randn(4, 3, dtype=torch.float64)).sum(1).mean()).backward()
    with pytest.raises(ValueError, match="skip_weight_grads"):
        scaler.step(opt)
    opt.detach()


def default_loop(steps, scaler=None, skip=None):
    """The default optimizer (skip_weight_grads not set) on two Linear layers: whether the
    bigger one's .grad was kept before each step (the smaller one's is kept at the first step,
    for a GradScaler's inf check), and whether every .grad is set after it."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.5,
                      max_grad_norm=1.0, expected_batch_size=4,
                      generator=torch.Generator().manual_seed(0))
    if skip is not None:
        opt.skip_weight_grads = skip
    kept, after = [], []
    for k in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator()
                                 .manual_seed(k))).sum(1).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        kept.append(model[0].weight.grad is not None)
        assert k or skip is not None or model[2].weight.grad is not None  # the smallest
        # layer, at the first step
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        after.append(all(p.grad is not None for p in model.parameters()))
    opt.detach()
    return kept, after, [p.detach().clone() for p in model.parameters()]


def test_default_skips_from_the_first_step_and_step_sets_every_grad():
    # the .grad contract: before step() no non-private gradient of a recorded layer is kept
    # (from the first step, but for the smallest layer there: a GradScaler's inf check needs
    # one .grad); after step() every parameter holds the private one
    kept, after, _ = default_loop(3)
    assert kept == [False, False, False] and all(after)


def test_default_stops_skipping_under_a_grad_scaler_from_the_first_step():
    """The scaler's first inf check runs on the smallest layer's .grad (scaler.update() finds
    it); from the second step it sees every .grad. The updates equal skipping off, bit for
    bit: nothing DP-SGD computes reads the skipped gradients."""
    torch.manual_seed(0)
    kept, after, params = default_loop(3, torch.amp.GradScaler("cpu", init_scale=4.0))
    assert kept == [False, True, True] and all(after)
    torch.manual_seed(0)
    _, _, off = default_loop(3, torch.amp.GradScaler("cpu", init_scale=4.0), skip=False)
    assert all(torch.equal(a, b) for a, b in zip(params, off))


def test_a_grad_scaler_first_seen_at_a_later_step_is_refused():
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.5,
                      max_grad_norm=1.0, expected_batch_size=4)
    x = torch.randn(4, 3, dtype=torch.float64)
    opt.zero_grad()
    model(x).sum(1).mean().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt.zero_grad()
    scaler.scale(model(x).sum(1).mean()).backward()
    with pytest.raises(ValueError, match="skip_weight_grads"):
        scaler.step(opt)
    opt.detach()


def test_default_updates_equal_skipping_off_bitwise():
    default = train(None, "bookkeeping", steps=4)
    for a, b in zip(train(False, "bookkeeping", steps=4), default):
        assert torch.equal(a, b)


def _hooked(kind):
    """A layer whose weight a pre-hook computes from other parameters, outside its forward."""
    torch.manual_seed(0)
    first = nn.Linear(4, 5)
    if kind == "weight_norm":
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
            first = torch.nn.utils.weight_norm(first)
    else:
        from torch.nn.utils import prune
        prune.random_unstructured(first, "weight", amount=0.4)
    return nn.Sequential(first, nn.Tanh(), nn.Linear(5, 3)).double()


@pytest.mark.parametrize("kind", ["weight_norm", "prune"])
@pytest.mark.parametrize("skip", [None, True])
@pytest.mark.parametrize("mode", ["bookkeeping", "einsum"])
def test_a_weight_a_pre_hook_computes_is_exact_with_the_check_off(kind, skip, mode):
    """The skipper's pre-hook runs after the layer's own: the weight they compute from
    weight_g/weight_v (or weight_orig and the mask) keeps its graph and its use is seen. Run
    first, with skip_weight_grads = True and verify off, weight_g/weight_v came out 100% off,
    silently (the default skips from the first step, so it was the default's case too)."""
    import workbench as wb

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), \
        torch.randn(5, 3, generator=g, dtype=torch.float64)
    mse = lambda out, t: (out - t).pow(2).sum(1)  # noqa: E731
    ref = wb.clipped_grad_sum(_hooked(kind), mse, x, y, 0.5, method="microbatch")
    model = _hooked(kind)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.verify = False
    if skip is not None:
        opt.skip_weight_grads = skip
    for _ in range(2):
        opt.zero_grad()
        mse(model(x), y).sum().backward()
        opt.step()
        for k, p in model.named_parameters():
            assert torch.allclose(p.grad, ref[k], rtol=1e-9, atol=1e-12), k
    opt.detach()


@pytest.mark.parametrize("skip", [None, True])
def test_a_pre_hook_added_after_the_optimizer_still_sees_its_parameters(skip):
    """A pre-hook the user registers after making the optimizer, which reads the layer's
    weight into a loss term (an L2 penalty by hook): the skipper's pre-hook is moved after it
    at each forward pass, so the term keeps its graph and the path check refuses it. Run
    before it, the term had no gradient and was dropped silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=4)
    if skip is not None:
        opt.skip_weight_grads = skip
    terms = []
    model[0].register_forward_pre_hook(lambda m, args: terms.append(m.weight.pow(2).sum()))
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    opt.zero_grad()
    ((model(x) - y).pow(2).sum(1).mean() + 0.1 * terms[-1]).backward()
    assert terms[-1].requires_grad
    with pytest.raises(UnattributedGradientError, match="0.weight"):
        opt.step()
    opt.detach()
