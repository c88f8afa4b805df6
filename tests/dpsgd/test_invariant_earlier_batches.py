"""Rows of an earlier batch's records combined with this batch's (``row_mixing.Earlier``):
mixup with the previous batch, or, accumulating, with an earlier batch of the same step.
Record j of the earlier batch then reaches a step it was not sampled for, through record
i's input: silent until 2026-11-30, with the engine's Poisson loader, the user's own loader
and a loop by hand alike. Reusing this pass's own input (an autoencoder's target), a
recurrent state carried over, and a replay joined over dim 0 are not refused here."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import workbench as wb
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.errors import LossCouplingError

N, D, K, B = 32, 5, 3, 8


def data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, D, dtype=torch.float64, generator=g),
            torch.randint(0, K, (N,), generator=g))


def mlp(out=K):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, out)).double()


def engine_loop(body, poisson=True, out=K):
    model = mlp(out)
    loader = DataLoader(TensorDataset(*data()), batch_size=B)
    model, opt, loader = wb.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=0.0, max_grad_norm=1.0,
        loss_reduction="sum", poisson_sampling=poisson)
    state = {}
    for x, y in loader:
        if len(x) < 2:
            continue  # (a Poisson batch of 0 or 1 record: nothing to pair)
        opt.zero_grad()
        body(model, x, y, state).backward()
        opt.step()
    return model


def by_hand(body, out=K):
    model = mlp(out)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=B, loss_reduction="sum")
    X, Y = data()
    state = {}
    try:
        for i in range(0, N, B):
            opt.zero_grad()
            body(model, X[i:i + B], Y[i:i + B], state).backward()
            opt.step()
    finally:
        opt.detach()
    return model


LOOPS = {"the engine's Poisson loader": engine_loop,
         "the user's loader": lambda body, out=K: engine_loop(body, poisson=False, out=out),
         "by hand": by_hand}


def _ce(o, y):
    return F.cross_entropy(o, y, reduction="sum")


def previous_input(model, x, y, state):  # the last pass's input, mixed into this one's
    prev = state.get("x")
    xm = x if prev is None or len(prev) < len(x) else 0.7 * x + 0.3 * prev[:len(x)]
    state["x"] = xm
    return _ce(model(xm), y)


def previous_batch(model, x, y, state):  # the raw previous batch, kept by the loop
    prev = state.get("xy")
    state["xy"] = (x, y)
    if prev is None or len(prev[0]) < len(x):
        return _ce(model(x), y)
    return _ce(model(0.7 * x + 0.3 * prev[0][:len(x)]), y)


def previous_labels(model, x, y, state):  # soft labels mixed with the previous batch's
    prev = state.get("y")
    state["y"] = y
    t = F.one_hot(y, K).double()
    if prev is not None and len(prev) >= len(y):
        t = 0.7 * t + 0.3 * F.one_hot(prev[:len(y)], K).double()
    return F.cross_entropy(model(x), t, reduction="sum")


def previous_copy(model, x, y, state):  # the previous batch kept as a copy (the review's)
    prev = state.get("x")
    state["x"] = x.clone().detach()
    if prev is None or len(prev) < len(x):
        return _ce(model(x), y)
    return _ce(model(0.7 * x + 0.3 * prev[:len(x)]), y)


def running_mean(model, x, y, state):  # inputs centred by a running mean of earlier batches
    mu = state.get("mu", torch.zeros(D, dtype=x.dtype))
    loss = _ce(model(x - mu), y)
    with torch.no_grad():
        state["mu"] = 0.9 * mu + 0.1 * x.mean(0)
    return loss


def queue_of_outputs(model, x, y, state):  # a MoCo-like queue of earlier outputs, detached
    o, queue = model(x), state.get("q")
    loss = _ce(o, y) if queue is None else _ce(o, y) + 0.01 * (o @ queue.t()).sum()
    state["q"] = o.detach() if queue is None else torch.cat([queue, o.detach()])[-B:]
    return loss


MIXED = {"the last pass's input": previous_input, "the previous batch": previous_batch,
         "the previous batch's labels": previous_labels,
         "the previous batch, copied": previous_copy,
         "a running mean of earlier batches": running_mean,
         "a queue of earlier outputs": queue_of_outputs}

CASES = [(c, w) for c in sorted(MIXED) for w in sorted(LOOPS)
         if w != "by hand" or c in ("the last pass's input", "the previous batch")]
# (by hand no loader hands a batch out: labels never fed to the model are no batch's known)


@pytest.mark.parametrize("case, where", CASES)
def test_an_earlier_batch_mixed_into_this_one_is_refused(case, where):
    with pytest.raises(LossCouplingError, match="earlier batch"):
        LOOPS[where](MIXED[case])


def test_an_earlier_micro_batch_of_the_step_mixed_into_the_next_is_refused():
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=B, loss_reduction="sum")
    X, Y = data()
    try:
        opt.zero_grad()
        x1 = X[:4]
        _ce(model(x1), Y[:4]).backward()
        with pytest.raises(LossCouplingError, match="earlier batch"):
            _ce(model(0.7 * X[4:8] + 0.3 * x1), Y[4:8]).backward()
    finally:
        opt.detach()


def autoencoder(model, x, y, state):  # this pass's own input as the target
    return ((model(x) - x) ** 2).sum()


def replay(model, x, y, state):  # the last batch joined (not mixed) to this one's rows
    prev = state.get("xy")
    state["xy"] = (x, y)
    if prev is None:
        return _ce(model(x), y)
    both = torch.cat([x, prev[0]])
    return _ce(model(both)[:len(x)], y)


def fixed_tensor(model, x, y, state):  # a constant made before the loop, of n rows
    return _ce(model(x + FIXED[:len(x)]), y)


def two_views(model, x, y, state):  # this pass's input, flipped, as a second term's
    o = model(x)
    return _ce(o, y) + 0.1 * (o * x.flip(-1)[:, :K]).sum()


def mask_made_once(model, x, y, state):  # from the first batch's shape: no record's values
    mask = state.setdefault("m", torch.ones_like(x[0]) + 0 * torch.randn_like(x[0]))
    return _ce(model(x * mask), y)


FIXED = torch.linspace(-0.1, 0.1, N * D, dtype=torch.float64).reshape(N, D)
ACCEPTED = {"an autoencoder's own input": (autoencoder, D), "its own input flipped": (
    two_views, K), "a constant of the data set's rows": (fixed_tensor, K),
    "a mask made once like the first batch's row": (mask_made_once, K)}


@pytest.mark.parametrize("where", sorted(LOOPS))
@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_this_passs_own_input_and_constants_are_accepted(case, where):
    body, out = ACCEPTED[case]
    assert LOOPS[where](body, out=out) is not None


def test_a_replay_joined_over_dim_0_is_no_mix():
    """Joining rows is no mix (RowOrder); by hand nothing counts the records, so the
    replayed rows pass here (the engine's loader refuses more rows than it handed out)."""
    assert by_hand(replay) is not None


class Keyword(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp()

    def forward(self, *, x):
        return self.net(x.float().double())


@pytest.mark.parametrize("poisson", [True, False], ids=["Poisson", "shuffled"])
def test_batches_drawn_ahead_and_fed_by_keyword_are_this_steps(poisson):
    """``for x, y in list(loader): model(x=x)``: the input passed by keyword (and cast) was
    no pass's input, so the labels of the batch trained were taken for an earlier batch's
    (the review's false refusal of 81c5abc)."""
    import warnings
    model = Keyword()
    loader = DataLoader(TensorDataset(*data()), batch_size=B, shuffle=not poisson)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = wb.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=0.0, max_grad_norm=1.0,
            loss_reduction="sum", poisson_sampling=poisson)
        for x, y in list(loader):
            opt.zero_grad()
            _ce(model(x=x), y).backward()
            opt.step()


def test_the_users_loader_pickles_and_copies_as_its_own_class():
    """The announcing subclass (``watch_loader``) broke ``pickle`` (its class not found under
    its name) and a deep copy announced to the optimizer (the review's)."""
    import copy
    import pickle
    import warnings
    loader = DataLoader(TensorDataset(*data()), batch_size=B, shuffle=True)
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, opt, same = wb.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=0.0, max_grad_norm=1.0,
            poisson_sampling=False)
    assert same is loader and len(iter(loader)) == len(loader) == N // B
    for other in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert type(other) is DataLoader and "_wb_watches" not in other.__dict__
        assert len(other) == len(loader)
    opt.detach()
