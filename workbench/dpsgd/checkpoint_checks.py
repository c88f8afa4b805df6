"""The checks ``load_checkpoint`` runs on every part before it restores any (``checkpoint.py``).

Each raises ValueError (or KeyError) saying what does not fit; none changes anything. They
repeat what the objects' own ``load_state_dict`` would find only once it had begun changing
state (``nn.Module.load_state_dict`` copies parameter by parameter), plus what those accept
silently (an optimizer state tensor of another shape fails only at the next step).
"""

import copy

import torch

from workbench.errors import WorkbenchError


class CheckpointError(WorkbenchError, ValueError):
    """A checkpoint file is corrupted, truncated, foreign, or does not fit what it restores."""


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" ... ({len(names)} in all)" if len(names) > 5 else "")


def not_mid_batch(optimizer, what: str) -> None:
    """Refuse a save or load between the chunks of a logical batch, or after a backward pass
    that no step has consumed: neither the partial sums nor the recording are in a checkpoint."""
    if getattr(optimizer, "expect_more", False) or getattr(optimizer, "_sums", None):
        raise CheckpointError(
            f"{what} in the middle of a logical batch (virtual steps: some chunks are "
            f"accumulated and the noise is not added yet): the partial clipped sums are not in "
            f"a checkpoint, so the resumed run would differ. Call it after the step of the "
            f"logical batch's last chunk (when optimizer.expect_more is False), or drop the "
            f"partial batch first with optimizer.reset_virtual_step()")
    recorder = getattr(optimizer, "recorder", None)
    root = getattr(recorder, "root_rec", None)
    if root is not None and any(any(g is not None for g in c.grads) for c in root.all_calls()):
        raise CheckpointError(f"{what} between a backward pass and its optimizer.step(): "
                              f"the recorded gradients are not in a checkpoint. Call it after "
                              f"step() (or after optimizer.zero_grad())")
    watch = getattr(recorder, "watch", None)
    if root is not None and getattr(watch, "announced", None) is not None \
            and any(True for _ in root.all_calls()):
        raise CheckpointError(  # (a save there was resumed without that batch's step, and a
            # load overwrote the weights under the live graph: torch's bare in-place error at
            # the backward pass, until 2026-12-01)
            f"{what} between the forward pass on the loader's batch and its optimizer.step(): "
            f"the batch is drawn and its pass is in flight, which a checkpoint does not hold "
            f"(a resume from a save here skips the batch, and a load here changes the weights "
            f"the pass's graph still needs). Call it after optimizer.step(), at the end of "
            f"the loop's body, or before the loader hands out the next batch")


def check_model(model, saved: dict) -> None:
    """Same keys, same shapes (what ``load_state_dict(strict=True)`` needs)."""
    if not isinstance(saved, dict):
        raise ValueError("the model state is not a state_dict")
    own = model.state_dict()
    missing, unexpected = set(own) - set(saved), set(saved) - set(own)
    if missing or unexpected:
        raise ValueError(f"the model's keys differ: missing {_listed(missing) or 'none'}, "
                         f"unexpected {_listed(unexpected) or 'none'} (is it the same "
                         f"architecture, wrapped the same way?)")
    shapes = [k for k, v in own.items()
              if isinstance(v, torch.Tensor) and getattr(saved[k], "shape", None) != v.shape]
    if shapes:
        k = shapes[0]
        raise ValueError(f"the model's shapes differ at {_listed(shapes)} (e.g. {k}: saved "
                         f"{tuple(getattr(saved[k], 'shape', ()))}, model {tuple(own[k].shape)})")


def check_optimizer(optimizer, saved: dict) -> None:
    """The same parameter groups, sizes, and state tensors shaped like their parameters."""
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise ValueError("the optimizer state is not an optimizer state_dict")
    groups, mine = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(mine) or any(len(g["params"]) != len(m["params"])
                                       for g, m in zip(groups, mine)):
        raise ValueError(f"the optimizer has {[len(m['params']) for m in mine]} parameters per "
                         f"group, the checkpoint {[len(g['params']) for g in groups]}: build "
                         f"the optimizer over the same parameters, in the same groups")
    params = {i: p for g, m in zip(groups, mine) for i, p in zip(g["params"], m["params"])}
    for i, entries in saved["state"].items():
        if i not in params:
            raise ValueError(f"the optimizer state names parameter {i}, which no group holds")
        p = params[i]
        for key, value in entries.items():  # a same-rank state tensor is parameter-shaped
            if isinstance(value, torch.Tensor) and value.dim() == p.dim() and \
                    value.shape != p.shape:
                raise ValueError(f"the optimizer state {key!r} of parameter {i} has shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(p.shape)}")


def check_accountant(accountant, saved) -> None:
    """A dry run on a copy: the accountant checks its own keys and history."""
    copy.deepcopy(accountant).load_state_dict(saved)


def check_scheduler(scheduler, saved) -> None:
    mine = scheduler.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(mine):
        raise ValueError(f"the scheduler state is for another scheduler: keys "
                         f"{_listed(map(str, saved)) if isinstance(saved, dict) else saved!r}, "
                         f"{type(scheduler).__name__} has {_listed(mine)}")


__all__ = [
    "CheckpointError", "check_accountant", "check_model", "check_optimizer", "check_scheduler",
    "not_mid_batch",
]


def privacy_unit(optimizer) -> dict | None:
    """What one protected unit is: {"unit": "record"} or {"unit": "user", "reduction": ...}
    (``user_level.py``); None for an optimizer that is not private."""
    if not hasattr(optimizer, "user_level"):
        return None
    level = optimizer.user_level
    return {"unit": "record"} if level is None else {"unit": "user",
                                                    "reduction": level.reduction}


def check_privacy_unit(optimizer, saved) -> None:
    """The run resumed protects the same unit: a user-level history continued with record-
    level steps (or the reverse) would compose two guarantees about different neighbours
    into one ε that holds for neither."""
    mine = privacy_unit(optimizer)
    if saved is None or mine is None or saved == mine:
        return
    raise ValueError(f"the checkpoint was saved by a run with {_unit(saved)} and this run "
                     f"has {_unit(mine)}: its ε and its clipping are about another "
                     f"neighbouring relation. Resume with make_private(..., "
                     f"privacy_unit={saved['unit']!r}) as the run did")


def _unit(unit: dict) -> str:
    extra = f", user_reduction={unit['reduction']!r}" if "reduction" in unit else ""
    return f"privacy_unit={unit['unit']!r}{extra}"
