"""Checkpoints of a private training run: model, optimizer, accountant, scheduler, RNG states.

Everything is saved as tensors and plain Python containers, so ``load_checkpoint`` reads it
back with ``torch.load(weights_only=True)``: a checkpoint from elsewhere cannot run code on
load. The accountant's history is part of the checkpoint because ε is a property of the
*whole* run: resuming with a fresh accountant would under-report the privacy spent. So
loading a checkpoint that holds privacy history without ``engine=`` is an error, unless
``ignore_privacy_history=True`` says the weights are wanted without the ledger (evaluation).

File format: one header line ``WORKBENCH-CHECKPOINT-1 sha256=<64 hex digits>`` followed by the
``torch.save`` payload. The SHA-256 (FIPS 180-4) of the payload is checked before anything is
read, so a corrupted or truncated file fails with its name, not with a half-restored run.
Files are written to a temporary name and renamed, so a crash mid-save leaves the old one.

A secure-mode generator (``secure.SecureGenerator``) has no state: every draw is seeded afresh
from the OS. It is saved as the marker ``"secure"``, and restoring it is a no-op; restoring it
into a seeded ``torch.Generator`` (or the reverse) is refused, since neither can stand in for
the other.
"""

import hashlib
import io
import os
from pathlib import Path

import torch

from workbench.dpsgd.secure import SecureGenerator
from workbench.errors import WorkbenchError

MAGIC = b"WORKBENCH-CHECKPOINT-1 sha256="
SECURE = "secure"


class CheckpointError(WorkbenchError, ValueError):
    """A checkpoint file is corrupted, truncated, foreign, or does not fit what it restores."""


def _generator_state(name, generator):
    if generator is None:
        return None
    if isinstance(generator, SecureGenerator):
        return SECURE
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    raise TypeError(f"{name} must be a torch.Generator or a secure-mode generator; got "
                    f"{type(generator).__name__}")


def save_checkpoint(path, *, model, optimizer, engine=None, scheduler=None,
                    noise_generator=None, sampling_generator=None) -> None:
    """Write the run's state to ``path`` (see the module docstring for the format)."""
    buffer = io.BytesIO()
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "accountant": None if engine is None else engine.accountant.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "noise_generator": _generator_state("noise_generator", noise_generator),
        "sampling_generator": _generator_state("sampling_generator", sampling_generator),
    }, buffer)
    payload = buffer.getvalue()
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    os.replace(partial, path)


def read_checkpoint(path) -> dict:
    """The verified payload of ``path`` as a dict (``CheckpointError`` if it does not verify)."""
    data = Path(path).read_bytes()
    end = data.find(b"\n")
    if not data.startswith(MAGIC) or end != len(MAGIC) + 64:
        raise CheckpointError(f"{path} is not a workbench checkpoint (no SHA-256 header line): "
                              f"write it with wb.dpsgd.save_checkpoint")
    expected, payload = data[len(MAGIC):end].decode("ascii", "replace"), data[end + 1:]
    actual = hashlib.sha256(payload).hexdigest()
    if actual != expected:
        raise CheckpointError(f"{path} is corrupted or truncated: the SHA-256 of its "
                              f"{len(payload)}-byte payload is {actual[:16]}..., the header "
                              f"says {expected[:16]}...; resume from another checkpoint")
    return torch.load(io.BytesIO(payload), weights_only=True)


def _check_generator(path, name, generator, state) -> None:
    """The saved generator and the one to restore into are of the same mode."""
    _generator_state(name, generator)  # a TypeError for anything but a generator
    secure_saved = isinstance(state, str) and state == SECURE
    if isinstance(generator, SecureGenerator) != secure_saved:
        saved = "a secure-mode" if secure_saved else "a seeded"
        raise CheckpointError(f"{path} holds {saved} {name}, but {name} is a "
                              f"{type(generator).__name__}: a secure-mode generator has no "
                              f"seed to restore and takes none; resume in the run's own mode, "
                              f"or load without {name}")


def load_checkpoint(path, *, model, optimizer, engine=None, scheduler=None,
                    noise_generator=None, sampling_generator=None,
                    ignore_privacy_history: bool = False) -> None:
    """Restore, in place, what ``save_checkpoint`` wrote; check everything before changing
    anything (see the module docstring)."""
    state = read_checkpoint(path)
    history = (state["accountant"] or {}).get("history", [])
    if engine is None and history and not ignore_privacy_history:
        steps = sum(int(t) for *_, t in history)
        raise CheckpointError(f"{path} holds the privacy history of {steps} DP steps, and no "
                              f"engine= was given to restore it into: the resumed run would "
                              f"report the privacy of its new steps only. Pass engine=..., or "
                              f"ignore_privacy_history=True to load the weights alone")
    targets = {"accountant": engine and engine.accountant, "scheduler": scheduler,
               "noise_generator": noise_generator, "sampling_generator": sampling_generator}
    for name, target in targets.items():
        if target is not None and state[name] is None:
            raise CheckpointError(f"{path} has no {name} state; save it with "
                                  f"save_checkpoint(..., {name}=...) or load without it")
        if name.endswith("generator") and target is not None:
            _check_generator(path, name, target, state[name])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, target in targets.items():
        if target is None:
            continue
        if isinstance(target, torch.Generator):
            target.set_state(state[name])
        elif not isinstance(target, SecureGenerator):  # a secure one has nothing to restore
            target.load_state_dict(state[name])
