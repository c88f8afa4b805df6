"""LoRA: low-rank adapters beside frozen Linear layers; only the adapters train (and are clipped).

E. Hu et al. (2021), "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685,
§4.1, Eq. (3): a frozen weight W_0 (p, d) gets a trainable low-rank update,

    h = W_0 x + c + (α / r) B A x          A (r, d) ~ N(0, 1/r),  B (p, r) = 0 at the start

so the adapted layer starts equal to the original one. Under DP, only A and B are clipped and
noised: d_lora = r (d + p) per layer instead of p d (Yu et al. 2022, "Differentially Private
Fine-tuning of Language Models", arXiv 2110.06500, §3), so at the same σ the noise is spread
over far fewer coordinates.

**Why our own and not ``peft``.** ``peft`` pulls in ``transformers`` (and ``accelerate``,
``safetensors``, ``huggingface_hub``): hundreds of MB for some thirty lines here. More to the
point, ``A`` and ``B`` are plain ``nn.Linear`` layers (``lora_A``, ``lora_B``, no bias), so the
workbench's registered Linear grad and norm samplers apply to them unchanged: einsum, ghost
and book-keeping are exact on adapters with no new sampler (tests/layers/test_lora.py).

Notation: d in features, p out features, r rank, α scaling numerator, x (n, ..., d).
"""

import math

import torch
from torch import nn

DEFAULT_TARGETS = ("query", "key", "value", "proj", "fc")  # tiny_gpt's attention + MLP Linears


class LoRALinear(nn.Module):
    """``base(x) + (α / r) · lora_B(lora_A(x))`` with ``base`` frozen."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0,
                 generator: torch.Generator | None = None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear; got {type(base).__name__}")
        if int(r) != r or not 1 <= r <= min(base.in_features, base.out_features):
            raise ValueError(f"rank r must be an integer in [1, min(d, p)] = "
                             f"[1, {min(base.in_features, base.out_features)}]; got {r!r}")
        self.base = base.requires_grad_(False)
        self.r, self.alpha = int(r), float(alpha)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Linear(base.in_features, self.r, bias=False, **like)  # A (r, d)
        self.lora_B = nn.Linear(self.r, base.out_features, bias=False, **like)  # B (p, r)
        with torch.no_grad():
            A = torch.randn(self.lora_A.weight.shape, generator=generator,  # on the generator's
                            device=generator.device if generator is not None else None)  # device
            self.lora_A.weight.copy_(A / math.sqrt(self.r))
            self.lora_B.weight.zero_()  # ΔW = BA = 0: the adapted model starts as the base

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * self.lora_B(self.lora_A(x))  # (n, ..., p)  Eq. (3)

    def delta_weight(self) -> torch.Tensor:
        """ΔW = (α / r) B A, shape (p, d): what ``merge`` adds to the base weight."""
        return self.scaling * self.lora_B.weight @ self.lora_A.weight

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"


def add_lora(model: nn.Module, r: int = 4, alpha: float = 8.0, targets=DEFAULT_TARGETS,
             generator: torch.Generator | None = None) -> nn.Module:
    """Freeze ``model`` and wrap every nn.Linear whose attribute name is in ``targets``.

    In place; returns the model. Afterwards the only trainable parameters are the adapters'
    ``lora_A.weight`` and ``lora_B.weight``. Raises if no Linear matched ``targets``.
    """
    model.requires_grad_(False)
    found = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children()
             if name in targets and type(child) is nn.Linear]
    if not found:
        names = {path.rsplit(".", 1)[-1] for path, m in model.named_modules()
                 if type(m) is nn.Linear}
        raise ValueError(f"no nn.Linear named one of targets={tuple(targets)} in the model; "
                         f"its Linear layers are named {sorted(names)}")
    for parent, name in found:
        setattr(parent, name, LoRALinear(getattr(parent, name), r, alpha, generator))
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each LoRALinear by one nn.Linear with weight W_0 + ΔW (in place; inference)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                merged = child.base
                with torch.no_grad():
                    merged.weight += child.delta_weight()
                setattr(parent, name, merged)
    return model


__all__ = ["DEFAULT_TARGETS", "LoRALinear", "add_lora", "merge_lora"]
