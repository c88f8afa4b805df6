"""Two sizes of every real architecture: "tiny" for exactness, "base" for cost.

The table's verdicts run in float64 against a one-sample-at-a-time loop, so its models are
tiny (hidden 16, one or two layers, vocabulary 32): seconds per model and method. At that
size a plain step of a Hugging Face model is 3-14 ms of Python dispatch and almost no
arithmetic, so a DP step's cost over it measures fixed per-call costs (hooks, the use
tracker, one small op per layer and parameter), not the algorithms.

"base" keeps each architecture and widens it to the size where arithmetic is what a step
is made of on a CPU (the smallest published BERT/GPT configurations are 4-12 layers of
width 256-768; Turc et al. 2019, arXiv 1908.08962, Table 1 "BERT-Mini": 4 layers, hidden
256, 4 heads): hidden 256, 4 heads of 64, intermediate 1024, 2 layers, vocabulary 1024,
positions 128; images 32 x 32 at about 4x the tiny widths. Only keys a builder already sets
are changed (``scaled``), so each architecture keeps its own names and options.

``with size("base"): model = problem.build(...)`` builds the base model; ``current()`` is
what builders read.

Notation: T tokens per sequence, n batch size.
"""

import contextlib
import contextvars

SIZES = ("tiny", "base")
_SIZE = contextvars.ContextVar("realzoo_size", default="tiny")

BASE_CONFIG = {
    # width
    "hidden_size": 256, "n_embd": 256, "d_model": 256, "dim": 256, "word_embed_proj_dim": 256,
    # feed-forward width
    "intermediate_size": 1024, "ffn_dim": 1024, "hidden_dim": 1024, "d_ff": 1024,
    "encoder_ffn_dim": 1024, "decoder_ffn_dim": 1024,
    # heads (64 wide)
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "head_dim": 64, "d_kv": 64,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2,
    # tokens
    "vocab_size": 1024, "max_position_embeddings": 128, "n_positions": 128,
    # state-space models
    "state_size": 16, "conv_kernel": 4,
}
"""Config keys a "base" builder overrides, where the tiny builder sets them."""

NO_BASE = {
    "mixtral": "not measured at base: Hugging Face's batched_mm experts copy each token's k "
               "experts' weights (n·T·k·3·I·d floats, about 6 GB per forward pass at n = 16, "
               "T = 64), which measures that copy, not DP-SGD",
}
"""name -> why the model's cost is not measured at "base" (``bench real``)."""

TOKENS = {"tiny": 8, "base": 64}  # T of the cost measurement (bench real)
IMAGE = {"tiny": 16, "base": 32}  # image side of the image models
WIDTH = {"tiny": 1, "base": 4}  # the factor on the image models' channel widths


def current() -> str:
    return _SIZE.get()


@contextlib.contextmanager
def size(name: str):
    """Build the models of the table at ``name`` ("tiny" or "base") inside the block."""
    if name not in SIZES:
        raise ValueError(f"size must be one of {SIZES}; got {name!r}")
    token = _SIZE.set(name)
    try:
        yield name
    finally:
        _SIZE.reset(token)


def scaled(config: dict) -> dict:
    """A tiny builder's config at the current size: at "base", every key of
    ``BASE_CONFIG`` that the config sets takes the base value; a Mamba-2 config (``expand``,
    ``num_heads`` and ``head_dim``) keeps heads x head_dim = expand x hidden, as its SSD
    layer requires."""
    if current() == "tiny":
        return config
    out = {k: BASE_CONFIG.get(k, v) for k, v in config.items()}
    if {"expand", "num_heads", "head_dim", "hidden_size"} <= out.keys():
        out["num_heads"] = out["expand"] * out["hidden_size"] // out["head_dim"]
    return out


def width(channels: int) -> int:
    """An image model's channel width at the current size."""
    return channels * WIDTH[current()]


__all__ = ["BASE_CONFIG", "IMAGE", "NO_BASE", "SIZES", "TOKENS", "WIDTH", "current", "scaled",
           "size", "width"]
