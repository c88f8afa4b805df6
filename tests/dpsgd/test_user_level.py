"""User-level DP (issue 29 item 1) against the float64 per-user micro-batching twin
(``clipping.users.user_clipped_sum_microbatch``): Σ_u clip_C(Σ_{i ∈ R_u} g_i) in every mode,
sum and mean; removing one user moves the noiseless released sum by at most C; the sampler
draws users with probability q and all their records together; the engine charges the users'
q; every unsupported combination raises before a hook is attached."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.clipping.users import user_clipped_sum_microbatch
from workbench.dpsgd.optimizer import MODES, DPOptimizer
from workbench.dpsgd.user_level import UserLevel, UserPoissonBatchSampler

ALL_MODES = (*MODES, "auto")
C, D, K, V, T = 0.6, 5, 4, 11, 3
USERS = torch.tensor([0, 3, 3, 1, 0, 3, 2, 2, 5])  # 5 users, 1 to 3 records each
TOL = 1e-9


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K)).double()


class SeqModel(nn.Module):
    """Embedding -> LayerNorm -> Linear over T positions, mean over positions: exercises the
    Embedding and 3-d Linear user ghost rules and a layer materialised per layer."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.norm, self.head = nn.Embedding(V, 6), nn.LayerNorm(6), nn.Linear(6, K)
        self.double()

    def forward(self, x):
        return self.head(self.norm(self.emb(x))).mean(1)


class TiedSeq(nn.Module):
    """The embedding reused as the head (``F.linear(h, emb.weight)``): one weight in two
    calls, normed by Grams with cross terms (``clipping/cross.py``); its user's norm is the
    norm of the sum over both calls, never the sum of the calls' norms."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.norm = nn.Embedding(V, 8), nn.LayerNorm(8)
        self.double()

    def forward(self, x):
        return nn.functional.linear(self.norm(self.emb(x)), self.emb.weight).mean(1)


MODELS = {"mlp": mlp, "seq": SeqModel, "tied": TiedSeq}


def data(kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = len(USERS)
    x = torch.randn(n, D, generator=g, dtype=torch.float64) if kind == "mlp" else \
        torch.randint(0, V, (n, T), generator=g)
    return x, torch.randint(0, K, (n,), generator=g)


def released(model, x, y, ids, mode, reduction="sum"):
    """Σ_u c_u G_u from one DP step with σ = 0, B = 1, lr = 0."""
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=C, expected_batch_size=1.0, method=mode,
                      loss_reduction="sum")
    opt.user_level = UserLevel(reduction)
    try:
        opt.user_level.set_batch(ids)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    finally:
        opt.detach()


def twin(model, x, y, ids, reduction="sum"):
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    sums = user_clipped_sum_microbatch(model, loss, x, y, ids, C, reduction)
    return torch.cat([s.flatten() for s in sums.values()])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_mode_equals_the_per_user_twin(mode, kind, reduction):
    model = MODELS[kind]()
    x, y = data(kind)
    got = released(model, x, y, USERS, mode, reduction)
    want = twin(model, x, y, USERS, reduction)
    assert torch.allclose(got, want, rtol=TOL, atol=1e-12), (got - want).abs().max()
    # user level is not record level here: some user's sum is clipped as one
    per_record = twin(model, x, y, torch.arange(len(USERS)), reduction)
    assert not torch.allclose(want, per_record, rtol=1e-6)


@pytest.mark.parametrize("mode", ["einsum", "vmap", "bookkeeping"])
def test_removing_one_user_moves_the_sum_by_at_most_C(mode):
    model = SeqModel()
    x, y = data("seq")
    full = released(model, x, y, USERS, mode)
    moves = []
    for u in USERS.unique().tolist():
        keep = USERS != u
        moves.append(float((full - released(model, x[keep], y[keep], USERS[keep], mode)).norm()))
    assert max(moves) <= C * (1 + 1e-9)
    assert max(moves) > 0.5 * C  # the check can fail: a user's move is of order C


def test_user_sampler_includes_each_user_with_probability_q_and_records_together():
    q, steps = 0.3, 4000
    sampler = UserPoissonBatchSampler(USERS, q, steps, torch.Generator().manual_seed(0))
    users = USERS.unique()
    counts = torch.zeros(len(users))
    for batch in sampler:
        chosen = set(USERS[batch].tolist())
        assert sorted(batch) == [j for j in range(len(USERS)) if int(USERS[j]) in chosen]
        counts += torch.tensor([float(int(u) in chosen) for u in users])
    sd = (q * (1 - q) / steps) ** 0.5
    assert ((counts / steps - q).abs() < 5 * sd).all()


def engine_run(ids, batch_size=3, **kw):
    x, y = data("mlp")
    model = mlp()
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=loader, noise_multiplier=0.0, max_grad_norm=C, method="bookkeeping",
        loss_reduction="sum", sampling_generator=torch.Generator().manual_seed(3),
        privacy_unit="user", user_ids=ids, **kw)
    return engine, model, opt, loader


def test_make_private_user_level_end_to_end():
    engine, model, opt, loader = engine_run(USERS.tolist(), users_per_step=2)
    assert engine.privacy_unit == "user" and engine.sample_rate == 2 / 5
    assert engine.accountant.unit == "user" and "unit='user'" in repr(engine.accountant)
    assert engine.dataset_size == 5  # U: δ is compared with 1/U
    assert opt.expected_batch_size == pytest.approx(2.0)  # q U: expected sampled users
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
        ids = opt.user_level.ids
        opt.step()
        got = torch.cat([p.grad.flatten() for p in model.parameters()]) * 2.0
        assert torch.allclose(got, twin(model, xb, yb, ids), rtol=TOL, atol=1e-12)
    assert len(engine.accountant) == len(loader)
    assert all(q == 2 / 5 for _, q, _ in engine.accountant.history)


def private(make, lr=0.1, model=None, **kw):
    """``make(...)`` (an engine's make_private or make_private_with_epsilon) on the MLP (or
    ``model``) with batches of 3 and C; returns (model, what make returns)."""
    x, y = data("mlp")
    model = mlp() if model is None else model
    return model, make(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                       data_loader=DataLoader(TensorDataset(x, y), batch_size=3),
                       max_grad_norm=C, **kw)


def test_record_level_default_is_unchanged():
    engine = wb.PrivacyEngine()
    _, (_, opt, loader) = private(engine.make_private, lr=0.0, noise_multiplier=1.0)
    assert engine.privacy_unit == "record" and opt.user_level is None
    assert isinstance(loader, wb.dpsgd.DPDataLoader) and engine.sample_rate == 3 / len(USERS)


@pytest.mark.parametrize("kw, match", [
    ({"user_ids": None}, "needs user_ids"),
    ({"user_ids": USERS[:-1]}, "8 entries for a data set of N = 9"),
    ({"user_ids": USERS.double()}, "1-d integer tensor"),
    ({"user_ids": [0, 1, 2, 3, 4, 5, 6, 7, "x"]}, "non-integer id 'x'"),
    ({"user_ids": [0.0] * 9}, "non-integer id 0.0"),
    ({"user_ids": USERS, "privacy_unit": "person"}, "privacy_unit must be one of"),
    ({"user_ids": USERS, "adaptive_clipping": wb.dpsgd.AdaptiveClipping(0.5)},
     "does not support adaptive_clipping"),
    ({"user_ids": USERS, "max_physical_batch_size": 2}, "max_physical_batch_size"),
    ({"user_ids": USERS, "poisson_sampling": False}, "poisson_sampling=False"),
    ({"user_ids": USERS, "users_per_step": 9}, "users_per_step"),
    ({"user_ids": USERS, "user_reduction": "max"}, "user_reduction must be one of"),
    ({"user_ids": USERS, "privacy_unit": "record"}, "given with privacy_unit='record'"),
])
def test_errors_name_the_argument_before_any_hook(kw, match):
    kw = {"privacy_unit": "user", **kw}
    model = mlp()
    with pytest.raises((ValueError, TypeError), match=match):
        private(wb.PrivacyEngine().make_private, model=model, noise_multiplier=1.0, **kw)
    assert not any(m._forward_hooks or m._backward_hooks or m._forward_pre_hooks
                   for m in model.modules())


def test_a_batch_not_from_the_loader_raises():
    _, model, opt, loader = engine_run(USERS)
    x, y = data("mlp")
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    with pytest.raises(RuntimeError, match="not of a batch the user-level loader"):
        opt.step()


def test_make_private_with_epsilon_plans_with_the_users_q():
    engine = wb.PrivacyEngine()
    _, (_, _, loader) = private(engine.make_private_with_epsilon, target_epsilon=4.0,
                                target_delta=1e-2, epochs=2, privacy_unit="user",
                                user_ids=USERS, users_per_step=2)
    assert engine.sample_rate == 2 / 5 and len(loader) == round(5 / 2)
    sigma = next(iter(engine.accountant.history), None)  # nothing taken yet
    assert sigma is None
    with pytest.warns(Warning, match=r"1/N = 0.2 \(N = 5\)"):  # δ against 1/U, U = 5 users
        engine.get_epsilon(0.3)


def test_a_users_sample_rate_changed_mid_run_is_charged_per_batch():
    """Each batch is charged at the users' q that drew it; the users' sampler cannot be
    replaced (by name)."""
    engine, model, opt, loader = engine_run(USERS.tolist(), users_per_step=2)
    for epoch in range(2):
        for i, (xb, yb) in enumerate(loader):
            if epoch == 1 and i == 0:
                loader.sample_rate = 0.8  # from the next batch drawn
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
            opt.step()
    T = len(loader)
    assert engine.accountant.history == [(0.0, 2 / 5, T + 1), (0.0, 0.8, T - 1)]
    assert loader.expected_batch_size == pytest.approx(0.8 * 5)
    with pytest.raises(AttributeError, match="UserPoissonLoader.batch_sampler cannot be "
                                             "replaced.*loader.sample_rate"):
        loader.batch_sampler = UserPoissonBatchSampler(USERS, 1.0)
