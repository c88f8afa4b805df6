"""The phases of a private run: which sampler and which privacy unit produced each step.

The accountant's history (``accounting/accountant.py``) is a list of (σ, q, T) groups and
merges consecutive steps of equal (σ, q): it says nothing about how the batches were drawn.
One engine can run several ``make_private`` calls (a curriculum, another batch size, a
shuffled warm-up then Poisson) and a run can be resumed from a checkpoint with other settings,
so the engine keeps, beside the history, one ``Phase`` per ``make_private``: the step at which
it began (the history's length then), its sampler and its privacy unit. ε is then computed
over the phases as they were:

- a phase's steps are the history's steps from its ``start`` to the next phase's (groups
  that straddle a boundary are split: ``phase_histories``);
- the Poisson phases' groups are accounted as they are, each with its own σ and q;
- a shuffled phase (``poisson_sampling=False``) has no amplification by sampling that is
  known: each pass holds each record once, so each epoch begun is dominated by one Gaussian
  mechanism with noise σ (Balle & Wang 2018, arXiv:1805.06530, Thm. 8), i.e. one step of the
  sampled Gaussian at q = 1 with the phase's smallest σ. Dominating pairs compose (Zhu, Dong,
  Wang 2022, "Optimal Accounting of Differential Privacy via Characteristic Function",
  AISTATS, arXiv:2106.08567, Thm. 10), so the run's upper bound is the pessimistic PLD of the
  Poisson groups and these q = 1 steps together;
- a lower bound on any part of the run is one on the whole run (the adversary who picks the
  gradients can make the other steps' gradients zero), so the run's lower bound is the
  largest of: the optimistic PLD of the Poisson groups together (``lower.py``) and each
  shuffled phase's Chua et al. bound (2024, arXiv:2403.17673) over its completed epochs at
  one σ (0 for a phase whose σ changed);
- a phase whose sampler is not known (a checkpoint written before phases were saved) is
  warned about at load and by ``get_epsilon``, and refused by ``epsilon_bounds``;
- the privacy unit cannot change within a run: ε about records and ε about users compose
  into a number that holds for neither (``check_unit``, as ``load_checkpoint`` refuses).

Notation: σ noise multiplier, q sample rate, T steps per epoch, δ target delta.
"""

import dataclasses
import math

from workbench.accounting.bounds import EpsilonBounds, epsilon_bounds
from workbench.accounting.calibrate import steps_per_epoch
from workbench.accounting.curve import history_epsilon
from workbench.accounting.lower import history_lower_epsilon
from workbench.accounting.noise_range import accounted_sigma
from workbench.accounting.pld import check_pld_delta
from workbench.accounting.shuffle import shuffle_lower_epsilon
from workbench.checks import check_delta

SAMPLERS = ("poisson", "shuffle", "unknown")


@dataclasses.dataclass
class Phase:
    """Steps from ``start`` (the accountant's step count when the phase began) on."""

    start: int
    sampler: str  # "poisson", "shuffle", or "unknown" (an old checkpoint's steps)
    unit: dict  # {"unit": "record"} or {"unit": "user", "reduction": ...}
    steps_per_epoch: int | None = None  # a shuffled loader's len(loader)
    passes: object = None  # sampling.PassCounter of a shuffled loader (not saved)
    epochs: tuple | None = None  # (begun, completed) frozen at a save (a resumed phase)

    def state(self, steps: int) -> dict:
        """Plain Python (a checkpoint's ``"phases"``), its epochs frozen after ``steps``."""
        out = {"start": self.start, "sampler": self.sampler, "unit": dict(self.unit),
               "steps_per_epoch": self.steps_per_epoch}
        if self.sampler == "shuffle":
            out["epochs"] = list(shuffle_epochs(self, steps))
        return out


def phase_from_state(state: dict) -> Phase:
    """A ``Phase`` from ``Phase.state``, every field checked (a checkpoint's)."""
    if not isinstance(state, dict) or not {"start", "sampler", "unit"} <= set(state):
        raise ValueError(f"a saved phase must be a dict with start, sampler, unit; got "
                         f"{state!r:.80}")
    if state["sampler"] not in SAMPLERS:
        raise ValueError(f"a saved phase's sampler is {state['sampler']!r}, not one of "
                         f"{SAMPLERS}")
    epochs = state.get("epochs")
    return Phase(int(state["start"]), state["sampler"], dict(state["unit"]),
                 state.get("steps_per_epoch"), None, None if epochs is None else tuple(epochs))


def phases_state(phases, history) -> list:
    """The phases that took steps, as plain Python for a checkpoint."""
    return [p.state(sum(t for *_, t in groups)) for p, groups in
            phase_histories(phases, history)]


def restored_phases(saved, history, phases, unit) -> list:
    """The phases after a checkpoint's ``history`` is loaded into an engine whose own phases
    are ``phases``: the saved ones, then the engine's current phase from the loaded steps on.
    ``saved`` None (a checkpoint written before phases were saved) with steps in the history:
    one phase of unknown sampler, warned about by the caller."""
    steps = sum(int(t) for *_, t in history)
    if saved is None:
        old = [Phase(0, "unknown", dict(unit or {"unit": "record"}))] if steps else []
    else:
        old = [phase_from_state(p) for p in saved]
        if old and old[0].start != 0 or any(a.start >= b.start for a, b in zip(old, old[1:])):
            raise ValueError("the checkpoint's phases do not start at step 0 in order")
        if old and old[-1].start >= steps:
            raise ValueError(f"the checkpoint's last phase starts at step {old[-1].start}, "
                             f"after its history's {steps} steps")
    current = [dataclasses.replace(phases[-1], start=steps, epochs=None)] if phases else []
    return begin(old, current[0]) if current else old


def unit_label(unit: dict) -> str:
    extra = f", user_reduction={unit['reduction']!r}" if "reduction" in unit else ""
    return f"privacy_unit={unit['unit']!r}{extra}"


def check_unit(phases, steps: int, unit: dict) -> None:
    """A new phase protects the unit the run's earlier steps protected (or there are none)."""
    if not steps or not phases or phases[-1].unit == unit:
        return
    raise ValueError(
        f"make_private with {unit_label(unit)} on an engine whose {steps} earlier steps were "
        f"taken with {unit_label(phases[-1].unit)}: one ε over both would compose guarantees "
        f"about different neighbouring relations and hold for neither. Use a new "
        f"PrivacyEngine for the new unit, or make_private(..., "
        f"privacy_unit={phases[-1].unit['unit']!r}) as the run did")


def begin(phases, phase: Phase) -> list:
    """The phases with ``phase`` appended; a phase that took no step is dropped."""
    kept = [p for p in phases if p.start < phase.start]
    return kept + [phase]


def phase_histories(phases, history) -> list:
    """[(phase, [(σ, q, T), ...])] for each phase that took steps, the history split at the
    phases' starts (a merged group that straddles a start is cut in two)."""
    out, position, groups = [], 0, list(history)
    ends = [p.start for p in phases[1:]] + [math.inf]
    i = 0
    for phase, end in zip(phases, ends):
        mine = []
        while i < len(groups) and position < end:
            s, q, t = groups[i]
            take = int(min(t, end - position))
            mine.append((s, q, take))
            position += take
            if take == t:
                i += 1
            else:
                groups[i] = (s, q, t - take)
        if mine:
            out.append((phase, mine))
    if i < len(groups):  # steps before the first phase began (history loaded by hand)
        left = sum(int(t) for _, _, t in groups[i:])
        raise ValueError(
            f"engine.accountant holds {left} step(s) that no make_private of this engine ran "
            f"(a history loaded with engine.accountant.load_state_dict, or changed by hand): "
            f"the engine does not know which sampler drew those batches, so it cannot choose "
            f"the bound. Resume a run with workbench.dpsgd.save_checkpoint / load_checkpoint "
            f"(they keep the phases), or call make_private with the loader that ran those "
            f"steps before loading the accountant's state; or compute its ε with "
            f"workbench.accounting.history_epsilon(history, delta) for Poisson sampling "
            f"(epsilon_bounds for shuffled batches)")
    return out


def shuffle_epochs(phase: Phase, steps: int) -> tuple:
    """(begun, completed) epochs of a shuffled phase of ``steps`` steps: the upper bound
    counts the epoch begun, the lower bound only the epochs completed."""
    if phase.epochs is not None:
        return phase.epochs
    T = phase.steps_per_epoch
    begun, done = max(1, math.ceil(steps / T)), steps // T
    passes = phase.passes
    if passes is not None and passes.begun:  # the passes the loop really began: one batch
        # per fresh pass (next(iter(loader))), two batches a step, a break in each epoch;
        # each pass holds a record once (check_once_per_pass)
        begun = max(begun, passes.begun)
        done = min(done, passes.completed)
        if passes.workers:  # the workers' sampler runs ahead: a pass the loop broke off
            done = 0  # ends there too, not told from a whole one (the lower bound's epochs:
            # 8.19 for a loop of half passes, until 2026-11-30)
    return begun, done


def _single_phase_bounds(phase, groups, delta):
    """One phase at one (σ, q): ``accounting.epsilon_bounds`` as before phases were kept."""
    (sigma, q, _), steps = groups[0], sum(t for *_, t in groups)
    T = phase.steps_per_epoch or steps_per_epoch(q)

    def bounds(epochs):
        return epsilon_bounds(phase.sampler, sample_rate=q, noise_multiplier=sigma,
                              epochs=epochs, delta=delta, batches_per_epoch=T)

    if phase.sampler == "poisson":
        return bounds(max(steps, 1) / T)
    begun, done = shuffle_epochs(phase, steps)
    upper = bounds(begun)
    if done == begun:
        return upper
    lower = bounds(done).lower if done else 0.0  # a partial epoch: at least the ones done
    return dataclasses.replace(upper, lower=min(lower, upper.upper),
                               lower_method=f"{upper.lower_method}, over the {done} "
                                            f"epochs completed")


def run_bounds(phases, history, delta) -> EpsilonBounds:
    """[lower, upper] on ε(δ) of the whole run, phase by phase (module docstring)."""
    split = phase_histories(phases, history)
    if not split:  # no step released: nothing to bound but 0 (as get_epsilon)
        check_delta(delta)
        sampler = phases[-1].sampler if phases else "poisson"
        return EpsilonBounds(sampler, 0.0, 0.0, "no step taken", "no step taken", delta, 0)
    unknown = [p for p, _ in split if p.sampler == "unknown"]
    if unknown:
        steps = sum(t for p, g in split if p.sampler == "unknown" for *_, t in g)
        raise ValueError(
            f"epsilon_bounds: the run's first {steps} steps come from a checkpoint written "
            f"before the sampler of each phase was saved, so whether they were Poisson or "
            f"shuffled batches is not known; "
            f"get_epsilon accounts them as Poisson (warned). Compute the bracket by hand with "
            f"accounting.epsilon_bounds(sampler, ...) for the sampler that run used")
    if len(split) == 1 and len({(s, q) for s, q, _ in split[0][1]}) == 1:
        return _single_phase_bounds(*split[0], delta)
    return _mixed_bounds(split, delta)


def _mixed_bounds(split, delta) -> EpsilonBounds:
    """Several phases, or one phase whose σ or q changed (module docstring)."""
    delta = check_delta(delta)
    try:
        check_pld_delta(delta, "bracket's PLD")
    except ValueError as err:
        raise ValueError(f"{str(err).split('; use')[0]}; for an upper bound at this delta use "
                         f"get_epsilon with PrivacyEngine(accountant='rdp')") from None
    poisson = [g for p, groups in split if p.sampler == "poisson" for g in groups]
    upper_groups, lowers, notes = list(poisson), [], []
    for phase, groups in split:
        if phase.sampler != "shuffle":
            continue
        steps = sum(t for *_, t in groups)
        begun, done = shuffle_epochs(phase, steps)
        sigmas = {s for s, _, _ in groups}
        upper_groups.append((min(sigmas), 1.0, begun))  # each epoch: one Gaussian mechanism
        if len(sigmas) == 1 and done and accounted_sigma(min(sigmas)) == min(sigmas) > 0:
            lowers.append(shuffle_lower_epsilon(phase.steps_per_epoch, min(sigmas), done,
                                                delta))
        notes.append(f"{steps} shuffled steps ({begun} epochs begun, {done} completed)")
    upper = history_epsilon(upper_groups, delta, "pld")
    live = [(s, q, t) for s, q, t in poisson if q > 0 and t > 0]
    if live and all(accounted_sigma(s) == s > 0 for s, _, _ in live):
        lowers.append(history_lower_epsilon(live, delta))
    samplers = sorted({p.sampler for p, _ in split})
    steps = sum(t for _, groups in split for *_, t in groups)
    lower = min(max(lowers, default=0.0), upper)
    where = "; ".join(notes + ([f"{sum(t for *_, t in poisson)} Poisson steps"]
                               if poisson else []))
    if samplers == ["poisson"]:  # one sampler whose σ or q changed: the PLD pair
        return EpsilonBounds("poisson", lower, upper, "PLD, optimistic grid, of the groups "
                             "as they ran", f"PLD, pessimistic grid, of the groups as they "
                             f"ran ({len(poisson)} groups)", delta, steps)
    return EpsilonBounds(
        "+".join(samplers), lower, upper,
        "the largest of each part's lower bound (optimistic PLD for the Poisson steps, "
        "Chua et al. 2024 for each shuffled phase at one sigma)",
        f"PLD, pessimistic grid, of the Poisson groups as they ran and of each shuffled "
        f"epoch as one Gaussian mechanism ({where})", delta, steps)


__all__ = ["Phase", "begin", "check_unit", "phase_from_state", "phase_histories",
           "phases_state", "restored_phases", "run_bounds", "shuffle_epochs"]
