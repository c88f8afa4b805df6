"""The user-level sampling audit (``audit/sampling_users.py``) and claims with ``unit: user``:
the workbench's user-level Poisson loader passes; a record-level Poisson loader (users split
across batches) and fixed-size user batches are caught; a user-level claim is audited with
its loader at the user level (a refuted loader: the sampler tests above)."""

import pytest
import torch
from torch.utils.data import DataLoader

from workbench.audit import audit_user_sampling
from workbench.audit.claim import validate
from workbench.audit.claim_audit import SUPPORTED, audit_claim
from workbench.audit.sampling_users import example_user_ids
from workbench.dpsgd.sampling import DPDataLoader
from workbench.dpsgd.user_level import UserPoissonLoader

Q = 0.1


def user_loader(dataset, user_ids, seed=0):
    return UserPoissonLoader(DataLoader(dataset, batch_size=1), user_ids, Q,
                             generator=torch.Generator().manual_seed(seed))


def record_loader(dataset, user_ids):  # Poisson over records: a user's records split
    return DPDataLoader(dataset, sample_rate=Q, generator=torch.Generator().manual_seed(0))


def fixed_users_loader(dataset, user_ids):  # a fixed number of users a step, all records
    ids = torch.as_tensor(user_ids)
    U = int(ids.max()) + 1
    g = torch.Generator().manual_seed(0)
    for _ in range(round(1 / Q)):
        chosen = torch.randperm(U, generator=g)[:round(Q * U)]
        yield torch.nonzero(torch.isin(ids, chosen)).flatten()


class Fixed:
    def __init__(self, dataset, user_ids):
        self.args = dataset, user_ids

    def __iter__(self):
        return fixed_users_loader(*self.args)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_user_level_poisson_loader_passes(seed):
    ids = example_user_ids(400, seed)
    result = audit_user_sampling(lambda d, u: user_loader(d, u, seed), ids, Q)
    # 4 epochs of 10 steps cannot tell twin users in 10% of 400 from chance; 5 can
    assert result.verdict == "inconclusive" and result.epochs_needed == 5, result.summary
    result = audit_user_sampling(lambda d, u: user_loader(d, u, seed), ids, Q, epochs=5)
    assert result.passed, result.table


@pytest.mark.parametrize("make, failing", [(record_loader, "users' records together"),
                                           (Fixed, "batch sizes")])
def test_record_sampling_and_fixed_user_batches_are_caught(make, failing):
    result = audit_user_sampling(make, example_user_ids(400), Q)
    assert not result.passed
    assert not result.table.set_index("test").loc[failing, "passed"]


def test_a_user_level_claim_is_audited_at_the_user_level():
    claim = validate(dict(unit="user", neighbouring="add/remove", sampler="poisson",
                          dataset_size=400, sample_rate=Q, noise_multiplier=1.0,
                          max_grad_norm=1.0, steps=40, delta=1e-5, accountant="rdp",
                          epsilon=5.0))
    assert claim.unit == "user"
    good = audit_claim(claim, loader=user_loader, trials=50).table.set_index("element")
    assert good.loc["sampler", "verdict"] == SUPPORTED
    assert "user" in good.loc["sampler", "finding"]
    assert "user" in good.loc["unit of privacy", "evidence"]
