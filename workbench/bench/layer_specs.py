"""The layers the benchmarks measure: one spec table for ``bench layers`` and ``bench memory``.

Each ``LayerSpec`` builds a layer of a given *width* and a batch of b inputs for it. The
default widths follow Opacus' per-layer benchmark settings (Yousefpour et al. 2021, arXiv
2109.12298, §3.2, Fig. 2; opacus/benchmarks/config.json) with two exceptions: the embedding
reads T = 32 tokens per sample (as in the workbench's targets), and the convolution is scaled
down (Opacus: 64 -> 64 channels, 8x8 kernel, 50x100 inputs, ~100x the arithmetic, too heavy
for a 2-core CPU run). ``width`` is the one size ``bench memory --widths all`` and the memory
widget vary, which moves L/C: features for Linear, channels for Conv2d, the vocabulary
(num_embeddings, as in the paper's Fig. 3) for Embedding, the normalised size for the norm
layers, the hidden/embed size for the others.

The recurrent and attention layers (``dp=True``) are built from the workbench's DP twins;
``bench layers`` leaves them to ``bench dp_layers``, which times them against torch.nn.
"""

from dataclasses import dataclass

import torch
from torch import nn

from workbench.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from workbench.models import RNNOutput, SelfAttention

T = 32  # tokens / time steps per sample for the embedding, recurrent and attention layers


@dataclass(frozen=True)
class LayerSpec:
    """How to build a layer of a given width and a batch of b inputs for it."""

    make: object  # width -> nn.Module
    inputs: object  # (b, width, generator) -> tensor
    width: int  # default width (the one ``bench layers`` uses)
    widths: tuple  # the sweep of ``--widths all`` (L/C from small to large)
    what: str  # what ``width`` means for this layer
    dp: bool = False  # built from a DP twin (bench dp_layers times these against torch.nn)
    multiple_of: int = 1  # widths the layer can take (groups, heads)


def _seq(cls):
    return lambda w: nn.Sequential(cls(w, w, batch_first=True), RNNOutput())


def _randn(*tail):
    return lambda b, w, g: torch.randn(b, *[w if d == "w" else d for d in tail], generator=g)


LAYERS = {
    "linear": LayerSpec(lambda w: nn.Linear(w, w), _randn("w"), 512, (64, 512, 2048),
                        "in = out features"),
    "conv2d": LayerSpec(lambda w: nn.Conv2d(w, w, 3, padding=1), _randn("w", 16, 16),
                        32, (8, 32, 128), "in = out channels (16x16 images, 3x3 kernel)"),
    "embedding": LayerSpec(lambda w: nn.Embedding(w, 64),
                           lambda b, w, g: torch.randint(0, w, (b, T), generator=g),
                           20000, (100, 2000, 20000),
                           f"num_embeddings (dim 64, {T} tokens per sample)"),
    "layernorm": LayerSpec(lambda w: nn.LayerNorm(w), _randn("w"), 64, (64, 512, 4096),
                           "normalised size"),
    "groupnorm": LayerSpec(lambda w: nn.GroupNorm(16, w), _randn("w"), 256, (64, 256, 1024),
                           "channels (16 groups)", multiple_of=16),
    "instancenorm": LayerSpec(lambda w: nn.InstanceNorm1d(w, affine=True), _randn("w", 64),
                              256, (64, 256, 1024), "channels (length 64)"),
    "rnn": LayerSpec(_seq(DPRNN), _randn(T, "w"), 64, (16, 64, 256),
                     f"input = hidden size ({T} steps)", dp=True),
    "gru": LayerSpec(_seq(DPGRU), _randn(T, "w"), 64, (16, 64, 256),
                     f"input = hidden size ({T} steps)", dp=True),
    "lstm": LayerSpec(_seq(DPLSTM), _randn(T, "w"), 64, (16, 64, 256),
                      f"input = hidden size ({T} steps)", dp=True),
    "mha": LayerSpec(lambda w: SelfAttention(DPMultiheadAttention(w, 4, batch_first=True)),
                     _randn(T, "w"), 64, (16, 64, 256), f"embed size (4 heads, {T} tokens)",
                     dp=True, multiple_of=4),
}
TORCH_LAYERS = tuple(name for name, spec in LAYERS.items() if not spec.dp)  # bench layers


def check_layer(name: str, width: int | None = None) -> LayerSpec:
    """The spec of ``name``; a clear error for an unknown layer or a width it cannot take."""
    if name not in LAYERS:
        raise ValueError(f"layer must be one of {sorted(LAYERS)}; got {name!r}")
    spec = LAYERS[name]
    if width is not None:
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive int; got {width!r}")
        if width % spec.multiple_of:
            raise ValueError(f"width for {name} must be a multiple of {spec.multiple_of}; "
                             f"got {width}")
    return spec


def make_case(name: str, b: int, width: int | None = None, device="cpu", seed: int = 0):
    """(layer, inputs, targets) of ``LAYERS[name]`` at batch size b and ``width``, seeded.

    The targets have the output's shape (for ``steps.sum_of_products``); the layer's weights
    come from ``torch.manual_seed(seed)``, inputs and targets from a generator seeded alike.
    """
    spec = check_layer(name, width)
    width = spec.width if width is None else width
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    layer = spec.make(width).to(device)
    x = spec.inputs(b, width, g).to(device)
    with torch.no_grad():
        t = torch.randn(layer(x).shape, generator=g).to(device)
    return layer, x, t


__all__ = ["LAYERS", "T", "TORCH_LAYERS", "LayerSpec", "check_layer", "make_case"]
