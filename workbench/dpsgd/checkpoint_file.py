"""The checkpoint file: a SHA-256 header line, then the payload; written atomically.

Format: one header line ``WORKBENCH-CHECKPOINT-2 sha256=<64 hex digits>`` followed by the
``torch.save`` payload, read back with ``torch.load(weights_only=True)`` (a checkpoint from
elsewhere cannot run code on load). The SHA-256 (FIPS 180-4) of the payload is checked before
anything is read, so a corrupted or truncated file fails with its name. Each write goes to a
temporary file of its own (the process id and a random suffix), flushed to disk and renamed
over the path (``os.replace``, atomic on POSIX and Windows): a crash mid-save leaves the old
file, and processes writing one path at once (every DDP rank) each write a whole file, the
last rename winning. What the payload holds is ``checkpoint.py``'s.
"""

import hashlib
import io
import os
import secrets
from pathlib import Path

import torch

from workbench.dpsgd.checkpoint_checks import CheckpointError

FORMAT = 2
MAGIC = b"WORKBENCH-CHECKPOINT-2 sha256="
OLD_MAGIC = b"WORKBENCH-CHECKPOINT-1 sha256="


def write_checkpoint_file(path, payload: bytes) -> None:
    """The header line and ``payload``, atomically (module docstring)."""
    write_atomically(Path(path), MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
                     + payload)


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` to a temporary file of this call's own, flushed to disk, renamed to ``path``."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(8)}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if partial.exists():
            partial.unlink()


def read_checkpoint(path, allow_old: bool = False) -> dict:
    """The verified payload of ``path`` as a dict (``CheckpointError`` if it does not verify)."""
    data = Path(path).read_bytes()
    end = data.find(b"\n")
    magic = next((m for m in (MAGIC, OLD_MAGIC) if data.startswith(m)), None)
    if magic is None or end != len(magic) + 64:
        raise CheckpointError(f"{path} is not a workbench checkpoint (no SHA-256 header line): "
                              f"write it with wb.dpsgd.save_checkpoint")
    expected, payload = data[len(magic):end].decode("ascii", "replace"), data[end + 1:]
    actual = hashlib.sha256(payload).hexdigest()
    if actual != expected:
        raise CheckpointError(f"{path} is corrupted or truncated: the SHA-256 of its "
                              f"{len(payload)}-byte payload is {actual[:16]}..., the header "
                              f"says {expected[:16]}...; resume from another checkpoint")
    if magic == OLD_MAGIC and not allow_old:
        raise CheckpointError(f"{path} is a format-1 checkpoint, which holds no global RNG "
                              f"states (torch, CUDA, random, NumPy): a run resumed from it "
                              f"would draw what the first run drew. Load it with "
                              f"restore_global_rng=False and seed the global RNGs afresh")
    state = torch.load(io.BytesIO(payload), weights_only=True)
    if state.get("format", 1) not in (1, FORMAT):
        raise CheckpointError(f"{path} is format {state.get('format')!r}; this workbench "
                              f"reads format {FORMAT}: load it with the version that wrote it")
    return state


__all__ = [
    "FORMAT", "MAGIC", "OLD_MAGIC", "read_checkpoint", "write_atomically", "write_checkpoint_file",
]
