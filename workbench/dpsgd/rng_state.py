"""Random states a resumed run needs: the run's generators and the global RNGs.

DP-SGD's noise must be fresh at every step: a resumed run that replays the first run's noise
adds the same N(0, σ²C²I) twice, and repeated noise cancels between iterates (the difference
of two updates is then noiseless). Its batches must continue the Poisson sequence, not restart
it. So a checkpoint holds every random state that feeds the run:

- the noise and sampling generators (``torch.Generator``, or the secure-mode marker: a
  ``SecureGenerator`` has no state, every draw is seeded afresh from the OS);
- the global RNGs: torch's CPU generator (noise and batches when no generator was passed,
  dropout, the DataLoader's worker seeds), every CUDA device's generator (once CUDA is in
  use), Python's ``random`` and NumPy's legacy global ``RandomState``.

Each state is kept as tensors and plain Python values, so ``torch.load(weights_only=True)``
reads it. ``check_*`` try a state on a scratch object of the same kind, so a checkpoint that
does not fit is refused before anything is restored.
"""

import random

import numpy as np
import torch

from workbench.dpsgd.secure import SecureGenerator

SECURE = "secure"


def generator_state(name, generator):
    """The saved form of a run generator: None, ``"secure"``, or its state (uint8 tensor)."""
    if generator is None:
        return None
    if isinstance(generator, SecureGenerator):
        return SECURE
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    raise TypeError(f"{name} must be a torch.Generator or a secure-mode generator; got "
                    f"{type(generator).__name__}")


def check_generator_state(generator, state) -> None:
    """Raise ValueError unless ``state`` can be restored into ``generator`` (a dry run)."""
    if isinstance(generator, SecureGenerator) or generator is None:
        return
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise ValueError(f"the saved state is a {type(state).__name__}, not a generator state")
    torch.Generator(device=generator.device).set_state(state)  # raises if it does not fit


def restore_generator(generator, state) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)  # a secure-mode generator has nothing to restore


def cuda_in_use() -> bool:
    """CUDA initialised in this process: its generators may have been drawn from. (A save never
    initialises CUDA itself; before that, the CUDA generators are still in their seeded state,
    which a resumed process seeded alike reproduces.)"""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def global_rng_state() -> dict:
    """torch CPU, every CUDA device (once CUDA is in use), ``random`` and NumPy."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda_in_use() else [],
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }


def _numpy_state(saved: dict) -> tuple:
    return (saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
            saved["has_gauss"], saved["gauss"])


def check_global_rng_state(state) -> None:
    """Raise ValueError unless every global state restores here (dry runs on scratch RNGs)."""
    if not isinstance(state, dict) or set(state) != {"torch", "cuda", "python", "numpy"}:
        raise ValueError("the global RNG states are missing or incomplete")
    torch.Generator().set_state(state["torch"])
    cuda = state["cuda"]
    if cuda:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available != len(cuda):
            raise ValueError(f"the run saved the RNG states of {len(cuda)} CUDA device(s), and "
                             f"this process sees {available}: resume on the same number of "
                             f"devices (CUDA_VISIBLE_DEVICES)")
        for k, s in enumerate(cuda):
            torch.Generator(device=f"cuda:{k}").set_state(s)
    random.Random().setstate(state["python"])
    np.random.RandomState().set_state(_numpy_state(state["numpy"]))


def restore_global_rng(state) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(_numpy_state(state["numpy"]))


__all__ = [
    "SECURE", "check_generator_state", "check_global_rng_state", "cuda_in_use", "generator_state",
    "global_rng_state", "restore_generator", "restore_global_rng",
]
