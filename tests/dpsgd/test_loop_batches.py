"""Batches, threads and models the loop may hand the optimizer (issue 24, families 5 and 6).

Each case trains like the per-record reference (float64, micro-batching) or raises an error
that names the cause and the fix:
- virtual steps: a logical batch never mixes with, nor is blocked by, an abandoned one;
- dict, nested and namedtuple batches are cut (virtual steps) and emptied (Poisson) along
  dim 0 of every tensor; what cannot be cut is refused naming the leaf;
- two threads on one private model raise ConcurrentUseError, sequential hand-over works;
- no trainable parameter outside the optimizer (or in front of the model) keeps a gradient;
- a model returning a dict is told so; a detached optimizer says it is detached.
"""

import threading
import warnings
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import workbench as wb
from workbench.dpsgd import DPOptimizer, PrivacyEngine
from workbench.dpsgd.loop import ConcurrentUseError
from workbench.dpsgd.sampling import DPDataLoader

CE = nn.CrossEntropyLoss(reduction="none")
Pair = namedtuple("Pair", "x y")


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def tensors(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,),
                                                                              generator=g)


class Records(Dataset):
    """Each record as a dict, a nested dict or a namedtuple (Hugging Face style)."""

    def __init__(self, n, kind):
        self.x, self.y = tensors(n)
        self.kind = kind

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x, y = self.x[i], self.y[i]
        return {"dict": {"x": x, "labels": y}, "nested": {"inputs": (x,), "labels": y},
                "namedtuple": Pair(x, y)}[self.kind]


def unpack(batch):
    if isinstance(batch, Pair):
        return batch.x, batch.y
    x = batch["x"] if "x" in batch else batch["inputs"][0]
    return x, batch["labels"]


def private(loader, model, **kw):
    engine = PrivacyEngine()
    return (engine, *engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=1.0,
        sampling_generator=torch.Generator().manual_seed(1), **kw))


def step(model, opt, x, y):
    opt.zero_grad()
    CE(model(x), y).mean().backward()
    opt.step()


# --- virtual steps ----------------------------------------------------------------------------

def virtual(n=64, batch_size=32):
    return private(DataLoader(TensorDataset(*tensors(n)), batch_size=batch_size), net(),
                   max_physical_batch_size=4)


def test_a_step_outside_an_unfinished_logical_batch_raises_instead_of_doing_nothing():
    engine, model, opt, loader = virtual()
    for x, y in loader:
        step(model, opt, x, y)
        break
    x, y = tensors(4, seed=5)
    opt.zero_grad()
    CE(model(x), y).mean().backward()
    with pytest.raises(RuntimeError, match="did not come from the virtual-step loader.*"
                                           "Finish the loop"):
        opt.step()
    assert len(engine.accountant) == 0


def test_interleaved_passes_never_mix_their_logical_batches():
    engine, model, opt, loader = virtual()
    first, second = iter(loader), iter(loader)
    x, y = next(first)
    step(model, opt, x, y)  # a partial sum of pass 1's first batch
    with pytest.warns(UserWarning, match="left unfinished"):
        x, y = next(second)  # pass 2's batch: pass 1's partial sum is discarded
    assert not opt._sums
    step(model, opt, x, y)
    with pytest.warns(UserWarning, match="left unfinished"):
        next(first)  # back to pass 1: pass 2's partial batch is discarded in turn


def test_a_new_pass_after_a_break_trains_like_one_logical_batch():
    engine, model, opt, loader = virtual(n=40, batch_size=40)  # q = 1: the whole set a batch
    for x, y in loader:
        step(model, opt, x, y)
        break
    with pytest.warns(UserWarning, match="left unfinished"):
        for x, y in loader:
            step(model, opt, x, y)
    assert len(engine.accountant) == 1
    x, y = tensors(40)
    expected = wb.clipped_grad_sum(net(), CE, x, y, 1.0, method="microbatch")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad * 40, expected[name], rtol=1e-9, atol=1e-12)


# --- dict, nested and namedtuple batches ------------------------------------------------------

@pytest.mark.parametrize("kind", ["dict", "nested", "namedtuple"])
def test_structured_batches_are_cut_into_physical_batches(kind):
    data = Records(12, kind)
    engine, model, opt, loader = private(DataLoader(data, batch_size=12), net(),
                                         max_physical_batch_size=5)
    seen = []
    for batch in loader:
        assert type(batch) is type(data[0])
        x, y = unpack(batch)
        seen.append(len(y))
        step(model, opt, x, y)
        if len(engine.accountant) == 1:
            break
    expected = wb.clipped_grad_sum(net(), CE, *_sampled(data, seen), 1.0, method="microbatch")
    assert all(k <= 5 for k in seen)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad * 12, expected[name], rtol=1e-9, atol=1e-12)


def _sampled(data, seen):
    """The first logical Poisson batch, drawn again from the same seed."""
    loader = DPDataLoader(data, sample_rate=1.0, generator=torch.Generator().manual_seed(1))
    x, y = unpack(next(iter(loader)))
    assert len(y) == sum(seen)
    return x, y


@pytest.mark.parametrize("kind", ["dict", "nested", "namedtuple"])
def test_empty_poisson_batches_keep_the_structure(kind):
    batch = next(iter(DPDataLoader(Records(6, kind), sample_rate=1e-9, steps=1)))
    x, y = unpack(batch)
    assert type(batch) is type(Records(6, kind)[0]) and x.shape == (0, 5) and y.shape == (0,)


def test_batches_that_cannot_be_cut_per_record_say_which_leaf():
    class Texts(Records):
        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i], "text": f"record {i}"}

    _, model, opt, loader = private(DataLoader(Records(8, "dict"), batch_size=8), net(),
                                    max_physical_batch_size=3)
    with pytest.raises(TypeError, match=r"\['text'\]\[0\] is a str, not a tensor"):
        DPDataLoader(Texts(8, "dict"), sample_rate=0.5)
    loader.loader = [{"x": torch.zeros(4, 5), "labels": torch.zeros(3)}]  # sizes 4 and 3
    with pytest.raises(ValueError, match=r"\['x'\]: 4, .*\['labels'\]: 3"):
        next(iter(loader))


def test_a_model_returning_a_dict_steps_as_the_tensor_it_holds():
    """A dict (a Hugging Face ModelOutput) is read by its tensors (dpsgd/model_loss.py): the
    same clipped sum as the model returning the logits tensor itself."""
    class HF(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.net = inner

        def forward(self, x):
            return {"logits": self.net(x), "note": "not a tensor"}

    def step(model, read):
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                          noise_multiplier=0.0, max_grad_norm=0.1, expected_batch_size=4)
        x, y = tensors(4)
        opt.zero_grad()
        CE(read(model(x)), y).mean().backward()
        opt.step()
        opt.detach()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    torch.manual_seed(0)
    plain = net()
    wrapped = HF(net())
    wrapped.net.load_state_dict(plain.state_dict())
    assert torch.allclose(step(wrapped, lambda out: out["logits"]), step(plain, lambda o: o),
                          rtol=1e-12, atol=1e-15)


# --- threads ----------------------------------------------------------------------------------

def _in_thread(fn):
    errors = []

    def target():
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (reported to the test)
            errors.append(e)

    t = threading.Thread(target=target, name="other")
    t.start()
    t.join()
    return errors


def test_two_threads_on_one_model_raise_and_a_hand_over_works():
    model = net()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=4)
    x, y = tensors(4)
    opt.zero_grad()
    CE(model(x), y).mean().backward()  # this thread is between forward and step
    for action in (lambda: model(x), opt.zero_grad, opt.step):
        errors = _in_thread(action)
        assert len(errors) == 1 and isinstance(errors[0], ConcurrentUseError)
        assert "thread 'other' while thread 'MainThread'" in str(errors[0])
    opt.step()  # this thread finishes its step: unharmed
    assert _in_thread(lambda: step(model, opt, x, y)) == []  # then the other thread may train
    with torch.no_grad():
        model(x)  # evaluation records nothing: never blocked


# --- gradients that must not exist ------------------------------------------------------------

def test_parameters_outside_the_optimizer_never_hold_a_gradient():
    model = net()
    with pytest.warns(UserWarning, match="dropped as soon as backward computes it"):
        opt = DPOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.0), model,
                          noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4)
    x, y = tensors(4)
    opt.zero_grad()
    CE(model(x), y).mean().backward()
    assert model[0].weight.grad is None and model[0].bias.grad is None  # before step, too
    assert model[2].weight.grad is not None  # the optimizer's own: still the user's to read
    opt.step()
    assert model[0].weight.grad is None


def test_an_input_computed_by_another_trainable_model_is_refused():
    encoder, model = nn.Linear(5, 5).double(), net()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=4)
    x, y = tensors(4)
    opt.zero_grad()
    CE(model(encoder(x)), y).mean().backward()
    with pytest.raises(RuntimeError, match="input was computed from trainable tensors outside"):
        opt.step()
    opt.zero_grad()
    CE(model(encoder(x).detach()), y).mean().backward()  # the fix
    opt.step()


# --- a second make_private --------------------------------------------------------------------

def test_an_optimizer_detached_by_a_later_make_private_says_so():
    loader = DataLoader(TensorDataset(*tensors(8)), batch_size=4)
    model = net()
    _, _, first, _ = private(loader, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a re-run cell on the same model: silent
        private(loader, model)
    for call in (first.zero_grad, first.step):
        with pytest.raises(RuntimeError, match="no longer records its model: make_private was "
                                               "called again on the same model"):
            call()
    with pytest.warns(UserWarning, match="a part of the model an earlier make_private"):
        private(loader, model[0])
