"""Hookable parts of the DP layers, and their grad samplers.

PyTorch runs ``nn.LSTM`` or ``nn.MultiheadAttention`` as one fused kernel, so a forward hook
sees the whole layer, never the matrix products inside it, and no per-sample rule can be
attached. The DP layers are re-written from small modules ("parts") whose every call is an
ordinary, hookable matrix product (Opacus blog "Efficient per-sample gradient computation for
more layers", sections on RNNs and multi-head attention; Yousefpour et al. 2021, arXiv
2109.12298, Appendix B). Each part comes with its rule, registered like any other sampler:

| part               | forward, per sample i                 | per-sample gradient        |
|--------------------|---------------------------------------|----------------------------|
| InputProjection    | X_i = x_i W_ihᵀ + b_ih (+ b_hh)       | Σ_t X̄_t x_tᵀ; Σ_t X̄_t     |
| RecurrentProjection| u_i = h_i W_hhᵀ (+ b_hh) (+ X_i)     | the Linear rule (one step) |
| InProjection       | q, k, v = [x_q, x_k, x_v] W_inᵀ + b_in | the Linear rule per block  |
| SequenceBias       | [k_i ; β]  (append β to the sequence) | the backprop of that row   |

(X̄ = ∂(Σ ℓ)/∂X, the backprops.)

**Borrowed parameters.** A DP layer must be a drop-in for its torch.nn twin: the same
parameter names (``weight_ih_l0``, ``in_proj_weight``, ...), so ``state_dict`` loads both ways
and ``wb.per_sample_gradients`` keys read the same. So the DP layer registers each Parameter
under its torch.nn name, and the parts register the *same Parameter objects* under the short
names their samplers use (``weight``, ``bias``). ``named_parameters()`` lists a shared
Parameter once, under its first name, which is the layer's own; the einsum engine hooks the
parts, matches their results to the layer's names by identity, and sums over calls. A part
leaves itself out of ``state_dict`` (its owner saves the tensors), and ``tie`` re-links it
after something replaced the owner's Parameters (``load_state_dict(assign=True)``).

The owning DP layers themselves get a sampler that returns nothing: their outputs are tuples,
which the engine does not record, and their parameters are fully covered by the parts.

Notation: n batch, T time steps, x inputs, h hidden states, X̄ / ū backprops.
"""

import torch
import torch.nn.functional as F
from torch import nn

from workbench.per_sample.registry import register_grad_sampler
from workbench.rules.linear import linear_grad_sampler


class Part(nn.Module):
    """A hookable piece of a DP layer that borrows some of the layer's Parameters.

    ``names`` maps the part's local names to the owner's parameter names, e.g.
    ``Part(owner, weight="weight_hh_l0")``; an owner attribute that is None stays None.
    """

    def __init__(self, owner: nn.Module, **names: str):
        super().__init__()
        self.borrowed = dict(names)
        self.tie(owner)

    def tie(self, owner: nn.Module) -> None:
        """(Re-)point every borrowed name at the owner's current Parameter."""
        for local, name in self.borrowed.items():
            self._parameters[local] = getattr(owner, name) if name else None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the owner saves these tensors under their torch.nn names

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        pass  # ... and loads them; ``tie`` follows when Parameters were replaced

    def extra_repr(self) -> str:
        return ", ".join(f"{local}={name}" for local, name in self.borrowed.items() if name)


class PartsOwner(nn.Module):
    """Base of the DP layers: Parameters under torch.nn names, borrowed by ``self.parts``.

    Subclasses set ``torch_class`` (their torch.nn twin) and ``config_of(module)`` (the
    constructor arguments, read from either twin); conversion both ways is then generic.
    """

    torch_class: type[nn.Module]
    parts: nn.ModuleDict

    @staticmethod
    def config_of(module: nn.Module) -> dict:
        raise NotImplementedError

    @classmethod
    def from_torch(cls, module: nn.Module) -> "PartsOwner":
        """A DP copy of a torch.nn layer: same configuration, weights, flags and mode."""
        if type(module) is not cls.torch_class:
            raise TypeError(f"{cls.__name__}.from_torch expects an nn.{cls.torch_class.__name__}"
                            f"; got {type(module).__name__}")
        return copy_into(cls, cls.config_of(module), module)

    def to_torch(self) -> nn.Module:
        """The equivalent torch.nn layer (same weights, flags and mode), e.g. for serving."""
        return copy_into(self.torch_class, self.config_of(self), self)

    def tie_parts(self) -> None:
        for part in self.parts.values():
            part.tie(self)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.tie_parts()  # a conversion may have replaced Parameter objects
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.tie_parts()  # load_state_dict(assign=True) replaces our Parameters


def copy_into(cls, config: dict, source: nn.Module) -> nn.Module:
    """``cls(**config)`` holding ``source``'s weights, requires_grad flags and mode."""
    p = next(source.parameters())
    # built on the meta device, then given memory: no random initialisation to overwrite
    target = cls(**config, device="meta", dtype=p.dtype).to_empty(device=p.device)
    target.load_state_dict(source.state_dict())
    for name, q in source.named_parameters():
        target.get_parameter(name).requires_grad_(q.requires_grad)
    return target.train(source.training)


class InputProjection(Part):
    """x (n, T, d) -> x W_ihᵀ + b_ih + b_hh (n, T, G H): every time step in one call.

    RNN and LSTM add both biases to the same pre-activation at every step (the second one
    exists for cuDNN compatibility), so both are added here, once for all T steps, and their
    per-sample gradients are equal. GRU multiplies b_hn by its reset gate, so for GRU
    ``bias_hh`` is not borrowed here but by the RecurrentProjection.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias
        if b is not None and self.bias_hh is not None:
            b = b + self.bias_hh
        return F.linear(x, self.weight, b)  # (n, T, G H)


class RecurrentProjection(Part):
    """h (n, H) -> h W_hhᵀ + b_hh, plus ``add`` (the step's input projection) when given.

    Called once per time step; the engine sums the T per-call gradients ("time-summing",
    Opacus' RNNLinear). Fusing ``add`` into the same matrix product saves one op per step;
    it does not change the rule, since ∂u/∂(h W_hhᵀ) = I.
    """

    def forward(self, h: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if add is None:
            return F.linear(h, self.weight, self.bias)  # (n, G H)
        if self.bias is not None:
            add = add + self.bias
        return torch.addmm(add, h, self.weight.t())  # (n, G H)


class InProjection(Part):
    """Multi-head attention's q, k, v projections, in one hookable call.

    Self-attention (``in_proj(x)``): one product with the packed weight, output (n, L, 3E),
    exactly a Linear layer. Otherwise (``in_proj(query, key, value)``): three products, each
    with its block of ``in_proj_weight`` (or with ``q/k/v_proj_weight`` when kdim or vdim
    differ from E), returned concatenated along the sequence: (n, L + S + S, E).
    """

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.weight is not None:
            return self.weight.chunk(3)  # blocks of the packed (3E, E) weight
        return self.q_weight, self.k_weight, self.v_weight

    def forward(self, query, key=None, value=None) -> torch.Tensor:
        if key is None:
            return F.linear(query, self.weight, self.bias)  # (n, L, 3E)
        biases = self.bias.chunk(3) if self.bias is not None else (None,) * 3
        parts = [F.linear(a, W, b) for a, W, b in zip((query, key, value), self.weights(),
                                                       biases)]
        return torch.cat(parts, dim=1)  # (n, L + 2S, E)


class SequenceBias(Part):
    """k (n, S, E) -> [k ; β] (n, S + 1, E): a learned vector appended to every sequence.

    The ``add_bias_kv`` option of multi-head attention (the Opacus "SequenceBias" layer).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beta = self.bias.expand(x.shape[0], 1, x.shape[2])  # bias: (1, 1, E)
        return torch.cat([x, beta], dim=1)


@register_grad_sampler(InputProjection)
def input_projection_grad_sampler(layer, activations, backprops):
    out = linear_grad_sampler(layer, activations, backprops)  # weight: Σ_t X̄_t x_tᵀ, bias: Σ_t X̄_t
    if layer.bias_hh is not None and layer.bias_hh.requires_grad:
        n, p = backprops.shape[0], backprops.shape[-1]
        out["bias_hh"] = backprops.reshape(n, -1, p).sum(dim=1)  # (n, G H), equal to bias's
    return out


register_grad_sampler(RecurrentProjection)(linear_grad_sampler)  # reads activations[0] = h


@register_grad_sampler(InProjection)
def in_projection_grad_sampler(layer, activations, backprops):
    if len(activations) == 1:  # self-attention: a Linear layer with the packed weight
        return linear_grad_sampler(layer, activations, backprops)
    L, S = activations[0].shape[1], activations[1].shape[1]  # query (n, L, E), key (n, S, kdim)
    blocks = backprops.split([L, S, S], dim=1)  # q̄ (n, L, E), k̄ (n, S, E), v̄ (n, S, E)

    def block_grads():  # Σ_t b_t a_tᵀ for q, k, v: (n, E, E|kdim|vdim)
        return [torch.bmm(b.transpose(1, 2), a) for b, a in zip(blocks, activations)]

    out = {}
    if layer.weight is not None and layer.weight.requires_grad:
        out["weight"] = torch.cat(block_grads(), dim=1)  # (n, 3E, E), the packed layout
    elif layer.weight is None:
        for name, g in zip(("q_weight", "k_weight", "v_weight"), block_grads()):
            if getattr(layer, name).requires_grad:
                out[name] = g
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = torch.cat([b.sum(dim=1) for b in blocks], dim=1)  # (n, 3E)
    return out


@register_grad_sampler(SequenceBias)
def sequence_bias_grad_sampler(layer, activations, backprops):
    if not layer.bias.requires_grad:
        return {}
    n, E = backprops.shape[0], backprops.shape[2]
    return {"bias": backprops[:, -1].reshape(n, 1, 1, E)}  # the appended row's backprop


def owner_grad_sampler(layer, activations, backprops):
    """The sampler of a DP layer itself: nothing to add, its parts carry every gradient.

    Registered for DPRNN, DPGRU, DPLSTM and DPMultiheadAttention so that the engine (which
    hooks every module owning trainable parameters) knows they are supported. Their outputs
    are tuples, which the engine does not record, so this is not even called.
    """
    return {}


__all__ = [
    "InProjection", "InputProjection", "Part", "PartsOwner", "RecurrentProjection", "SequenceBias",
    "copy_into", "in_projection_grad_sampler", "input_projection_grad_sampler",
    "owner_grad_sampler", "sequence_bias_grad_sampler",
]
