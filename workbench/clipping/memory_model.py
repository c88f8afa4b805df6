"""The memory model: the Opacus paper's Eq. (1)-(3), and ghost clipping's scratch per route.

The Opacus paper (Yousefpour et al. 2021, arXiv 2109.12298, §3.2.2, Eq. 1-3) counts, per
sample, C = the bytes of its features, label and output, and L = the bytes of the trainable
parameters:

    M_nonDP = bC + 2L              Eq. (1): data and output, parameters, their gradient
    M_DP    = bC + (1 + b)L        Eq. (2): the gradient becomes b per-sample gradients
    M_DP / M_nonDP ≈ 1 + L/C (L/C ≪ b),  b/3 (L/C ≈ b),  b/2 (L/C ≫ b)      Eq. (3)

Ghost clipping and book-keeping never hold bL. The workbench's model for them is

    M_ghost = bC + 2L + b·S,   S = Σ over layer calls of (backprop numbers kept for the norms
                                   + the norm route's scratch per sample) x bytes per number

with the scratch of each route of ``ghost_routes``, per sample, which each route declares
itself (``rules.Route.scratch``, in its layer family's file; ``route_scratch`` asks it):

- "norm product" (one position, Goodfellow 2015): 2 numbers, ||a_i||² and ||b_i||²;
- "gram" (Li et al. 2022, arXiv 2110.05679, §4): two (T, T) Grams A_i A_iᵀ and B_i B_iᵀ per
  group, 2·G·T² numbers. A Linear (or a DP layer's linear part) has G = 1 and T positions;
  a convolution with G groups unfolds to a Linear per group over its T = L output positions,
  and ``rules/conv_gram.py`` builds the Grams of every group at once, (n, G, L, L) each;
- "segment sum" (the embedding): the T·d backprop rows summed by index;
- "gram (shared)" (a weight in several calls, ``cross.py``): the call's (T, T) Grams with
  itself and the other calls, counted as two of its own (2·T² numbers);
- materialise, fast gradient clipping, materialise (shared), exact fallback, bias only: the
  layer's own per-sample gradient (P numbers);
- a new layer's routes: what its rule file declares, tested against measurement
  (``tests/test_new_layer.py``); a route without a declared cost makes the model raise.

Temporaries (an unfolded input, an elementwise product before its sum) are not in the model;
the paper found Eq. (3) off by -23% to +41% on a GPU, and Eq. (1)-(2) explaining only 57% of
the measured peak on average (its Fig. 3, §3.2.3). ``python -m workbench.bench memory``
measures all of it against this model.

Notation: b (or n) batch size, L parameter bytes, C bytes per sample, S ghost bytes per
sample, T positions per sample, G groups of a convolution, a activations, b backprops.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from workbench.clipping.routes import COLUMNS, route_calls
from workbench.rules._rule import Route

if TYPE_CHECKING:
    import pandas as pd


def model_bytes(b: int, L: float, C: float, S: float = 0.0) -> dict:
    """Eq. (1), Eq. (2) and the ghost model, in bytes, for batch size b."""
    return {"plain": b * C + 2 * L,  # Eq. (1)
            "einsum": b * C + (1 + b) * L,  # Eq. (2)
            "ghost": b * C + 2 * L + b * S}


def eq3_regime(L_over_C: float, b: int) -> str:
    """Which case of Eq. (3) applies (within a factor 4)."""
    if L_over_C * 4 < b:
        return "L/C ≪ b: ≈ 1 + L/C"
    if L_over_C > 4 * b:
        return "L/C ≫ b: ≈ b/2"
    return "L/C ≈ b: ≈ b/3"


def layer_sizes(layer: nn.Module, x: torch.Tensor, t: torch.Tensor) -> dict:
    """L (trainable parameter bytes) and C (bytes per sample of input, label and output).

    ``t`` is a label of the output's shape, so the output counts as many bytes as ``t``.
    """
    with torch.no_grad():
        out_shape = layer(x).shape
    if out_shape != t.shape:
        raise ValueError(f"t must have the layer's output shape {tuple(out_shape)}; got "
                         f"{tuple(t.shape)}")
    n = x.shape[0]
    L = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    C = (x.numel() * x.element_size() + 2 * t.numel() * t.element_size()) / n
    return {"L_bytes": L, "C_bytes": C, "L/C": L / C}


def route_scratch(route: Route, layer: nn.Module, call) -> int:
    """Numbers per sample that ``route`` creates for one call of ``layer``: the route's own
    ``scratch`` (its rule file declares it). A route of unknown cost raises, naming the layer:
    a model that guessed would be silently wrong for a new layer."""
    if route.scratch is None:
        raise ValueError(
            f"the norm route {route.name!r} of {type(layer).__name__} declares no scratch, so "
            f"the memory model cannot count it; give its rule Route objects with their costs "
            f"(workbench.rules.Route(name, scratch=lambda layer, call: ...), see CONTRIBUTING)")
    return int(route.scratch(layer, call))


def ghost_memory(model, loss_fn, inputs, targets) -> "pd.DataFrame":
    """``ghost_routes`` with what each layer call holds per sample for the ghost norms.

    Columns added: ``backprops`` (numbers per sample kept until the norms are taken),
    ``scratch`` (numbers per sample the route creates, ``route_scratch``) and ``bytes`` (per
    number: the backprops' element size). A batch of two samples is enough: all is per sample.
    """
    import pandas as pd  # lazy: pandas only where used

    rows = []
    for row, layer, call, route in route_calls(model, loss_fn, inputs, targets, check=False):
        if call is None:  # a fallback layer no hook saw: its gradient, materialised exactly
            own = [p for p in layer.parameters(recurse=False) if p.requires_grad]
            kept, size = 0, own[0].element_size() if own else 4
        else:
            kept, size = call.backprops[0].numel(), call.backprops.element_size()
        rows.append({**row, "backprops": kept, "scratch": route_scratch(route, layer, call),
                     "bytes": size})
    return pd.DataFrame(rows, columns=[*COLUMNS, "backprops", "scratch", "bytes"])


def ghost_scratch_bytes(model, loss_fn, inputs, targets) -> int:
    """S of the ghost model: per-sample bytes held for the norms, summed over layer calls."""
    table = ghost_memory(model, loss_fn, inputs, targets)
    return int(((table["backprops"] + table["scratch"]) * table["bytes"]).sum())


__all__ = [
    "eq3_regime", "ghost_memory", "ghost_scratch_bytes", "layer_sizes", "model_bytes",
    "route_scratch",
]
