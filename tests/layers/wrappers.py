"""Small models around the DP layers for the tests: batch on dim 0 in, one Tensor out.

``per_sample_gradients`` wants ``model(*inputs)`` with the batch on dim 0 of every input and
one output tensor; these wrappers adapt the layers' torch.nn conventions (time-major inputs,
(L D, n, H) states, PackedSequence, (output, state) pairs) to that.
"""

import itertools

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from workbench.audit.gradients import relative_error  # noqa: F401  max|a-b| / max|b|


def flat_state(state) -> torch.Tensor:
    """h_n, or (h_n, c_n), as (n, L D H [+ L D H]): every final state, batch first."""
    tensors = state if isinstance(state, tuple) else (state,)
    return torch.cat([s.transpose(0, 1).flatten(1) for s in tensors], dim=1)


class RNNModel(nn.Module):
    """(x (n, T, d) [, h0 (n, L D, H) [, c0]]) -> [outputs, final states] (n, K)."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0=None, c0=None):
        if not self.rnn.batch_first:
            x = x.transpose(0, 1)
        hx = None if h0 is None else h0.transpose(0, 1)
        if c0 is not None:
            hx = (hx, c0.transpose(0, 1))
        out, state = self.rnn(x, hx)
        if not self.rnn.batch_first:
            out = out.transpose(0, 1)
        return torch.cat([out.flatten(1), flat_state(state)], dim=1)


class PackedRNNModel(nn.Module):
    """(x (n, T, d), lengths (n,)) -> [padded outputs, final states] (n, K), via packing."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, state = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return torch.cat([out.flatten(1), flat_state(state)], dim=1)


class AttentionModel(nn.Module):
    """(query [, key, value] [, key_padding_mask]) (batch first) -> attention output (n, L, E).

    ``attn_mask`` (shared by all samples) is fixed at construction.
    """

    def __init__(self, attention: nn.Module, attn_mask=None):
        super().__init__()
        self.attention, self.attn_mask = attention, attn_mask

    def forward(self, query, key=None, value=None, key_padding_mask=None):
        key = query if key is None else key
        value = key if value is None else value
        if not self.attention.batch_first:  # keep `query is key` (self-attention) visible
            q = query.transpose(0, 1)
            k = q if key is query else key.transpose(0, 1)
            query, key, value = q, k, k if value is key else value.transpose(0, 1)
        out, _ = self.attention(query, key, value, key_padding_mask=key_padding_mask,
                                attn_mask=self.attn_mask)
        return out if self.attention.batch_first else out.transpose(0, 1)


# Every constructor option of the recurrent twins that changes the computation: layers,
# directions, bias, batch layout (16 combinations), with readable test ids.
RNN_OPTIONS = [dict(num_layers=L, bidirectional=bi, batch_first=bf, bias=bias)
               for L, bi, bf, bias in itertools.product((1, 2), (False, True), (False, True),
                                                        (True, False))]


def options_id(options):
    return "-".join(f"{k}={int(v)}" for k, v in options.items())
