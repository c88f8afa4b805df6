"""audit_sampling: passes Poisson loaders at the stated rate, fails the usual substitutes."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import workbench as wb
from workbench.audit import audit_sampling
from workbench.dpsgd.sampling import DPDataLoader

N, Q, EPOCHS = 1000, 0.05, 4


def poisson(seed):
    return lambda ds: DPDataLoader(ds, sample_rate=Q, generator=torch.Generator().manual_seed(seed))


class ReseededPoisson(DPDataLoader):
    """A Poisson loader that reseeds its generator at every epoch: epochs repeat."""

    def __init__(self, ds, seed):
        self.seed, self.gen = seed, torch.Generator()
        super().__init__(ds, sample_rate=Q, generator=self.gen)

    def __iter__(self):
        self.gen.manual_seed(self.seed)
        return super().__iter__()


class FixedSizeWithoutReplacement:
    """Each step: B = qN examples drawn without replacement, fresh every step."""

    def __init__(self, ds, seed):
        self.ds, self.gen = ds, torch.Generator().manual_seed(seed)

    def __iter__(self):
        for _ in range(round(1 / Q)):
            yield torch.randperm(len(self.ds), generator=self.gen)[: round(Q * len(self.ds))]


class WithReplacement:
    """Each step: a Binomial(N, q) batch size (as Poisson), its examples drawn with
    replacement: it passed the audit in 9 of 10 seeds before the repeat check."""

    def __init__(self, ds, seed):
        self.ds, self.gen = ds, torch.Generator().manual_seed(seed)

    def __iter__(self):
        for _ in range(round(1 / Q)):
            b = int((torch.rand(len(self.ds), generator=self.gen) < Q).sum())
            yield torch.randint(0, len(self.ds), (b,), generator=self.gen)


class WrongRate(DPDataLoader):
    """A Poisson loader at 0.9 q (say, q computed from a stale dataset size): passed in 4 of
    10 seeds before the mean batch-size test; at 1.1 q the accountant understates ε."""

    def __init__(self, ds, seed, factor):
        super().__init__(ds, sample_rate=factor * Q,
                         generator=torch.Generator().manual_seed(seed))


def engine_loader(ds):
    model = nn.Linear(1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine warns about poisson_sampling=False
        _, _, loader = wb.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=round(Q * N), shuffle=True),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
    return loader


BROKEN = {
    "shuffled fixed-size": lambda s: (lambda ds: DataLoader(
        ds, batch_size=round(Q * N), shuffle=True, generator=torch.Generator().manual_seed(s))),
    "fixed-size without replacement": lambda s: (lambda ds: FixedSizeWithoutReplacement(ds, s)),
    "seed reused every epoch": lambda s: (lambda ds: ReseededPoisson(ds, s)),
    "make_private(poisson_sampling=False)": lambda s: engine_loader,
    "Poisson sizes, drawn with replacement": lambda s: (lambda ds: WithReplacement(ds, s)),
    "Poisson at 0.9 q": lambda s: (lambda ds: WrongRate(ds, s, 0.9)),
    "Poisson at 1.1 q": lambda s: (lambda ds: WrongRate(ds, s, 1.1)),
}


def test_poisson_loader_passes_and_reports_every_test():
    audit = audit_sampling(poisson(0), N, Q, epochs=EPOCHS)
    assert audit.passed and audit.steps == EPOCHS * 20
    assert list(audit.table.columns) == ["test", "statistic (z)", "p-value", "meaning", "passed"]
    assert len(audit.table) == 4 and "consistent" in audit.summary
    assert "<table" in audit._repr_html_()


def test_false_alarm_rate_over_seeds_is_at_most_the_significance():
    # 40 seeds at significance 0.2: Binomial(40, <= 0.2) exceeds 14 with probability < 1%
    alarms = sum(not audit_sampling(poisson(seed), N, Q, epochs=EPOCHS,
                                    significance=0.2).passed for seed in range(100, 140))
    assert alarms <= 14


@pytest.mark.parametrize("name", list(BROKEN))
def test_non_poisson_loaders_fail(name):
    for seed in range(3):
        audit = audit_sampling(BROKEN[name](seed), N, Q, epochs=EPOCHS)
        assert not audit.passed and "REJECTED" in audit.summary, (name, audit.table)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sample_rate=1.0), r"sample_rate must be in \(0, 1\)"),
    (dict(epochs=1), r"epochs must be an integer in \[2, 10000\]"),
    (dict(significance=0.0), r"significance must be in \(0, 1\)"),
    (dict(dataset_size=1), r"dataset_size must be an integer in \[2, 10000000\]"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        audit_sampling(poisson(0), **(dict(dataset_size=N, sample_rate=Q) | kwargs))


def test_a_loader_on_another_dataset_is_an_error():
    with pytest.raises(ValueError, match="outside the dataset"):
        audit_sampling(lambda ds: [torch.tensor([5000])] * 5, N, Q)
    with pytest.raises(TypeError, match="needs batches of the dataset's items"):
        audit_sampling(lambda ds: ["a"] * 5, N, Q)
