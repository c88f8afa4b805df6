"""DP-compatible re-implementations of layers whose fused kernels hide their matrix products.

| torch.nn               | workbench.layers       | hooked parts (parts.py)                        |
|------------------------|------------------------|------------------------------------------------|
| nn.RNN (tanh, relu)    | DPRNN                  | InputProjection (all steps in one call),       |
| nn.GRU                 | DPGRU                  | RecurrentProjection (per step, or one call on  |
| nn.LSTM                | DPLSTM                 | all states: recurrence.py)                     |
| nn.MultiheadAttention  | DPMultiheadAttention   | InProjection, SequenceBias, out_proj (Linear)  |

``lora.py`` adds low-rank adapters (LoRA) beside frozen Linear layers; they are Linear layers
themselves, so the Linear samplers cover them.

Files: parts.py (the hookable parts and their grad samplers, parameter sharing), cells.py (one
time step of each cell), recurrence.py (the loop over time, recorded by autograd), bptt.py (the
same loop as one autograd node with a hand-written backward, the default), sequences.py
(packed and variable-length sequences), rnn.py and attention.py (the layers).

Each is a drop-in: same constructor, forward, parameter names, shapes and initialisation, so
``state_dict`` loads both ways; ``DPLSTM.from_torch(lstm)`` and ``.to_torch()`` convert, and
``wb.fix_model(model)`` swaps them in for a whole model. Importing this package registers the
parts' grad samplers.

>>> import torch
>>> from torch import nn
>>> lstm = nn.LSTM(3, 4, batch_first=True)
>>> dp = DPLSTM.from_torch(lstm)
>>> [name for name, _ in dp.named_parameters()] == [name for name, _ in lstm.named_parameters()]
True
>>> x = torch.randn(2, 5, 3)
>>> torch.allclose(dp(x)[0], lstm(x)[0], atol=1e-6)
True
"""

from torch import nn

from workbench.layers import norms as _norms  # noqa: F401  (registers the parts' norm samplers)
from workbench.layers.attention import DPMultiheadAttention
from workbench.layers.lora import LoRALinear, add_lora, merge_lora
from workbench.layers.rnn import DPGRU, DPLSTM, DPRNN, DPRNNBase

DP_REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {
    nn.RNN: DPRNN,
    nn.GRU: DPGRU,
    nn.LSTM: DPLSTM,
    nn.MultiheadAttention: DPMultiheadAttention,
}
"""torch.nn layer type -> its DP twin (exact types: a subclass may change ``forward``)."""


def dp_replacement(module: nn.Module) -> nn.Module | None:
    """The DP twin of ``module`` with the same weights, or None if it needs none."""
    dp_class = DP_REPLACEMENTS.get(type(module))
    return None if dp_class is None else dp_class.from_torch(module)


__all__ = ["DPGRU", "DPLSTM", "DPMultiheadAttention", "DPRNN", "DPRNNBase", "DP_REPLACEMENTS",
           "LoRALinear", "add_lora", "dp_replacement", "merge_lora"]
