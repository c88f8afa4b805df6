"""Checkpoints of a private training run: model, optimizer, accountant, scheduler, RNG states.

Everything is saved as tensors and plain Python containers, so ``load_checkpoint`` reads it
back with ``torch.load(weights_only=True)``: a checkpoint from elsewhere cannot run code on
load. The accountant's history is part of the checkpoint because ε is a property of the
*whole* run: resuming with a fresh accountant would under-report the privacy spent.
"""

import torch


def _generator_state(generator):
    return None if generator is None else generator.get_state()


def save_checkpoint(path, *, model, optimizer, engine=None, scheduler=None,
                    noise_generator=None, sampling_generator=None) -> None:
    """Write the run's state to ``path`` (see the module docstring)."""
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "accountant": None if engine is None else engine.accountant.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "noise_generator": _generator_state(noise_generator),
        "sampling_generator": _generator_state(sampling_generator),
    }, path)


def load_checkpoint(path, *, model, optimizer, engine=None, scheduler=None,
                    noise_generator=None, sampling_generator=None) -> None:
    """Restore, in place, what ``save_checkpoint`` wrote (``weights_only=True``)."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, target, restore in (
        ("accountant", engine and engine.accountant, lambda t, s: t.load_state_dict(s)),
        ("scheduler", scheduler, lambda t, s: t.load_state_dict(s)),
        ("noise_generator", noise_generator, lambda t, s: t.set_state(s)),
        ("sampling_generator", sampling_generator, lambda t, s: t.set_state(s)),
    ):
        if target is None:
            continue
        if state[name] is None:
            raise ValueError(f"the checkpoint at {path} has no {name} state; save it with "
                             f"save_checkpoint(..., {name}=...) or load without it")
        restore(target, state[name])
