"""User-level DP-SGD: Poisson sampling of users, each user's summed contribution clipped to C.

McMahan, Ramage, Talwar, Zhang 2018 (arXiv 1710.06963), §2 and Algorithm 1 (user-level
DP-FedAvg / DP-FedSGD): when one person owns several records (a secret typed 20 times, all
of one patient's visits), record-level ε protects one record, and k records of one user only
by group privacy (ε grows about k-fold). User-level DP makes the user the unit:

1. **sampling**: each *user* joins a step with probability q, independently (Poisson over
   users); a sampled user brings **all** their records (no per-user cap: clipping bounds the
   user's influence whatever their count, so a cap is not needed for privacy);
2. **clipping**: the user's summed gradient G_u = Σ_{i ∈ R_u} g_i (or the mean, G_u / |R_u|,
   with ``user_reduction="mean"``) is clipped to C (``clipping/users.py``);
3. **noise**: N(0, σ² C² I) once per step on Σ_u c_u G_u, divided by qU, the expected number
   of sampled users.

Removing one user changes the released noiseless sum by ||c_u G_u|| <= C, so the sampled
Gaussian mechanism's analysis holds with "record" read as "user": the accountant is charged
with the users' q and the steps, and ε is user-level (``engine.privacy_unit == "user"``).

API (``PrivacyEngine.make_private``): ``privacy_unit="user", user_ids=ids`` with ``ids`` a
sequence or 1-d integer tensor aligned with the data set (``ids[j]`` is the user of record j).
q = ``data_loader.batch_size`` / N, the loader's rate now applied to users, or
``users_per_step / U`` when ``users_per_step`` (the expected sampled users) is given.
The returned loader (``UserPoissonLoader``) tells the optimizer the users of each batch.
Not supported with user level (each raises before any hook): per-layer clipping, adaptive
clipping, ``max_physical_batch_size`` (a user's records must be clipped together), DDP,
``poisson_sampling=False``, and more than one backward pass per step.

Notation: N records, U users, R_u the records of user u, q user sample rate, C, σ as usual.
"""

import numbers

import torch
from torch.utils.data import default_collate

from workbench.checks import check_choice, check_count, check_sample_rate
from workbench.clipping.users import BatchUsers
from workbench.dpsgd.collate_check import CollateCheck, unfollowed
from workbench.dpsgd.loss_watch import watched
from workbench.dpsgd.sampling import PoissonBatchSampler, empty_like_batch, loader_options
from workbench.errors import LoopError

UNITS = ("record", "user")

__all__ = ["UNITS", "UserPoissonBatchSampler", "UserPoissonLoader", "UserLevel",
           "check_user_ids", "user_sample_rate"]


def check_user_ids(user_ids, N: int) -> torch.Tensor:
    """(N,) long tensor of user ids, or an error naming ``user_ids`` and the fix."""
    if user_ids is None:
        raise ValueError("privacy_unit='user' needs user_ids=: a sequence (or 1-d integer "
                         "tensor) of N user ids, user_ids[j] the user who owns record j")
    if isinstance(user_ids, torch.Tensor):
        if user_ids.dim() != 1 or user_ids.is_floating_point() or user_ids.is_complex() \
                or user_ids.dtype == torch.bool:
            raise TypeError(f"user_ids must be a 1-d integer tensor; got dtype "
                            f"{user_ids.dtype} with shape {tuple(user_ids.shape)}: convert "
                            f"with torch.as_tensor(ids).long() (ids are labels, not values)")
        ids = user_ids.long().cpu()
    else:
        try:
            values = list(user_ids)
        except TypeError:
            raise TypeError(f"user_ids must be a sequence or 1-d tensor of integers; got "
                            f"{type(user_ids).__name__}") from None
        bad = [v for v in values if not isinstance(v, numbers.Integral) or isinstance(v, bool)]
        if bad:
            raise TypeError(f"user_ids holds a non-integer id {bad[0]!r}: ids must be "
                            f"integers; map other keys (names, strings) to integers first, "
                            f"e.g. {{k: i for i, k in enumerate(sorted(set(keys)))}}")
        ids = torch.tensor(values, dtype=torch.long)
    if ids.numel() != N:
        raise ValueError(f"user_ids has {ids.numel()} entries for a data set of N = {N} "
                         f"records: give one user id per record, aligned with the data set")
    return ids


def user_sample_rate(batch_size: int, N: int, U: int, users_per_step=None) -> float:
    """q: ``users_per_step / U`` or ``batch_size / N`` (module docstring), in (0, 1]."""
    if users_per_step is not None:
        m = check_count(users_per_step, "users_per_step", high=U, high_name="the number of "
                        "users U")
        return m / U
    return check_sample_rate(batch_size / N, "data_loader.batch_size / N", positive=True)


class UserPoissonBatchSampler(PoissonBatchSampler):
    """``steps`` batches of record indices; each user (with all their records) is in each
    batch with probability q, independently of the other users and steps: the record-level
    sampler drawn over the U users, each drawn user expanded to their records."""

    def __init__(self, user_of: torch.Tensor, sample_rate: float, steps=None, generator=None):
        _, self.user_of = torch.unique(user_of, return_inverse=True)  # (N,) in [0, U)
        self.num_users = int(self.user_of.max()) + 1
        super().__init__(self.num_users, sample_rate, steps, generator)

    def __iter__(self):
        for users in super().__iter__():
            chosen = torch.zeros(self.num_users, dtype=torch.bool)
            chosen[users] = True  # (U,)
            yield torch.nonzero(chosen[self.user_of]).flatten().tolist()  # all their records


class UserPoissonLoader:
    """Iterates user-level Poisson batches (collated like the original loader) and hands
    each batch's users to the optimizer (``UserLevel.set_batch``) before yielding it."""

    def __init__(self, loader, user_ids: torch.Tensor, sample_rate: float, generator=None,
                 steps=None):
        self.dataset, self.user_ids = loader.dataset, user_ids
        self._batch_sampler = UserPoissonBatchSampler(user_ids, sample_rate, steps, generator)
        self.num_users = self.batch_sampler.num_users
        self.batch_rate = None  # q of the batch last handed out (the accountant's, per step)
        self.collate_fn = loader_options(loader).get("collate_fn") or default_collate
        self.empty = empty_like_batch(self.dataset[0], self.collate_fn)
        self.level = None  # the optimizer's UserLevel, set by make_private
        self.watch = None  # the optimizer's LossWatch, set by make_private (loss_watch.watched)

    @property
    def batch_sampler(self) -> UserPoissonBatchSampler:
        """The users' Poisson sampler (not replaceable: its q is the one accounted)."""
        return self._batch_sampler

    @batch_sampler.setter
    def batch_sampler(self, value) -> None:
        raise AttributeError(
            f"UserPoissonLoader.batch_sampler cannot be replaced (given "
            f"{type(value).__name__}): the accountant charges each batch at the q of the "
            f"users' Poisson sampler that drew it. Change the rate with loader.sample_rate = "
            f"q (each batch is charged at its own), or call make_private again")

    @property
    def sample_rate(self) -> float:
        """The users' q: setting it changes the q of the batches drawn from then on, each
        accounted with its own (``sampling.PoissonBatchSampler``)."""
        return self.batch_sampler.sample_rate

    @sample_rate.setter
    def sample_rate(self, value) -> None:
        self.batch_sampler.sample_rate = value

    @property
    def expected_batch_size(self) -> float:
        """q U, the expected users per batch."""
        return self.sample_rate * self.num_users

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        return watched(self._batches(), self.watch, handed=self._handed,
                       dataset=self.dataset)

    def _handed(self) -> None:
        self.batch_rate = self.batch_sampler.take_drawn()

    def _batches(self):
        check = None if self.collate_fn is default_collate else \
            self.__dict__.setdefault("collate_check", CollateCheck(self.dataset,
                                                                   self.collate_fn))
        for indices in self.batch_sampler:
            batch = self.collate_fn([self.dataset[j] for j in indices]) if indices \
                else self.empty
            if check is not None:  # its rows against its records alone (collate_check.py)
                with unfollowed(self.watch):
                    check.handed(batch, indices)
                if self.watch is not None:
                    self.watch.padded = check.plans
            if self.level is not None:
                self.level.set_batch(self.user_ids[indices])
            yield batch


class UserLevel:
    """The optimizer's user-level state: the users of the batch the loader handed out last."""

    def __init__(self, reduction: str = "sum"):
        self.reduction = check_choice(reduction, "user_reduction", ("sum", "mean"))
        self.ids, self.used = None, False

    def set_batch(self, ids: torch.Tensor) -> None:
        self.ids, self.used = ids, False

    def batch(self, rec) -> BatchUsers:
        """The ``BatchUsers`` of this recorded batch, checked to be the loader's."""
        if self.ids is None or self.used:
            raise LoopError(
                "privacy_unit='user': this backward pass is not of a batch the user-level "
                "loader handed out (or a second backward pass on one batch): each user's "
                "records must be clipped together, so take exactly one forward/backward pass "
                "per batch of the loader make_private returned, then step()")
        if rec.n != len(self.ids):
            raise LoopError(f"privacy_unit='user': the recorded batch has {rec.n} records "
                               f"but the loader's batch had {len(self.ids)}; feed the whole "
                               f"batch, unchanged, to the model")
        self.used = True
        _, index = torch.unique(self.ids, return_inverse=True)
        return BatchUsers(index, self.reduction)


def check_user_options(privacy_unit, user_ids, N, *, max_grad_norm, adaptive_clipping,
                       max_physical_batch_size, poisson_sampling, distributed_run,
                       users_per_step, user_reduction):
    """The user ids (N,), or None for ``privacy_unit="record"``; every combination user level
    does not support raises here, before ``make_private`` attaches a hook."""
    check_choice(privacy_unit, "privacy_unit", UNITS)
    if privacy_unit == "record":
        given = {"user_ids": user_ids, "users_per_step": users_per_step,
                 "user_reduction": None if user_reduction == "sum" else user_reduction}
        extra = [k for k, v in given.items() if v is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} given with privacy_unit='record': they "
                             f"apply to user-level DP only; pass privacy_unit='user'")
        return None
    check_choice(user_reduction, "user_reduction", ("sum", "mean"))
    refused = {
        "adaptive_clipping": (adaptive_clipping is not None,
                              "its private count of unclipped norms is per record"),
        "max_grad_norm (one per group)": (isinstance(max_grad_norm, (list, tuple)),
                                          "per-layer clipping of a user's sum is not built"),
        "max_physical_batch_size": (max_physical_batch_size is not None,
                                    "a user's records would be split across chunks and "
                                    "clipped apart"),
        "poisson_sampling=False": (not poisson_sampling, "users are Poisson-sampled"),
        "torch.distributed": (distributed_run, "ranks would clip parts of one user apart"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"privacy_unit='user' does not support {name}: {why}. Use "
                             f"privacy_unit='record' for it, or drop {name} (a single "
                             f"process, one C, every batch whole)")
    return check_user_ids(user_ids, N)
