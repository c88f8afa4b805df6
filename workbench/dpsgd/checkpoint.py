"""Checkpoints of a private training run: restore everything, or refuse and change nothing.

A checkpoint holds the model, the optimizer, the accountant's history, the LR scheduler, the
run's noise and sampling generators and the global RNG states (``rng_state.py``: torch CPU and
CUDA, ``random``, NumPy). Resuming from it continues the run bit for bit: the same noise and
the same Poisson batches as the uninterrupted run (each Poisson batch is an independent draw of
the sampling generator, so any point between two logical steps is a place to resume).

What is refused, because the resumed run would silently differ or leak:

- **loading without the generators**: the noise generator is the one the optimizer draws from
  (``optimizer.generator``, else ``engine.noise_generator``) and the sampling generator the one
  ``make_private`` was given (``engine.sampling_generator``); explicit ``noise_generator=`` /
  ``sampling_generator=`` must be those same objects. A checkpoint that holds a generator state
  with nowhere to restore it is refused: the resumed run would otherwise replay the first run's
  noise (repeated noise cancels between iterates) and its batches. A secure-mode generator
  (``secure.SecureGenerator``) has no state, every draw is seeded afresh from the OS: it is
  saved as the marker ``"secure"`` and restoring it is a no-op, but restoring it into a seeded
  ``torch.Generator`` (or the reverse) is refused, since neither can stand in for the other;
- **a save in the middle of a logical batch** (virtual steps: chunks accumulated, noise not yet
  added) or between a backward pass and its step: the partial sums are not saved;
- **a load into an optimizer in the middle of a logical batch**: its partial sums would enter
  the resumed run's first step;
- **a save or load between the forward pass on the loader's batch and its step**: the batch is
  drawn and its pass in flight (a resume skipped it; a load changed the weights under the
  live graph); a save after the batch is handed out and before its forward pass warns that a
  resume skips that batch (save at the end of the loop's body);
- **another privacy unit**: the checkpoint records ``privacy_unit`` (and, per user, the
  ``user_reduction``); a user-level run resumed record-level, or the reverse, is refused.

Each phase of the run (``phases.py``: the step it began at, its sampler, its unit, a shuffled
phase's epochs) is saved beside the history, so a run resumed with another sampler is still
accounted phase by phase; a file written before phases were saved loads with a warning, its
steps of unknown sampler (``get_epsilon`` warns, ``epsilon_bounds`` refuses them).

The accountant's history is part of the checkpoint because ε is a property of the *whole*
run: loading a checkpoint that holds privacy history without ``engine=`` is an error, unless
``ignore_privacy_history=True`` says the weights are wanted without the ledger (evaluation;
then generators with nowhere to go are not restored either: this is not a resume).

**Nothing changes unless everything fits.** ``load_checkpoint`` first checks every part: the
format version, the model's keys and shapes, the optimizer's parameter groups and state shapes,
the accountant's history, the scheduler's keys, each generator and global RNG state (tried on
a scratch generator). Only then does it restore, and should a restore still fail, what was
restored before it is put back.

The file (``checkpoint_file.py``): a SHA-256 header line, checked before anything is read,
then a ``torch.save`` payload read with ``weights_only=True``; each save writes a temporary
file of its own and renames it over ``path``, so concurrent saves to one path (every DDP rank)
each leave a whole file and a crash mid-save leaves the old one.
Format-1 files (no global RNG states) load only with ``restore_global_rng=False``.
Under DistributedDataParallel each rank has its own RNG states and Poisson shard: to resume
every rank exactly, save one file per rank (``f"run.rank{rank}.pt"``) and load each rank's own.
"""

import copy
import io
import warnings

import torch

from workbench.dpsgd import rng_state
from workbench.dpsgd.checkpoint_checks import (
    CheckpointError,
    check_accountant,
    check_model,
    check_optimizer,
    check_privacy_unit,
    check_scheduler,
    not_mid_batch,
    privacy_unit,
)
from workbench.dpsgd.checkpoint_file import FORMAT, read_checkpoint, write_checkpoint_file
from workbench.dpsgd.loss_watch import own_work
from workbench.dpsgd.misuse import PrivacyAccountingWarning
from workbench.dpsgd.phases import phases_state, restored_phases
from workbench.dpsgd.rng_state import SECURE, generator_state
from workbench.dpsgd.secure import SecureGenerator
from workbench.outputs import check_output_file

GENERATORS = ("noise_generator", "sampling_generator")
__all__ = ["SECURE", "CheckpointError", "load_checkpoint", "read_checkpoint", "save_checkpoint"]


def run_generators(engine, optimizer, noise_generator, sampling_generator) -> dict:
    """{name: the generator the run really draws from}: the explicit ones must be those."""
    noise = getattr(optimizer, "generator", None)  # the DPOptimizer's; else the engine's
    used = {"noise_generator": noise if noise is not None else
            getattr(engine, "noise_generator", None),
            "sampling_generator": getattr(engine, "sampling_generator", None)}
    given = {"noise_generator": noise_generator, "sampling_generator": sampling_generator}
    where = {"noise_generator": "optimizer.generator, the one the noise is drawn from",
             "sampling_generator": "the sampling_generator passed to make_private"}
    for name, g in given.items():
        generator_state(name, g)  # a TypeError for anything but a generator
        if g is not None and used[name] is not None and g is not used[name]:
            raise CheckpointError(f"{name} is not {where[name]}: its state would not be the "
                                  f"run's; pass that generator, or leave {name} out (the "
                                  f"engine's and the optimizer's are used)")
        used[name] = g if g is not None else used[name]
    return used


@own_work
def save_checkpoint(path, *, model, optimizer, engine=None, scheduler=None,
                    noise_generator=None, sampling_generator=None) -> None:
    """Write the run's state to ``path`` (module docstring: what, and what is refused)."""
    check_output_file(path, "save_checkpoint(path)")  # a folder, a file as parent: first
    not_mid_batch(optimizer, "save_checkpoint")
    _warn_prefetched(optimizer)
    generators = run_generators(engine, optimizer, noise_generator, sampling_generator)
    buffer = io.BytesIO()
    torch.save({
        "format": FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "accountant": None if engine is None else engine.accountant.state_dict(),
        "phases": None if engine is None else phases_state(engine.phases,
                                                           engine.accountant.history),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        **{name: generator_state(name, g) for name, g in generators.items()},
        "global_rng": rng_state.global_rng_state(),
        "privacy_unit": privacy_unit(optimizer),
        "dp": dp_settings(optimizer),
    }, buffer)
    write_checkpoint_file(path, buffer.getvalue())


def _warn_prefetched(optimizer) -> None:
    """A save after the loader handed out a batch and before its step (the loop body's top):
    the batch is drawn, and a resume skips it (the same, silently, until 2026-12-01). A save
    in the middle of a pass of the engine's loader with worker processes: they
    prefetch, so the sampling generator has drawn batches no step has taken yet; the resumed
    pass starts after them (those batches were neither released nor charged: privacy holds,
    but the run is not the uninterrupted one; silent until 2026-11-30)."""
    watch = getattr(getattr(optimizer, "recorder", None), "watch", None)
    if watch is not None and not watch.prefetch and watch.announced is not None:
        warnings.warn(
            "save_checkpoint after the private loader handed out a batch and before its "
            "optimizer.step(): the sampling generator has drawn that batch, so a resume from "
            "this file skips it (it is neither released nor charged: privacy holds) and does "
            "not continue the run bit for bit. Save after step(), at the end of the loop's "
            "body, for an exact resume", stacklevel=3)
    elif watch is not None and watch.prefetch and watch.passing:
        warnings.warn(
            f"save_checkpoint in the middle of a pass of the private loader, which prefetches "
            f"with num_workers={watch.prefetch}: its sampling generator has already drawn the "
            f"next batches, so a resume from this file skips them (they were neither released "
            f"nor charged) and does not continue the run bit for bit. Save at the end of a "
            f"pass, or use num_workers=0, for an exact resume", stacklevel=3)


DP_SETTINGS = ("noise_multiplier", "max_grad_norm")


def dp_settings(optimizer) -> dict | None:
    """The privacy settings the next step uses, as the optimizer holds them now: an adaptive
    clip norm moved by its quantile estimate, a σ or C set by hand (without a scheduler, whose
    own state would set them). Restored last, so a resumed run clips and noises as the
    uninterrupted one (an adaptive C came back as make_private's initial one until
    2026-11-29: 5.0 instead of 2.466 after 3 steps, the weights 0.03 off)."""
    if not all(hasattr(optimizer, k) for k in DP_SETTINGS):
        return None
    return {k: copy.deepcopy(getattr(optimizer, k)) for k in DP_SETTINGS}


def _check_generator(path, name, generator, state) -> None:
    """The saved generator and the one to restore into are of the same mode, and it fits."""
    secure_saved = isinstance(state, str) and state == SECURE
    if isinstance(generator, SecureGenerator) != secure_saved:
        saved = "a secure-mode" if secure_saved else "a seeded"
        raise CheckpointError(f"{path} holds {saved} {name}, but {name} is a "
                              f"{type(generator).__name__}: a secure-mode generator has no "
                              f"seed to restore and takes none; resume in the run's own mode, "
                              f"or load without {name}")
    try:
        rng_state.check_generator_state(generator, state)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: the saved {name} state does not fit {name} "
                              f"({e}); resume with a generator of the kind and device the run "
                              f"used") from None


def _targets(path, state, engine, generators, ignore_privacy_history) -> dict:
    """{part: where it is restored to}, after refusing parts with nowhere to go."""
    history = (state["accountant"] or {}).get("history", [])
    if engine is None and history and not ignore_privacy_history:
        steps = sum(int(t) for *_, t in history)
        raise CheckpointError(f"{path} holds the privacy history of {steps} DP steps, and no "
                              f"engine= was given to restore it into: the resumed run would "
                              f"report the privacy of its new steps only. Pass engine=..., or "
                              f"ignore_privacy_history=True to load the weights alone")
    for name in GENERATORS:
        if state.get(name) is not None and generators[name] is None \
                and not ignore_privacy_history:
            raise CheckpointError(
                f"{path} holds the run's {name} state, and the run being resumed has no "
                f"{name} to restore it into: a fresh one would replay the first run's "
                f"{'noise' if name.startswith('noise') else 'batches'}. Pass engine= (after "
                f"make_private(..., {name}=g)) or {name}=g, or ignore_privacy_history=True to "
                f"load the weights alone")
    return {"accountant": engine and engine.accountant, **generators}


@own_work
def load_checkpoint(path, *, model, optimizer, engine=None, scheduler=None,
                    noise_generator=None, sampling_generator=None,
                    ignore_privacy_history: bool = False,
                    restore_global_rng: bool = True) -> None:
    """Restore, in place, what ``save_checkpoint`` wrote; check every part before changing
    anything (module docstring). ``restore_global_rng=False`` leaves the global RNGs as they
    are (the caller then seeds them afresh: a replay of the first run's seed replays its
    dropout, and its noise and batches if they came from the global RNG)."""
    state = read_checkpoint(path, allow_old=not restore_global_rng)
    not_mid_batch(optimizer, "load_checkpoint")
    generators = run_generators(engine, optimizer, noise_generator, sampling_generator)
    targets = _targets(path, state, engine, generators, ignore_privacy_history)
    targets["scheduler"] = scheduler
    for name, target in targets.items():
        if target is not None and state.get(name) is None:
            raise CheckpointError(f"{path} has no {name} state; save it with "
                                  f"save_checkpoint(..., {name}=...) or load without it")
        if name in GENERATORS and target is not None:
            _check_generator(path, name, target, state[name])
    try:
        check_privacy_unit(optimizer, state.get("privacy_unit"))
        check_model(model, state["model"])
        check_optimizer(optimizer, state["optimizer"])
        if targets["accountant"] is not None:
            check_accountant(targets["accountant"], state["accountant"])
            phases = restored_phases(state.get("phases"), state["accountant"]["history"],
                                     getattr(engine, "phases", []), state.get("privacy_unit"))
        if scheduler is not None:
            check_scheduler(scheduler, state["scheduler"])
        if restore_global_rng:
            rng_state.check_global_rng_state(state.get("global_rng"))
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not fit the run it is loaded into: {e}. Nothing "
                              f"was changed") from None
    if targets["accountant"] is not None:  # the parts fit: does the ledger go back?
        _refuse_rollback(path, targets["accountant"], state["accountant"])
    if targets["accountant"] is not None and hasattr(engine, "phases"):
        _warn_unknown_sampler(path, state)
        targets["phases"] = (engine, phases)
    _restore(state, model, optimizer, targets, restore_global_rng)


def _steps(history) -> int:
    return sum(int(t) for *_, t in history)


def _shared_steps(mine, saved) -> int:
    """How many of the steps in ``mine`` (an accountant's history: (..., steps) runs) open
    ``saved`` as well, in order: the length of the runs' common prefix, in steps."""
    shared, j, left = 0, 0, None
    for *key, t in mine:
        t = int(t)
        while t:
            if j >= len(saved):
                return shared
            *other, u = saved[j]
            if left is None:
                left = int(u)
            if list(key) != list(other):
                return shared
            take = min(t, left)
            shared, t, left = shared + take, t - take, left - take
            if left == 0:
                j, left = j + 1, None
    return shared


def _refuse_rollback(path, accountant, saved) -> None:
    """A checkpoint loaded into an engine that has charged steps the checkpoint does not
    hold (a roll-back to an earlier save in the same run, or another run's checkpoint) would
    drop those steps from the ledger, though they were released, and restore the noise
    generator to a state their noise came from: the next steps would draw that noise again
    over other clipped sums, and the difference of two releases is then noise-free. Probe AL:
    5 steps released, the ledger cut back to 2, 8 released after 3 more with 5 charged, and
    ||g_before - g_after|| of the replayed steps 0.016 where fresh noise gives ~0.32, silently,
    until 2026-12-02. ``CheckpointError``; nothing is changed."""
    mine = accountant.state_dict().get("history", [])
    history = (saved or {}).get("history", [])
    dropped = _steps(mine) - _shared_steps(mine, history)
    if dropped > 0:
        raise CheckpointError(
            f"{path} does not continue this run: its engine has charged {_steps(mine)} DP "
            f"steps, of which {dropped} are not in the checkpoint's history "
            f"({_steps(history)} steps). Loading it would drop them from the ledger though "
            f"they were released, and rewind the noise generator to the noise those steps "
            f"drew: the steps after it would draw that noise again over other clipped sums, "
            f"so the difference of two releases would carry no noise. A released step cannot "
            f"be taken back: keep training from here (change the learning rate in place). A "
            f"checkpoint resumes a run that released nothing after it (a crash): loaded "
            f"elsewhere, it restores the same noise generator state. Nothing was changed")


def _warn_unknown_sampler(path, state) -> None:
    """A checkpoint written before each phase's sampler was saved (until 2026-11-30): its
    steps' sampler is not known, so they are marked so (``phases.py``), not taken as Poisson."""
    history = state["accountant"].get("history", [])
    if state.get("phases") is None and history:
        steps = sum(int(t) for *_, t in history)
        warnings.warn(f"{path} predates the checkpoints that save how each phase drew its "
                      f"batches: its {steps} steps are accounted as Poisson by get_epsilon "
                      f"(with a warning) and epsilon_bounds refuses them; if that run used "
                      f"poisson_sampling=False, compute its bracket with "
                      f"accounting.epsilon_bounds('shuffle', ...)",
                      PrivacyAccountingWarning, stacklevel=3)


def _restore(state, model, optimizer, targets, restore_global_rng) -> None:
    """Every part in turn; if one still fails, the parts restored before it are put back."""
    steps = [(lambda: optimizer.load_state_dict(state["optimizer"]),
              _undo_state_dict(optimizer, deep=False))]  # its load makes new state tensors
    for name in ("accountant", "scheduler"):
        if targets[name] is not None:
            steps.append((lambda t=targets[name], s=state[name]: t.load_state_dict(s),
                          _undo_state_dict(targets[name])))
    for name in GENERATORS:
        g = targets[name]
        if isinstance(g, torch.Generator):
            old = g.get_state()
            steps.append((lambda g=g, s=state[name]: rng_state.restore_generator(g, s),
                          lambda g=g, old=old: g.set_state(old)))
    if restore_global_rng:
        old_rng = rng_state.global_rng_state()
        steps.append((lambda: rng_state.restore_global_rng(state["global_rng"]),
                      lambda: rng_state.restore_global_rng(old_rng)))
    if "phases" in targets:  # the engine's phases: the saved ones, then the current one
        engine, phases = targets["phases"]
        old_phases = engine.phases
        steps.append((lambda: setattr(engine, "phases", phases),
                      lambda: setattr(engine, "phases", old_phases)))
    saved = state.get("dp")  # None: a file written before it was saved, or no DP optimizer
    if saved is not None and dp_settings(optimizer) is not None:
        old_dp = dp_settings(optimizer)
        steps.append((lambda: _set_dp(optimizer, saved), lambda: _set_dp(optimizer, old_dp)))
    steps.append((lambda: model.load_state_dict(state["model"]), lambda: None))  # checked
    done = []
    try:
        for apply, undo in steps:
            apply()
            done.append(undo)
    except Exception:
        for undo in reversed(done):
            undo()
        raise


def _set_dp(optimizer, settings: dict) -> None:
    for k in DP_SETTINGS:  # through the optimizer's own checked setters
        setattr(optimizer, k, settings[k])


def _undo_state_dict(obj, deep=True):
    old = copy.deepcopy(obj.state_dict()) if deep else obj.state_dict()
    return lambda: obj.load_state_dict(old)
