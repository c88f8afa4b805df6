"""PrivacyEngine: make an ordinary PyTorch training loop differentially private.

Two lines change in a training script (the Opacus design; Yousefpour et al. 2021, arXiv
2109.12298, §2)::

    engine = wb.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
        data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0)

and the loop itself stays as it was. ``make_private`` returns, in every mode, the same three
things: the model (the same object, with recording hooks), a ``DPOptimizer`` and a Poisson
``DPDataLoader`` (q = batch_size / N). Every logical step is recorded by the accountant
(``accounting``), so ``engine.get_epsilon(delta)`` is the ε spent so far.
``make_private_with_epsilon`` first solves the σ that spends ``target_epsilon`` in ``epochs``.

What ``make_private`` refuses or warns about, so that a training-loop mistake never trains
silently wrong: a loader with its own sampler, an empty or iterable data set (``sampling.py``);
``poisson_sampling=False`` (warned: the Poisson ε then understates the privacy spent; refused in
secure mode, whose point the seedable shuffle would defeat); a ``criterion`` whose reduction is
not ``loss_reduction`` (and, at every step, any ``nn`` loss the loop calls: ``loss_watch.py``);
δ >= 1/N (warned: (ε, δ)-DP then allows publishing an example in
full) (``misuse.py``); a ``batch_size`` larger than the data set (q = B/N > 1), before any
hook is added (``sampling.loader_sample_rate``). A second ``make_private`` on the same model
removes the first one's hooks, and the first optimizer then refuses to step (``attached.py``).
``make_private_with_epsilon`` plans σ for the steps the returned loader runs per epoch: the
Poisson loader's round(1/q), or a shuffled loader's own len(data_loader). The loop's own
mistakes (settings assigned later, virtual steps left early, two threads, gradients outside
the optimizer) are caught by the optimizer (``loop.py``).

Notation: N data set size, q sample rate, σ noise multiplier, C max_grad_norm.
"""


import itertools
import math
import warnings

import torch

from workbench.accounting import epsilon_bounds, get_noise_multiplier, steps_from_epochs
from workbench.accounting.accountant import make_accountant
from workbench.accounting.calibrate import steps_per_epoch
from workbench.checks import check_count
from workbench.deprecation import keyword
from workbench.dpsgd import distributed
from workbench.dpsgd.adaptive import AdaptiveClipDPOptimizer, AdaptiveClipping
from workbench.dpsgd.attached import detach_earlier, remember, warn_carried
from workbench.dpsgd.batches import batch_size, take
from workbench.dpsgd.loss_watch import watch_loader, watched
from workbench.dpsgd.misuse import (
    PrivacyAccountingWarning,
    check_criterion,
    warn_delta,
    warn_shuffle,
)
from workbench.dpsgd.optimizer import AUTO, DPOptimizer
from workbench.dpsgd.phases import Phase, begin, check_unit, phase_histories, run_bounds
from workbench.dpsgd.sampling import (
    DPDataLoader,
    check_dataset,
    check_once_per_pass,
    check_own_sampler,
    count_passes,
    loader_sample_rate,
)
from workbench.dpsgd.secure import SecureGenerator
from workbench.dpsgd.user_level import (
    UserLevel,
    UserPoissonLoader,
    check_user_ids,
    check_user_options,
    user_sample_rate,
)
from workbench.errors import LoopError, SampleMixingError
from workbench.validate import validate_model


class VirtualStepLoader:
    """Splits each logical batch into chunks of at most ``max_physical_batch_size`` records
    (along dim 0 of every tensor of the batch: tuples, namedtuples, dicts, nested;
    ``batches.py``) and tells the optimizer which logical batch each chunk belongs to and
    which chunk ends it (noise is added once, there: ``DPOptimizer.begin_chunk``)."""

    def __init__(self, loader, optimizer: DPOptimizer, max_physical_batch_size: int):
        self.size = check_count(max_physical_batch_size, "max_physical_batch_size")
        self.loader, self.optimizer = loader, optimizer
        self.batch_rate = None  # q of the logical batch of the chunk last handed out
        self.dataset = loader.dataset
        self._passes = itertools.count()
        self.watch = None  # the optimizer's LossWatch, set by make_private (loss_watch.watched)

    @property
    def sample_rate(self):
        """The wrapped loader's q (setting it sets the wrapped loader's)."""
        return getattr(self.loader, "sample_rate", None)

    @sample_rate.setter
    def sample_rate(self, value) -> None:
        self.loader.sample_rate = value

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if self.watch is not None:
            self.watch.chunked = True  # a step over two chunks: said so (count_records)
        return watched(self._chunks(), self.watch, handed=self._handed,
                       dataset=self.dataset)

    def _handed(self) -> None:
        self.batch_rate = getattr(self.loader, "batch_rate", None)

    def _chunks(self):
        this_pass = next(self._passes)  # a new pass: an unfinished batch of an old one is
        for b, batch in enumerate(self.loader):  # discarded (with a warning) by begin_chunk
            n = batch_size(batch, "the loader's batch")
            starts = list(range(0, n, self.size)) or [0]  # an empty batch: one empty chunk
            for k, start in enumerate(starts):
                chunk = take(batch, slice(start, start + self.size), "the loader's batch")
                self.optimizer.begin_chunk((id(self), this_pass, b), last=k == len(starts) - 1)
                yield chunk


def drawn_rate(loader, q: float) -> float:
    """The q that drew the batch ``loader`` handed out last (``batch_rate``: the Poisson
    samplers record it per batch, ``sampling.PoissonBatchSampler``), or ``q`` (a shuffled
    loader; no batch handed out yet). Invariant: each step is charged at its batch's q."""
    rate = getattr(loader, "batch_rate", None)
    return q if rate is None else rate


def _world() -> int:
    """Ranks that each draw a batch per step (1 outside torch.distributed)."""
    return distributed.dist.get_world_size() if distributed.is_distributed() else 1


def shuffled_sigma(sigma, target_epsilon, target_delta, q, epochs, per_epoch,
                   history: bool) -> float:
    """σ for shuffled passes (``poisson_sampling=False``): the smallest σ (within 0.1%) at
    or above the Poisson plan's whose fixed-size bracket's *upper* bound stays within the
    target (``accounting.epsilon_bounds("shuffle")``): the Poisson σ alone left a one-epoch
    run bracketed by [5.39, 5.46] for a target of 2 (probe of 2026-12-01). A run that already
    took steps is refused: its phases' bracket is the engine's, not a plan's."""
    if history:
        raise ValueError(
            "make_private_with_epsilon(poisson_sampling=False) on an engine that already took "
            "steps: the shuffled bracket of a run of several phases is not planned for; give "
            "make_private a noise_multiplier and check engine.epsilon_bounds(delta)")
    passes = math.ceil(epochs)  # each epoch one whole pass

    def upper(s):
        return epsilon_bounds("shuffle", sample_rate=q, noise_multiplier=s, epochs=passes,
                              delta=target_delta, batches_per_epoch=per_epoch).upper

    lo, hi = None, sigma
    while upper(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 brings the shuffled bracket of "
                             f"{passes} passes within target_epsilon={target_epsilon}")
    if lo is None:
        return sigma
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if upper(mid) <= target_epsilon else (mid, hi)
    return hi


class PrivacyEngine:
    """Makes (model, optimizer, data loader) private and keeps the privacy ledger."""

    def __init__(self, accountant: str = "rdp", secure_mode: bool = False):
        self.secure_mode = bool(secure_mode)  # see secure.py for what it does and does not do
        self.accountant = make_accountant(accountant)  # one registry names the accountants
        self.accountant_name = accountant
        self.sample_rate = self.dataset_size = None
        self.sampler = None  # "poisson" or "shuffle" (poisson_sampling=False)
        self.steps_per_epoch = None  # the loader's steps per epoch (epsilon_bounds)
        self.passes = None  # sampling.PassCounter of a shuffled loader (epsilon_bounds)
        self.privacy_unit = "record"  # "user" after make_private(privacy_unit="user")
        self.phases = []  # phases.Phase per make_private: its first step, sampler and unit
        self.noise_generator = self.sampling_generator = None  # make_private's (checkpoints)

    def make_private(self, *, module, optimizer, data_loader, noise_multiplier, max_grad_norm,
                     method=AUTO, poisson_sampling=True, loss_reduction="mean",
                     criterion=None, noise_generator=None, sampling_generator=None,
                     max_physical_batch_size=None, adaptive_clipping=None,
                     all_reduce_timeout_minutes=distributed.DEFAULT_TIMEOUT_MINUTES,
                     privacy_unit="record", user_ids=None, users_per_step=None,
                     user_reduction="sum", **renamed):
        """(model, DPOptimizer, loader): the same shapes in every ``method``.

        ``criterion`` (optional): the loss module the loop will use; its ``reduction`` (if it
        has one) must equal ``loss_reduction``. Every ``torch.nn`` loss module the loop calls
        after the model's forward pass is seen anyway (``loss_watch.py``): its reduction is
        checked, class weights and ``ignore_index`` are made per-record exact, and a loss
        coupling records raises ``LossCouplingError``; ``criterion=`` adds a custom module
        loss to what is seen. A loss written as a plain function (``F.cross_entropy``) is
        not seen: then a sum when ``loss_reduction="mean"`` (or the reverse) scales every
        per-sample gradient by n (or 1/n) before clipping.
        ``method``: one of ``wb.dpsgd.MODES``, or ``"auto"`` (the default): einsum or
        book-keeping, whichever the rule of ``clipping/auto.py`` expects to be faster for the
        recorded layers of each batch (``optimizer.last["mode"]`` says which ran); every mode
        gives the same clipped sums.
        ``adaptive_clipping``: an ``AdaptiveClipping`` (``adaptive.py``; Andrew et al. 2021):
        ``max_grad_norm`` is then the initial C, which follows a quantile of the norms; the
        accountant still charges ``noise_multiplier``, shared between the sum and the count.
        ``privacy_unit="user"`` with ``user_ids`` (one integer per record; ``user_level.py``):
        user-level DP: users are Poisson-sampled (q = batch_size / N, or ``users_per_step`` /
        U), each user's summed (``user_reduction="mean"``: mean) gradient is clipped to C, the
        noisy sum is divided by qU, and ε (``get_epsilon``) is per user.
        ``all_reduce_timeout_minutes``: under torch.distributed, how long a rank waits for the
        others in the noise all-reduce before ``CollectiveTimeoutError`` (``distributed.py``).
        ``grad_sample_mode``: the old name of ``method`` (deprecated: a ``FutureWarning``).
        """
        method = keyword(method, renamed, "method", "grad_sample_mode", "make_private")
        if adaptive_clipping is not None and not isinstance(adaptive_clipping, AdaptiveClipping):
            raise TypeError(f"adaptive_clipping must be a wb.dpsgd.AdaptiveClipping(...) or "
                            f"None; got {type(adaptive_clipping).__name__}")
        if criterion is not None:
            check_criterion(criterion, loss_reduction)
        timeout = distributed.check_timeout_minutes(all_reduce_timeout_minutes)
        if self.secure_mode:
            if noise_generator is not None or sampling_generator is not None:
                raise ValueError("secure_mode=True draws every noise sample and batch from the "
                                 "OS's cryptographic generator; do not pass noise_generator or "
                                 "sampling_generator (or use secure_mode=False to seed a run)")
            if not poisson_sampling:
                raise ValueError("secure_mode=True with poisson_sampling=False: the shuffled "
                                 "loader's batches come from a seedable generator that secure "
                                 "mode cannot replace; use poisson_sampling=True (the default)")
            noise_generator = sampling_generator = SecureGenerator()
        blocking = [p for p in validate_model(module) if p.blocking]
        if blocking:
            raise SampleMixingError("the model cannot get per-sample gradients:\n  "
                                    + "\n  ".join(map(str, blocking))
                                    + "\nuse model = wb.fix_model(model) first")
        N = check_dataset(data_loader.dataset, "data_loader.dataset")
        ids = check_user_options(
            privacy_unit, user_ids, N, max_grad_norm=max_grad_norm,
            adaptive_clipping=adaptive_clipping, max_physical_batch_size=max_physical_batch_size,
            poisson_sampling=poisson_sampling, distributed_run=distributed.is_distributed(),
            users_per_step=users_per_step, user_reduction=user_reduction)
        unit = {"unit": "record"} if ids is None else {"unit": "user",
                                                       "reduction": user_reduction}
        check_unit(self.phases, len(self.accountant), unit)  # one unit a run (phases.py)
        if ids is not None:  # user level: users are sampled and counted (user_level.py)
            check_own_sampler(data_loader)
            N = int(torch.unique(ids).numel())  # U: the unit the accountant counts
            q = user_sample_rate(data_loader.batch_size, len(ids), N, users_per_step)
            loader = UserPoissonLoader(data_loader, ids, q, generator=sampling_generator)
        elif poisson_sampling and distributed.is_distributed():
            loader = distributed.shard_loader(data_loader, generator=sampling_generator)
        elif poisson_sampling:
            loader = DPDataLoader.from_data_loader(data_loader, generator=sampling_generator)
        else:
            check_own_sampler(data_loader, allowed=distributed.SAMPLERS)  # q = B / N
            check_once_per_pass(data_loader, N)  # each record once a pass (the bracket's)
            loader_sample_rate(data_loader, N, _world())  # q <= 1, before the warning
            if _world() > 1 and not isinstance(data_loader.sampler,
                                               distributed.DistributedSampler):
                raise ValueError(
                    f"poisson_sampling=False under torch.distributed ({_world()} ranks) with a "
                    f"{type(data_loader.sampler).__name__}: every rank draws its batches from "
                    f"all N records, so a step's batches can hold a record twice (influence "
                    f"2 x max_grad_norm) and a pass holds each record {_world()} times (the "
                    f"bracket charged one until 2026-11-30). Give the loader a "
                    f"DistributedSampler(dataset, shuffle=True, drop_last=True) (each rank "
                    f"its own share, none repeated), "
                    f"or use poisson_sampling=True")
            warn_shuffle()
            loader = data_loader
        q = loader.sample_rate if poisson_sampling or ids is not None else \
            loader_sample_rate(data_loader, N, _world())  # every rank draws batch_size
        extra = {} if adaptive_clipping is None else {"adaptive": adaptive_clipping}
        dp_optimizer = (DPOptimizer if adaptive_clipping is None else AdaptiveClipDPOptimizer)(
            optimizer, module, **extra, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=q * N, method=method,
            loss_reduction=loss_reduction, generator=noise_generator, criterion=criterion,
            on_step=lambda sigma: self.accountant.step(noise_multiplier=sigma,
                                                       sample_rate=drawn_rate(returned, q)))
        dp_optimizer.all_reduce_timeout_minutes = timeout  # read by privatise's all-reduces
        if ids is not None:
            dp_optimizer.user_level = loader.level = UserLevel(user_reduction)
        self.privacy_unit = self.accountant.unit = privacy_unit  # what ε protects
        warn_carried(module, self)  # a copy of a privately trained model (attached.py)
        detach_earlier(module, self, keep=dp_optimizer)  # a re-run cell: one recorder a model
        self.accountant.dataset_size = N  # (for δ where its ledger is named: attached.py)
        remember(module, dp_optimizer, self)
        self.sample_rate, self.dataset_size = q, N
        self.sampler = "poisson" if poisson_sampling else "shuffle"
        self.steps_per_epoch = _epoch(poisson_sampling, q, data_loader)
        self.passes = None if poisson_sampling or ids is not None else \
            count_passes(data_loader)  # the user's own loader: its passes, for the bracket
        self.phases = begin(self.phases, Phase(
            len(self.accountant), self.sampler, unit,
            self.steps_per_epoch if not poisson_sampling else None, self.passes))
        self.noise_generator, self.sampling_generator = noise_generator, sampling_generator
        if max_physical_batch_size is not None:
            loader = VirtualStepLoader(loader, dp_optimizer, max_physical_batch_size)
        elif loader is data_loader:  # the user's shuffled loader: its batches announced too
            watch_loader(data_loader, dp_optimizer.recorder.watch)
        if hasattr(loader, "watch"):  # the engine's own loaders: batch statistics before forward
            loader.watch = dp_optimizer.recorder.watch
            loader.watch.owned = True  # each step's batch from it (LossWatch.check_handed)
        returned = loader  # on_step charges the q of the batch it last handed out
        return module, dp_optimizer, loader

    def make_private_with_epsilon(self, *, target_epsilon, target_delta, epochs, data_loader,
                                  **kwargs):
        """``make_private`` with the σ that spends ``target_epsilon`` over ``epochs``.

        Planned for the steps the returned loader runs in ``epochs`` passes (``epochs`` x
        len(loader), a fractional last epoch rounded up): the Poisson loader's round(1 / q)
        (``accounting.steps_per_epoch``, on every rank under DDP), or, with
        ``poisson_sampling=False``, the shuffled loader's own len(data_loader)
        (ceil(N / B), or floor(N / B) with ``drop_last``). Checked against the loader built.
        On an engine that already took steps (a second phase, a resumed run) σ is the one
        with which the whole run, its history and these steps, spends ``target_epsilon``
        (a ValueError if the history alone spends it; it was planned for the new steps
        alone, the run ending above the target, until 2026-11-30).
        """
        N = check_dataset(data_loader.dataset, "data_loader.dataset")
        check_own_sampler(data_loader, allowed=distributed.SAMPLERS)  # batch_size, q are real
        poisson = kwargs.get("poisson_sampling", True)
        q, units = loader_sample_rate(data_loader, N, 1 if poisson else _world()), N
        if kwargs.get("privacy_unit", "record") == "user":  # q over users (user_level.py)
            ids = check_user_ids(kwargs.get("user_ids"), N)
            units = int(torch.unique(ids).numel())  # U
            q = user_sample_rate(data_loader.batch_size, N, units, kwargs.get("users_per_step"))
        warn_delta(target_delta, units, "make_private_with_epsilon")
        per_epoch = _epoch(poisson, q, data_loader)
        steps = steps_from_epochs(epochs, q, per_epoch)
        sigma = get_noise_multiplier(target_epsilon, target_delta, q, steps=steps,
                                     accountant=self.accountant_name,
                                     history=self.accountant.history or None)  # the run's
        if not poisson and kwargs.get("privacy_unit", "record") != "user":
            sigma = shuffled_sigma(sigma, target_epsilon, target_delta, q, epochs, per_epoch,
                                   bool(self.accountant.history))
        out = self.make_private(data_loader=data_loader, noise_multiplier=sigma, **kwargs)
        if len(out[2]) != per_epoch or self.sample_rate != q:  # the plan is the loop's
            raise LoopError(f"make_private_with_epsilon planned {per_epoch} steps per epoch "
                               f"at q = {q:.4g}, but the loader runs {len(out[2])} at q = "
                               f"{self.sample_rate:.4g}; please report this bug")
        return out

    def get_epsilon(self, delta: float) -> float:
        """ε(δ) spent by every step taken so far, accounted as Poisson sampling (for steps
        taken with ``poisson_sampling=False``, or of unknown sampler, a warning says so and
        gives the bracket): per record, or per user when ``privacy_unit`` is "user" (δ then
        compared with 1/U)."""
        warn_delta(delta, self.dataset_size, "get_epsilon")
        split = phase_histories(self.phases, self.accountant.history)
        shuffled = sum(t for p, g in split if p.sampler == "shuffle" for *_, t in g)
        unknown = sum(t for p, g in split if p.sampler == "unknown" for *_, t in g)
        if unknown:
            warnings.warn(f"get_epsilon: {unknown} of the run's {len(self.accountant)} steps "
                          f"come from a checkpoint that does not say how their batches were "
                          f"drawn; they are accounted as Poisson, which understates the "
                          f"privacy spent if that run used poisson_sampling=False",
                          PrivacyAccountingWarning, stacklevel=2)
        elif shuffled:
            bounds = self.epsilon_bounds(delta)
            which = "this run used" if shuffled == len(self.accountant) else \
                f"{shuffled} of this run's {len(self.accountant)} steps used"
            warnings.warn(f"get_epsilon: {which} poisson_sampling=False; the epsilon "
                          f"returned is the Poisson one and understates the privacy spent: "
                          f"the run is bracketed by [{bounds.lower:.3g}, {bounds.upper:.3g}] "
                          f"(engine.epsilon_bounds(delta))",
                          PrivacyAccountingWarning, stacklevel=2)
        return self.accountant.get_epsilon(delta)

    def epsilon_bounds(self, delta: float):
        """[lower, upper] on ε(δ) for the samplers this run really used, phase by phase
        (``phases.py``): one phase at one (σ, q) is ``accounting.epsilon_bounds``'s bracket:
        the Poisson PLD pair, or, for shuffled fixed-size batches, Chua et al.'s lower bound
        and the no-amplification upper bound, over the epochs taken so far (at least one),
        an epoch being the loader's own len(loader) steps: the upper bound counts the epoch
        begun, the lower bound only the epochs completed (0 before the first ends). Several
        phases, or a σ or q that changed, compose each group as it ran (a shuffled epoch as
        one Gaussian mechanism) for the upper bound; the lower bound is the largest part's."""
        return run_bounds(self.phases, self.accountant.history, delta)


def _epoch(poisson: bool, q: float, data_loader) -> int:
    """Steps of one epoch of the loop: the Poisson loader's round(1 / q)
    (``accounting.steps_per_epoch``), or a shuffled loader's own len(data_loader)."""
    return steps_per_epoch(q) if poisson else len(data_loader)


__all__ = ["PrivacyAccountingWarning", "PrivacyEngine", "VirtualStepLoader"]
