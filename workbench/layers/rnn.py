"""DPRNN, DPGRU, DPLSTM: drop-in recurrent layers whose per-sample gradients are hookable.

``nn.RNN/GRU/LSTM`` run as one fused kernel, so hooks never see their matrix products. These
re-implementations are built from two hookable parts per layer and direction (Opacus blog
"Efficient per-sample gradient computation for more layers", RNN section; Yousefpour et al.
2021, arXiv 2109.12298, §E.2 and Table 2):

    X = x W_ihᵀ + b           InputProjection: all T steps in ONE call, (n, T, d) -> (n, T, G H)
    for t = 1..T:
        u_t = h_{t-1} W_hhᵀ    RecurrentProjection
        h_t = cell(X_t, u_t, h_{t-1})                                   (cells.py)

All time steps share W_ih and W_hh, so a sample's gradient is a sum over time (Opacus'
RNNLinear "time-summing"):

    ∂ℓ_i/∂W_ih = Σ_t X̄_{i,t} x_{i,t}ᵀ       one bmm over the T axis: the Linear rule
    ∂ℓ_i/∂W_hh = Σ_t ū_{i,t} h_{i,t-1}ᵀ

where X̄, ū are the backprops of the parts' outputs. For W_hh, recurrence.py has two forms of
the loop: one RecurrentProjection call per step (the engine sums T outer products), or one
call on all T states (one bmm, like W_ih), at the price of a forward-only pass to learn the
states first. ``recurrent_calls`` picks: ``"auto"`` (default) uses one call when something
records the part (the einsum engine's hooks), else none at all (bptt.py's backward gives W_hh
its gradient directly; the autograd loops make per-step calls); ``"per_step"`` / ``"one"``
force a form. All compute the same function.

Hooks see the batch on dim 0 of every call: ``batch_first=False`` inputs are transposed on
the way in (the results are per sample, (n, ...), either way), and a ``PackedSequence`` runs
as a padded batch with each finished sequence's state frozen (sequences.py), in the caller's
sample order.

Drop-in: the constructor arguments, the parameter names and shapes, the initialisation and
the forward signature are torch.nn's, so ``state_dict`` loads both ways and
``DPLSTM.from_torch(lstm)`` / ``dplstm.to_torch()`` convert (parts.py explains how the parts
share the Parameters). Supported: ``num_layers``, ``bidirectional``, ``batch_first``,
``dropout`` between layers, ``bias``, initial states, unbatched and packed inputs. Not
supported: LSTM ``proj_size`` (raises UnsupportedLayerError).

Speed: the loop over time runs as ONE autograd node per layer and direction, with a
hand-written backward through time (bptt.py): a few small ops per step instead of the ~15
autograd nodes a step of recurrence.py's loops records. ``backward_through_time =
"autograd"`` switches back to those loops, the slow twin the tests compare with (and what
runs under torch.func transforms and autocast). ``python -m workbench.bench dp_layers``
measures the price against torch.nn (the Opacus paper's Table 2 reports up to 11x on a GPU
for its DP layers).

Notation: n batch, T steps, d input size, H hidden size, G gate blocks (1 RNN, 3 GRU,
4 LSTM), L layers, D directions.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from workbench.errors import UnsupportedLayerError
from workbench.layers.bptt import fusable, run_bptt
from workbench.layers.cells import STEPS
from workbench.layers.parts import (
    InputProjection,
    PartsOwner,
    RecurrentProjection,
    owner_grad_sampler,
)
from workbench.layers.recurrence import run_one_call, run_per_step
from workbench.layers.sequences import repack, reverse_padded, unpack, valid_steps
from workbench.per_sample.registry import register_grad_sampler


class DPRNNBase(PartsOwner):
    """Shared machinery of DPRNN, DPGRU and DPLSTM (``mode`` as in torch.nn's RNNBase)."""

    def __init__(self, mode, input_size, hidden_size, num_layers=1, bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None):
        super().__init__()
        _check_config(type(self).__name__, input_size, hidden_size, num_layers, dropout)
        self.mode, self.input_size, self.hidden_size = mode, input_size, hidden_size
        self.num_layers, self.bias, self.batch_first = num_layers, bias, batch_first
        self.dropout, self.bidirectional, self.proj_size = float(dropout), bidirectional, 0
        self._step, G = STEPS[mode]
        D = 2 if bidirectional else 1
        factory = {"device": device, "dtype": dtype}
        for layer in range(num_layers):  # the parameters, named and ordered as in torch.nn
            d_in = input_size if layer == 0 else hidden_size * D
            for sfx in ("", "_reverse")[:D]:
                shapes = {"weight_ih": (G * hidden_size, d_in),
                          "weight_hh": (G * hidden_size, hidden_size)}
                if bias:
                    shapes.update(bias_ih=(G * hidden_size,), bias_hh=(G * hidden_size,))
                for kind, shape in shapes.items():
                    self.register_parameter(f"{kind}_l{layer}{sfx}",
                                            nn.Parameter(torch.empty(shape, **factory)))
        self.parts = nn.ModuleDict()  # the hookable parts, borrowing those parameters
        for layer in range(num_layers):
            for sfx in ("", "_reverse")[:D]:
                name = f"l{layer}{sfx}"
                b_ih, b_hh = (f"bias_ih_{name}", f"bias_hh_{name}") if bias else ("", "")
                gru = mode == "GRU"  # GRU's b_hh is gated by r: it stays with W_hh
                self.parts[f"ih_{name}"] = InputProjection(
                    self, weight=f"weight_ih_{name}", bias=b_ih, bias_hh="" if gru else b_hh)
                self.parts[f"hh_{name}"] = RecurrentProjection(
                    self, weight=f"weight_hh_{name}", bias=b_hh if gru else "")
        self.recurrent_calls = "auto"  # "auto" | "per_step" | "one": see the module docstring
        self.backward_through_time = "bptt"  # "bptt" | "autograd": see the module docstring
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """U(-1/√H, 1/√H) for every parameter, in torch.nn's order (same seed, same weights)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def flatten_parameters(self) -> None:
        """No-op, for code written for torch.nn (there is no fused weight buffer here)."""

    # --- forward -------------------------------------------------------------------------

    def forward(self, input, hx=None):
        """Same inputs and outputs as the torch.nn layer: ``(output, h_n)`` or, for LSTM,
        ``(output, (h_n, c_n))``; ``output`` is a PackedSequence when ``input`` is one."""
        packed = isinstance(input, PackedSequence)
        if packed:
            x, lengths = unpack(input)  # (n, T, d) in the caller's order, lengths (n,)
            batched = True
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"{type(self).__name__}: input must be 3-D (batched) or 2-D "
                                 f"(unbatched); got shape {tuple(input.shape)}")
            batched, lengths = input.dim() == 3, None
            x = input.unsqueeze(0) if not batched else input
            x = x.transpose(0, 1) if batched and not self.batch_first else x  # (n, T, d)
        if x.shape[-1] != self.input_size:
            raise ValueError(f"{type(self).__name__}: input has {x.shape[-1]} features, "
                             f"expected input_size={self.input_size}")
        n, T = x.shape[:2]
        states = self._initial_states(hx, n, x, batched)
        valid = None if lengths is None else valid_steps(lengths, T, x.device)  # (n, T)
        D = 2 if self.bidirectional else 1
        finals = []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(D):
                out, final = self._run(x, states[layer * D + direction], layer, direction,
                                       lengths, valid)
                outputs.append(out)
                finals.append(final)
            x = torch.cat(outputs, dim=2) if D == 2 else outputs[0]  # (n, T, D H)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        h_n = [torch.stack(s) for s in zip(*finals)]  # [(L D, n, H)] per state tensor
        if packed:
            output = repack(x, lengths, like=input)
        elif not batched:
            output, h_n = x.squeeze(0), [h.squeeze(1) for h in h_n]
        else:
            output = x if self.batch_first else x.transpose(0, 1)
        return output, (tuple(h_n) if self.mode == "LSTM" else h_n[0])

    def _run(self, x, state, layer, direction, lengths, valid):
        """One layer in one direction: x (n, T, d) -> outputs (n, T, H), final state."""
        name = f"l{layer}{'_reverse' if direction else ''}"
        ih, hh = self.parts[f"ih_{name}"], self.parts[f"hh_{name}"]
        if direction:
            x = reverse_padded(x, lengths)  # read each sequence from its last token
        X = ih(x)  # (n, T, G H): the input projection of every step, one hooked call
        one = self._one_recurrent_call(hh)
        if self._hand_written_backward(hh, one, X, state):
            out, state = run_bptt(self.mode, X, hh, state, valid, one_call=one)
        else:
            run = run_one_call if one else run_per_step
            out, state = run(self._step, X, hh, state, valid)  # (n, T, H), final state
        return (reverse_padded(out, lengths) if direction else out), state

    def _one_recurrent_call(self, hh) -> bool:
        if self.recurrent_calls not in ("auto", "per_step", "one"):
            raise ValueError(f"{type(self).__name__}.recurrent_calls must be 'auto', "
                             f"'per_step' or 'one'; got {self.recurrent_calls!r}")
        if self.recurrent_calls == "auto":
            return bool(hh._forward_hooks)  # recorded, e.g. by wb.per_sample_gradients
        return self.recurrent_calls == "one"

    def _hand_written_backward(self, hh, one_call, X, state) -> bool:
        if self.backward_through_time not in ("bptt", "autograd"):
            raise ValueError(f"{type(self).__name__}.backward_through_time must be 'bptt' or "
                             f"'autograd'; got {self.backward_through_time!r}")
        if self.backward_through_time == "autograd":
            return False
        per_step_recorded = not one_call and bool(hh._forward_hooks)  # T hooked calls
        return not per_step_recorded and fusable(X, hh.weight, *state)

    def _initial_states(self, hx, n, x, batched):
        """[(h0,) or (h0, c0)] per layer and direction, each tensor (n, H)."""
        LD = self.num_layers * (2 if self.bidirectional else 1)
        k = 2 if self.mode == "LSTM" else 1
        if hx is None:
            return [(x.new_zeros(n, self.hidden_size),) * k for _ in range(LD)]
        if self.mode == "LSTM" and not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            raise TypeError(f"DPLSTM: hx must be a tuple (h_0, c_0); got {type(hx).__name__}")
        hx = tuple(hx) if k == 2 else (hx,)
        if not batched:
            hx = tuple(h.unsqueeze(1) for h in hx)
        for h in hx:
            if tuple(h.shape) != (LD, n, self.hidden_size):
                expected = (LD, n, self.hidden_size) if batched else (LD, self.hidden_size)
                raise ValueError(f"{type(self).__name__}: initial state has shape "
                                 f"{tuple(h.shape)}; expected {expected} (num_layers * "
                                 f"num_directions, batch, hidden_size)")
        return [tuple(h[i] for h in hx) for i in range(LD)]

    @staticmethod
    def config_of(module) -> dict:
        return dict(input_size=module.input_size, hidden_size=module.hidden_size,
                    num_layers=module.num_layers, bias=module.bias,
                    batch_first=module.batch_first, dropout=module.dropout,
                    bidirectional=module.bidirectional)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        defaults = dict(num_layers=1, bias=True, batch_first=False, dropout=0.0,
                        bidirectional=False)
        return s + "".join(f", {k}={getattr(self, k)}" for k, v in defaults.items()
                           if getattr(self, k) != v)


class DPRNN(DPRNNBase):
    """Drop-in ``nn.RNN`` (Elman RNN, tanh or relu) with hookable per-sample gradients."""

    torch_class = nn.RNN

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"DPRNN: nonlinearity must be 'tanh' or 'relu'; got "
                             f"{nonlinearity!r}")
        super().__init__(f"RNN_{nonlinearity.upper()}", input_size, hidden_size, num_layers,
                         bias, batch_first, dropout, bidirectional, device, dtype)
        self.nonlinearity = nonlinearity

    def extra_repr(self) -> str:
        relu = ", nonlinearity=relu" if self.nonlinearity == "relu" else ""
        return super().extra_repr() + relu

    @staticmethod
    def config_of(module) -> dict:
        return {**DPRNNBase.config_of(module), "nonlinearity": module.nonlinearity}


class DPGRU(DPRNNBase):
    """Drop-in ``nn.GRU`` with hookable per-sample gradients."""

    torch_class = nn.GRU

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None):
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, device, dtype)


class DPLSTM(DPRNNBase):
    """Drop-in ``nn.LSTM`` with hookable per-sample gradients (``proj_size`` unsupported)."""

    torch_class = nn.LSTM

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None):
        if proj_size:
            _no_proj_size(proj_size)
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, device, dtype)

    @staticmethod
    def config_of(module) -> dict:
        if getattr(module, "proj_size", 0):
            _no_proj_size(module.proj_size)
        return DPRNNBase.config_of(module)


register_grad_sampler(DPRNN, DPGRU, DPLSTM)(owner_grad_sampler)


def _check_config(name, input_size, hidden_size, num_layers, dropout):
    for arg, value in (("input_size", input_size), ("hidden_size", hidden_size),
                       ("num_layers", num_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {arg} must be a positive int; got {value!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise ValueError(f"{name}: dropout must be a probability in [0, 1]; got {dropout!r}")


def _no_proj_size(proj_size):
    raise UnsupportedLayerError(
        f"DPLSTM does not support proj_size={proj_size} (LSTM with projections): use "
        f"proj_size=0 and, if you need the smaller output, a Linear layer after the LSTM")


__all__ = ["DPGRU", "DPLSTM", "DPRNN", "DPRNNBase"]
