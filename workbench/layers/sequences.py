"""Variable-length sequences for the DP recurrent layers: padded batches with lengths.

torch.nn's RNNs consume a ``PackedSequence``: time step t holds only the sequences still
running at t (sorted by length, longest first), so the batch shrinks along the way. A
per-sample grad sampler needs every hooked call to carry the *whole* batch on dim 0, row i
always sample i. So the DP layers unpack to a padded (n, T, d) batch in the caller's sample
order, run every step on all n rows, and keep a finished sequence's state frozen:

    h_t = h'_t  if t < len_i  else h_{t-1}           (per sample i)

Steps past a sequence's end then receive no gradient (their backprops are zero), so they add
nothing to its per-sample gradient, and the final state is the state at its last token, as
in PyTorch. A reverse direction reads each sequence backwards from its own last token:
``reverse_padded`` flips the first len_i steps of row i and leaves the padding in place.

Notation: n batch, T longest length, len_i the length of sequence i.
"""

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence


def unpack(packed: PackedSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded (n, T, d) in the caller's sample order, lengths (n,) int64 on CPU)."""
    return pad_packed_sequence(packed, batch_first=True)


def repack(padded: torch.Tensor, lengths: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """``padded`` (n, T, h) in the caller's order, packed exactly as ``like`` was packed."""
    order = like.sorted_indices
    if order is not None:  # packing sorts by length; undo the caller's order first
        padded, lengths = padded.index_select(0, order.to(padded.device)), lengths[order.cpu()]
    data = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


def valid_steps(lengths: torch.Tensor, T: int, device) -> torch.Tensor:
    """(n, T) bool: True at the steps t < len_i that belong to sequence i."""
    return torch.arange(T, device=device) < lengths.to(device).unsqueeze(1)


def reverse_padded(x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Flip each row's first len_i steps of x (n, T, ...); the padding stays put.

    Without lengths (every sequence full length) this is ``x.flip(1)``. Applying it twice
    gives x back, so it also maps the outputs of a reversed run back to reading order.
    """
    if lengths is None:
        return x.flip(1)
    n, T = x.shape[:2]
    t = torch.arange(T, device=x.device)
    last = lengths.to(x.device).unsqueeze(1) - 1  # (n, 1)
    index = torch.where(t <= last, last - t, t)  # (n, T)
    return x[torch.arange(n, device=x.device).unsqueeze(1), index]


__all__ = ["repack", "reverse_padded", "unpack", "valid_steps"]
