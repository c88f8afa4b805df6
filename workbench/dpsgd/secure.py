"""secure_mode: noise and sampling seeded afresh from the OS's cryptographic generator.

With an ordinary ``torch.Generator`` (or the global RNG), whoever knows or guesses the seed
can replay the noise and subtract it from the released model: the privacy guarantee then
rests on keeping one 64-bit number secret for the whole run. In secure mode every noise draw
and every Poisson batch uses a new generator seeded from ``secrets`` (the OS's CSPRNG,
e.g. ``getrandom``), and user seeds are refused, so no single seed replays the run.

What it does **not** protect against, honestly:

- the Gaussian is still drawn by PyTorch's pseudo-random algorithm from that seed; seeding it
  per step from a CSPRNG removes the long-lived secret, it does not make the stream itself a
  CSPRNG stream (Opacus' secure mode uses torchcsprng for that);
- floating-point attacks: a sampled Gaussian in floating point is not a continuous Gaussian,
  and the pattern of representable values can reveal the noiseless value (Mironov 2012,
  "On significance of the least significant bits for differential privacy", CCS; Jin et al.
  2022, arXiv 2107.10138). Mitigations (discrete Gaussians, Canonne, Kamath, Steinke 2020,
  arXiv 2004.00010; sums of several draws as Opacus does) are not implemented here;
- timing and other side channels, and anything outside this process.

Secure mode also makes a run impossible to reproduce, by design.
"""

import secrets

import torch


def fresh_generator(device="cpu") -> torch.Generator:
    """A generator seeded with 63 bits from the operating system's CSPRNG."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


class SecureGenerator:
    """Stands in for a ``torch.Generator``: ``.next()`` gives a freshly seeded one each time."""

    device = torch.device("cpu")

    def next(self) -> torch.Generator:
        return fresh_generator()


__all__ = ["SecureGenerator", "fresh_generator"]
