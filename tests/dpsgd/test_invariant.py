"""The privacy invariant, against a float64 per-record twin: each record's contribution to the
released (noiseless, σ = 0) clipped sum is its own gradient clipped to C, whatever the loss,
the randomness and the step (issue 24, families 1 and 2; issue 25 item 1, the T5 case).

Exact cases: the engine's released sum equals the twin's Σ_i clip_C(∇ℓ_i), ℓ_i record i's own
loss (``per_sample/loss.py`` Eq. 1), and removing any one record moves it by at most C.
Coupling cases raise a specific error before anything is released.
"""

import pytest
import torch
from torch import nn

from workbench.dpsgd.optimizer import MODES, DPOptimizer
from workbench.errors import (
    LossCouplingError,
    PerSampleCheckError,
    SampleMixingError,
    UnattributedGradientError,
)

ALL_MODES = (*MODES, "auto")
C, N, D, K = 0.7, 6, 5, 4  # clip norm, batch, features, classes
TOL = 1e-9


def mlp(seed=0, out=K):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, out)).double()


def batch(n=N, seed=1, out=K):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=torch.float64), torch.randint(0, out, (n,),
                                                                              generator=g)


def released(model, loss_of_batch, x, y, mode, reduction="mean", scaler=None, **kw):
    """Σ_i c_i g_i (flat) from one DP step with σ = 0, B = 1 and lr = 0 (the weights stay)."""
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    opt = DPOptimizer(inner, model, noise_multiplier=0.0, max_grad_norm=C,
                      expected_batch_size=1.0, method=mode,
                      loss_reduction=reduction, **kw)
    try:
        opt.zero_grad()
        loss = loss_of_batch(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    finally:
        opt.detach()


def twin(model, record_loss, x, y):
    """Σ_i clip_C(∇ℓ_i) with ℓ_i = record_loss(model(x_i), y_i), one record at a time."""
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(x.shape[0]):
        g = torch.autograd.grad(record_loss(model(x[i:i + 1]), y[i:i + 1]), params,
                                allow_unused=True)
        g = torch.cat([torch.zeros_like(p).flatten() if t is None else t.flatten()
                       for p, t in zip(params, g)])
        total += min(1.0, C / max(float(g.norm()), 1e-300)) * g
    return total


def assert_invariant(make, loss_of_batch, record_loss, x, y, mode, **kw):
    model = make()
    got = released(model, loss_of_batch, x, y, mode, **kw)
    ref = twin(model, record_loss, x, y)
    assert float((got - ref).norm()) <= TOL * max(1.0, float(ref.norm())), mode
    for j in (0, x.shape[0] - 1):  # remove one record: the released sum moves by <= C
        keep = torch.arange(x.shape[0]) != j
        other = released(make(), loss_of_batch, x[keep], y[keep], mode, **kw)
        assert float((got - other).norm()) <= C * (1 + 1e-9)


W = torch.tensor([0.3, 2.0, 1.0, 0.7], dtype=torch.float64)
SEP = {  # name: (batch loss of the loop, record i's own loss, loss_reduction)
    "weight mean": (nn.CrossEntropyLoss(weight=W), nn.CrossEntropyLoss(weight=W, reduction="sum"),
                    "mean"),
    "weight sum": (nn.CrossEntropyLoss(weight=W, reduction="sum"),
                   nn.CrossEntropyLoss(weight=W, reduction="sum"), "sum"),
    "label smoothing + weight": (nn.CrossEntropyLoss(weight=W, label_smoothing=0.2),
                                 nn.CrossEntropyLoss(weight=W, label_smoothing=0.2,
                                                     reduction="sum"), "mean"),
    "nll weight": (lambda o, y: nn.NLLLoss(weight=W)(o.log_softmax(1), y),
                   lambda o, y: nn.NLLLoss(weight=W, reduction="sum")(o.log_softmax(1), y),
                   "mean"),
    "scaled k = 3": (lambda o, y: 3 * nn.CrossEntropyLoss()(o, y),
                     lambda o, y: 3 * nn.CrossEntropyLoss()(o, y), "mean"),
}


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("case", sorted(SEP))
def test_class_losses_are_per_record_exact(case, mode):
    loss, own, reduction = SEP[case]
    x, y = batch()
    assert_invariant(mlp, loss, own, x, y, mode, reduction=reduction)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
@pytest.mark.parametrize("case", ["bce pos_weight", "mse", "huber"])
def test_elementwise_losses_are_per_record_exact(case, mode):
    x, _ = batch()
    y = (torch.randn(N, K, generator=torch.Generator().manual_seed(3), dtype=torch.float64) > 0
         ).double()
    pos = torch.tensor([2.0, 0.5, 1.0, 3.0], dtype=torch.float64)
    loss = {"bce pos_weight": nn.BCEWithLogitsLoss(pos_weight=pos), "mse": nn.MSELoss(),
            "huber": nn.HuberLoss(delta=0.3)}[case]
    assert_invariant(mlp, loss, loss, x, y, mode)


class TokenLM(nn.Module):
    """Embedding -> Linear per token: out (n, T, V)."""

    def __init__(self, V=7, d=4):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, d), nn.Linear(d, V)

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens))).double()


def lm_batch(n, T, seed=5, V=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (n, T), generator=g)
    y = torch.randint(0, V, (n, T), generator=g)
    y[torch.rand(n, T, generator=g) < 0.4] = -100  # Hugging Face's ignored labels
    y[0] = -100  # a record with no token: contributes 0
    return x, y


def lm_loss(out, y):
    return nn.CrossEntropyLoss()(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def lm_own(out, y):  # record i's token mean over its own non-ignored tokens (loss.py Eq. 1)
    s = nn.CrossEntropyLoss(reduction="sum")(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return s / max(int((y != -100).sum()), 1)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("T", [3, N])  # n != T and n == T
def test_ignore_index_token_mean_is_per_record(T, mode):
    x, y = lm_batch(N, T)
    assert_invariant(lambda: TokenLM().double(), lm_loss, lm_own, x, y, mode)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_grad_scaler_is_divided_out(mode):
    x, y = batch()
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    got = released(model, nn.CrossEntropyLoss(), x, y, mode, scaler=scaler)
    ref = twin(model, nn.CrossEntropyLoss(), x, y)
    assert float((got - ref).norm()) <= TOL * float(ref.norm())


def test_unscale_before_step_is_refused():
    x, y = batch()
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=N)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(nn.CrossEntropyLoss()(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(ValueError, match="unscale_"):
        scaler.step(opt)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping"])
def test_l2_penalty_in_the_loss_is_refused_and_weight_decay_is_exact(mode):
    x, y = batch()
    model = mlp()
    penalty = lambda o, t: nn.CrossEntropyLoss()(o, t) + 0.01 * sum(  # noqa: E731
        p.pow(2).sum() for p in model.parameters())
    with pytest.raises(UnattributedGradientError, match="weight_decay"):
        released(model, penalty, x, y, mode)
    # the route: weight_decay = 2 λ, applied after the noise to the released sum
    model, lam, lr = mlp(), 0.01, 0.5
    before = [p.detach().clone() for p in model.parameters()]
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=lr, weight_decay=2 * lam), model,
                      noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1.0,
                      method=mode)
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    clipped = twin(mlp(), nn.CrossEntropyLoss(), x, y)
    want = torch.cat([b.flatten() for b in before])
    want = want - lr * (clipped + 2 * lam * want)
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float((got - want).norm()) <= 1e-9


class InfoNCE(nn.Module):
    def forward(self, z, y):
        logits = z @ z.T / 0.5  # (n, n): every record against every other
        return nn.functional.cross_entropy(logits, torch.arange(z.shape[0]))


class Centred(nn.Module):
    def forward(self, z, y):
        return nn.functional.cross_entropy(z - z.mean(0), y)


class BatchStats(nn.Module):
    def forward(self, z, y):
        return nn.functional.cross_entropy(z, y) + z.mean(0).pow(2).sum()


class MyCE(nn.CrossEntropyLoss):  # a subclass changing forward inherits no rule
    def forward(self, z, y):
        return super().forward(z / z.norm(dim=0, keepdim=True), y)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping", "auto"])
@pytest.mark.parametrize("loss", [InfoNCE, Centred, BatchStats, MyCE])
@pytest.mark.parametrize("passed", [True, False])
def test_losses_coupling_records_are_refused(loss, mode, passed):
    x, y = batch()
    crit = loss()
    kw = {"criterion": crit} if passed else {}
    with pytest.raises(LossCouplingError, match=type(crit).__name__):
        released(mlp(), crit, x, y, mode, **kw)


class Mixing(nn.Module):
    """x - x.mean(0): every record's output depends on the batch, with some randomness."""

    def __init__(self, noise):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.noise = nn.Linear(D, 8), nn.Linear(8, K), noise

    def forward(self, x):
        h = self.fc1(x)
        h = h - h.mean(0) if self.noise != "independent" else h
        if self.noise in ("dropout", "independent"):
            h = nn.functional.dropout(h, 0.3, self.training)
        elif self.noise == "rand":
            h = h + 0.1 * torch.rand_like(h)
        elif self.noise == "feature drop":
            h = h * (torch.rand(h.shape[1], dtype=h.dtype) > 0.3)
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("noise", ["dropout0", "dropout", "rand", "feature drop"])
def test_models_mixing_records_are_refused_with_randomness(noise, mode):
    x, y = batch()
    model = Mixing(noise).double()
    with pytest.raises((PerSampleCheckError, SampleMixingError)):  # the halves, first
        for _ in range(2):
            released(model, nn.CrossEntropyLoss(), x, y, mode)


@pytest.mark.parametrize("mode", ["einsum", "bookkeeping", "vmap"])
def test_random_independent_model_is_exact_with_its_masks(mode):
    x, y = batch()
    model = Mixing("independent").double()
    torch.manual_seed(11)
    got = released(model, nn.CrossEntropyLoss(), x, y, mode)
    torch.manual_seed(11)  # the twin: the same masks, record by record from one batch pass
    losses = nn.CrossEntropyLoss(reduction="none")(model(x), y)
    params = list(model.parameters())
    ref = 0
    for i in range(N):
        g = torch.cat([t.flatten() for t in torch.autograd.grad(losses[i], params,
                                                                retain_graph=True)])
        ref = ref + min(1.0, C / float(g.norm())) * g
    assert float((got - ref).norm()) <= TOL * float(ref.norm())


class RelativeBias(nn.Module):
    """T5's relative position bias, by hand: an Embedding on a (T, T) bucket matrix, permuted
    to (heads, T, T) and added to the attention scores of every record."""

    def __init__(self, V=7, d=4, heads=2, buckets=5):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rel = nn.Embedding(V, d), nn.Embedding(buckets, heads)
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, K), heads

    def forward(self, tokens):  # (n, T)
        n, T = tokens.shape
        h = self.emb(tokens)
        q, k, v = self.qkv(h).view(n, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T)
        buckets = (pos[None, :] - pos[:, None]).clamp(-2, 2) + 2  # (T, T)
        bias = self.rel(buckets).permute(2, 0, 1)  # (heads, T, T)
        att = (q @ k.transpose(-1, -2) + bias).softmax(-1)  # (n, heads, T, T)
        return self.out((att @ v).transpose(1, 2).reshape(n, T, -1).mean(1))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_t5_relative_bias_exact_at_every_step(mode):
    """Poisson-like sizes 3, 5, 4, 5, 2 with T = 5: from the second step n == T."""
    model = RelativeBias().double()
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    opt = DPOptimizer(inner, model, noise_multiplier=0.0, max_grad_norm=C,
                      expected_batch_size=1.0, method=mode)
    ce, g = nn.CrossEntropyLoss(), torch.Generator().manual_seed(0)
    for n in (3, 5, 4, 5, 2):
        x, y = torch.randint(0, 7, (n, 5), generator=g), torch.randint(0, K, (n,), generator=g)
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        ref = twin(model, nn.CrossEntropyLoss(), x, y)
        assert float((got - ref).norm()) <= TOL * float(ref.norm()), n
    opt.detach()


@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_functional_api_refuses_coupled_loss_with_dropout(method):
    import workbench as wb

    x, y = batch()
    model = Mixing("independent").double()

    def coupled(out, t):  # record i's loss reads the batch mean of the logits
        return nn.functional.cross_entropy(out - out.mean(0), t, reduction="none")

    with pytest.raises((PerSampleCheckError, LossCouplingError)):  # the halves see it first
        if method == "einsum":
            wb.per_sample_gradients(model, coupled, x, y, method=method)
        elif method == "ghost":
            wb.per_sample_grad_norms(model, coupled, x, y, method=method)
        else:
            wb.clipped_grad_sum(model, coupled, x, y, C, method=method)


def test_grad_rescaled_after_backward_is_harmless():
    """clip_grad_norm_ on .grad (an habit from non-private training) changes nothing: DP-SGD
    never reads .grad, and the .grad check accepts a common factor."""
    x, y = batch()
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0)
    nn.CrossEntropyLoss()(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    opt.step()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref = twin(model, nn.CrossEntropyLoss(), x, y)
    assert float((got - ref).norm()) <= TOL * float(ref.norm())
