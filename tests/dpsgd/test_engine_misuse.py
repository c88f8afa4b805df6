"""Training-loop mistakes around make_private: each one trains correctly or raises/warns.

Where a mistake is handled by training correctly, the DP gradient is checked against an
independent reference: a per-sample loop (one backward per example), clipped and summed by hand.
"""

import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
)

import workbench as wb
from workbench.dpsgd.engine import PrivacyAccountingWarning

C = 0.7
N = 12


def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 3, generator=g, dtype=torch.float64),
                         torch.randint(0, 2, (N,), generator=g))


def net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def scale_collate(batch):  # module level: picklable for worker processes
    x, y = torch.utils.data.default_collate(batch)
    return 10 * x, y


def reference_grads(model, x, y, B):
    """Σ_i min(1, C/||g_i||) g_i / B by a loop over samples (σ = 0)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(y)):
        g = torch.autograd.grad(nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                list(model.parameters()))
        c = min(1.0, C / torch.sqrt(sum(t.pow(2).sum() for t in g)).item())
        total = [s + c * t for s, t in zip(total, g)]
    return [s / B for s in total]


def private(loader, model=None, engine=None, **kw):
    model = net() if model is None else model
    engine = wb.PrivacyEngine() if engine is None else engine
    kw = {"noise_multiplier": 0.0, "max_grad_norm": C, **kw}
    return (engine, *engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=loader, **kw))


def one_step(model, opt, loader, criterion=nn.CrossEntropyLoss()):
    x, y = next(iter(loader))
    opt.zero_grad()
    criterion(model(x), y).backward()
    opt.step()
    return x, y, [p.grad.clone() for p in model.parameters()]


# --- data loading -----------------------------------------------------------------------------

def test_custom_collate_fn_is_kept_and_the_model_trains_on_collated_data():
    loader = DataLoader(data(), batch_size=N, collate_fn=scale_collate)  # q = 1: every example
    _, model, opt, dp_loader = private(loader)
    x, y, grads = one_step(model, opt, dp_loader)
    raw_x, raw_y = data().tensors
    assert torch.equal(x, 10 * raw_x) and torch.equal(y, raw_y)
    for got, want in zip(grads, reference_grads(net(), 10 * raw_x, raw_y, B=N)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_loader_options_are_kept_and_collate_pickles_for_workers():
    def init(worker_id):
        torch.manual_seed(worker_id)

    indexed = TensorDataset(data().tensors[0], torch.arange(N))  # targets: the indices
    loader = DataLoader(indexed, batch_size=4, collate_fn=scale_collate, num_workers=1,
                        worker_init_fn=init, persistent_workers=True, prefetch_factor=3,
                        multiprocessing_context="fork", timeout=5.0)
    _, _, _, dp_loader = private(loader)
    for name in ("worker_init_fn", "num_workers", "pin_memory", "persistent_workers",
                 "prefetch_factor", "timeout"):
        assert getattr(dp_loader, name) == getattr(loader, name), name
    assert dp_loader.multiprocessing_context is loader.multiprocessing_context
    x, index = next(iter(dp_loader))  # collated in the worker process
    assert torch.equal(x, 10 * data().tensors[0][index])
    collate = pickle.loads(pickle.dumps(dp_loader.collate_fn))  # what a spawned worker gets
    x, _ = collate([data()[0]])
    assert torch.equal(x, 10 * data()[0][0][None])
    empty_x, empty_y = collate([])  # an empty Poisson batch: shaped by the custom collate
    assert empty_x.shape == (0, 3) and empty_y.shape == (0,)


def test_shuffled_loader_is_accepted():
    loader = DataLoader(data(), batch_size=4, shuffle=True)
    _, _, _, dp_loader = private(loader)
    assert dp_loader.sample_rate == 4 / N


@pytest.mark.parametrize("poisson", [True, False])
def test_own_sampler_is_refused_with_the_subset_fix(poisson):
    loader = DataLoader(data(), batch_size=4, sampler=SubsetRandomSampler(range(6)))
    with pytest.raises(ValueError, match=r"own sampler \(SubsetRandomSampler\).*Subset\("):
        private(loader, poisson_sampling=poisson)


def test_subset_is_the_fix_and_samples_only_the_subset():
    loader = DataLoader(Subset(data(), range(6)), batch_size=6)
    _, _, _, dp_loader = private(loader, sampling_generator=torch.Generator().manual_seed(0))
    x, _ = next(iter(dp_loader))
    assert torch.equal(x, data().tensors[0][:6])  # q = 1 over the 6 kept examples


def test_own_batch_sampler_and_no_batching_are_refused():
    batches = BatchSampler(SequentialSampler(range(N)), batch_size=4, drop_last=False)
    with pytest.raises(ValueError, match=r"own batch_sampler \(BatchSampler\).*Subset"):
        private(DataLoader(data(), batch_sampler=batches))
    with pytest.raises(ValueError, match="batch_size=None"):
        private(DataLoader(data(), batch_size=None))
    model = net()
    with pytest.raises(ValueError, match=r"own batch_sampler \(BatchSampler\)"):
        wb.PrivacyEngine().make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_sampler=batches), target_epsilon=5.0,
            target_delta=1e-3, epochs=1, max_grad_norm=C)


class Stream(IterableDataset):
    def __iter__(self):
        yield from zip(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))


class NoLen(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.zeros(3), 0


def test_empty_iterable_and_lenless_datasets_say_why():
    with pytest.raises(ValueError, match="data_loader.dataset is empty"):
        private(DataLoader(TensorDataset(torch.zeros(0, 3), torch.zeros(0)), batch_size=4))
    with pytest.raises(TypeError, match="IterableDataset .*map-style"):
        private(DataLoader(Stream(), batch_size=2))
    with pytest.raises(TypeError, match=r"has no len\(\)"):
        private(DataLoader(NoLen(), batch_size=2))
    with pytest.raises(TypeError, match="IterableDataset"):
        wb.dpsgd.DPDataLoader(Stream(), sample_rate=0.5)


def test_shuffle_warns_that_epsilon_is_understated_and_secure_mode_refuses_it():
    loader = DataLoader(data(), batch_size=4, shuffle=True)
    with pytest.warns(PrivacyAccountingWarning, match="poisson_sampling=False.*understates"):
        engine, model, opt, same = private(loader, poisson_sampling=False)
    assert same is loader and engine.sample_rate == 4 / N
    one_step(model, opt, same)
    with pytest.warns(PrivacyAccountingWarning, match="understates"):
        engine.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="secure_mode=True with poisson_sampling=False"):
        private(loader, engine=wb.PrivacyEngine(secure_mode=True), poisson_sampling=False)


def test_delta_at_least_one_over_n_warns_and_small_delta_does_not():
    loader = DataLoader(data(), batch_size=4)
    model = net()
    with pytest.warns(PrivacyAccountingWarning, match=r"delta=0.1 >= 1/N = 0.0833 \(N = 12\)"):
        wb.PrivacyEngine().make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, target_epsilon=5.0, target_delta=0.1, epochs=1,
            max_grad_norm=C)
    engine, *_ = private(loader)
    with pytest.warns(PrivacyAccountingWarning, match="get_epsilon: delta=0.5 >= 1/N"):
        engine.get_epsilon(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.get_epsilon(1e-5)


# --- make_private misuse ----------------------------------------------------------------------

HOOKS_PER_RECORDER = 2  # the recorder's forward hook and skip_weight_grads' (on by default)


def forward_hooks(model):
    """Per Linear layer, how many optimizers' worth of forward hooks it carries."""
    return [len(m._forward_hooks) / HOOKS_PER_RECORDER for m in model.modules()
            if isinstance(m, nn.Linear)]


def test_make_private_twice_keeps_one_recorder_and_trains_like_once():
    loader = DataLoader(data(), batch_size=N)
    model = net()
    private(loader, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no steps taken yet: nothing to warn about
        _, _, second, dp_loader = private(loader, model=model)
    assert forward_hooks(model) == [1, 1]
    x, y, grads = one_step(model, second, dp_loader)
    for got, want in zip(grads, reference_grads(net(), x, y, B=N)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_make_private_again_after_steps_warns_that_the_new_epsilon_starts_at_zero():
    loader = DataLoader(data(), batch_size=4)
    model = net()
    _, _, first, dp_loader = private(loader, model=model, noise_multiplier=1.0)
    one_step(model, first, dp_loader)
    with pytest.warns(UserWarning, match="took 1 private steps.*counts from zero"):
        private(loader, model=model)
    assert forward_hooks(model) == [1, 1]


def test_make_private_again_on_the_same_engine_keeps_one_ledger_silently():
    loader = DataLoader(data(), batch_size=4)
    model = net()
    engine, _, first, dp_loader = private(loader, model=model, noise_multiplier=1.0)
    one_step(model, first, dp_loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, second, dp_loader = private(loader, model=model, engine=engine,
                                          noise_multiplier=1.0)
    one_step(model, second, dp_loader)
    assert len(engine.accountant) == 2 and forward_hooks(model) == [1, 1]


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_matching_criterion_trains_like_the_reference(loss_reduction):
    criterion = nn.CrossEntropyLoss(reduction=loss_reduction)
    _, model, opt, loader = private(DataLoader(data(), batch_size=N), criterion=criterion,
                                    loss_reduction=loss_reduction)
    x, y, grads = one_step(model, opt, loader, criterion)
    for got, want in zip(grads, reference_grads(net(), x, y, B=N)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction, loss_reduction, factor", [("sum", "mean", "by n "),
                                                               ("mean", "sum", "by 1/n ")])
def test_criterion_reduction_mismatch_is_refused(reduction, loss_reduction, factor):
    with pytest.raises(ValueError, match=f"criterion.reduction='{reduction}' but loss_reduction"
                                         f"='{loss_reduction}'.*scaled {factor}.*pass "
                                         f"loss_reduction='{reduction}'"):
        private(DataLoader(data(), batch_size=4), loss_reduction=loss_reduction,
                criterion=nn.CrossEntropyLoss(reduction=reduction))


@pytest.mark.parametrize("criterion", [nn.CrossEntropyLoss(reduction="none"),
                                       nn.functional.cross_entropy])
def test_uncheckable_criterion_is_refused(criterion):
    with pytest.raises(ValueError, match="can check only a loss module whose reduction"):
        private(DataLoader(data(), batch_size=4), criterion=criterion)


def test_all_reduce_timeout_is_an_optimizer_setting():
    _, _, opt, _ = private(DataLoader(data(), batch_size=4), all_reduce_timeout_minutes=0.5)
    assert opt.all_reduce_timeout_minutes == 0.5
    _, _, opt, _ = private(DataLoader(data(), batch_size=4))
    assert opt.all_reduce_timeout_minutes == wb.dpsgd.distributed.DEFAULT_TIMEOUT_MINUTES == 10
    for bad in (0, -1, float("inf"), float("nan"), "soon"):
        with pytest.raises(ValueError, match=f"all_reduce_timeout_minutes must be .*{bad!r}"):
            private(DataLoader(data(), batch_size=4), all_reduce_timeout_minutes=bad)


def test_make_private_on_a_wrapper_of_an_already_private_model_detaches_the_first():
    loader = DataLoader(data(), batch_size=N)
    model = net()
    private(loader, model=model)
    wrapper = nn.Sequential(model)  # e.g. a DDP-like wrapper around the same layers
    with pytest.warns(UserWarning, match="a model containing one an earlier make_private.*"
                                         "detached from every layer"):
        _, _, opt, dp_loader = private(loader, model=wrapper)
    assert forward_hooks(model) == [1, 1]
    x, y, grads = one_step(wrapper, opt, dp_loader)
    for got, want in zip(grads, reference_grads(net(), x, y, B=N)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
