"""The real-architecture table: models people fine-tune, from tiny configs, random weights.

``PROBLEMS[name]`` builds (model, loss_fn) and batches of any size n: language models on
token ids (n, T) with the next-token loss summed over positions, encoders and image models with
cross-entropy on one label per sample. float64 by default: the table checks every method of
the functional API and every DP-optimizer mode against one-sample-at-a-time gradients
(``tests/per_sample/test_real_models.py``) and ``python -m workbench.bench real`` times them.

Needs the ``realmodels`` extra (transformers, timm, peft; torchvision through timm):
``pip install '.[realmodels]'``; nothing is downloaded (``HF_HUB_OFFLINE=1`` is fine).

PEFT adapters (``adapters.py``: LoRA on GPT-2's Conv1D, DoRA, prompt tuning, LoHa, VB-LoRA)
train only the adapters' parameters, as ``peft.get_peft_model`` sets them.

``REFUSED[name]``: the methods that must raise, and why (never a silent answer): BatchNorm
mixes the samples of a batch (``fix_model``); Bloom's ALiBi builds its bias with in-place
writes that ``torch.func.vmap`` cannot run, nor LoHa's ``torch.autograd.Function`` (no
``setup_context``); DeBERTa's forward tests the ids for padding in Python: data-dependent
control flow, which vmap cannot run either.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.realzoo import adapters, sizes, text, vision
from workbench.realzoo.reference import RTOL, RTOL_FLOAT32_INSIDE

VOCAB, CLASSES, SIZE = text.VOCAB, text.CLASSES, vision.SIZE


def next_token_loss(logits, y):
    """Σ_t cross-entropy(logits_t, y_t) per sample: (n, T, V), (n, T) -> (n,)."""
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


def label_loss(logits, y):
    """cross-entropy per sample: (n, K), (n,) -> (n,)."""
    return F.cross_entropy(logits, y, reduction="none")


@dataclass(frozen=True)
class Problem:
    name: str
    kind: str  # "causal" (ids -> (n, T, V)), "classify" (ids -> (n, K)), "image"

    def build(self, dtype=torch.float64, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return BUILDERS[self.kind][self.name]().to(dtype)

    @property
    def loss_fn(self):
        return next_token_loss if self.kind == "causal" else label_loss

    @property
    def rtol(self) -> float:
        """The relative tolerance of its float64 checks (``FLOAT32_INSIDE``)."""
        return RTOL_FLOAT32_INSIDE if self.name in FLOAT32_INSIDE else RTOL

    def batch(self, n: int, T: int = 5, seed: int = 0, dtype=torch.float64):
        """(inputs, targets) of n samples; T tokens per sequence for the text models (the
        vocabulary and image side of the current size, ``sizes.py``)."""
        g = torch.Generator().manual_seed(seed)
        if self.kind == "image":
            side = sizes.IMAGE[sizes.current()]
            return (torch.randn(n, 3, side, side, generator=g, dtype=dtype),
                    torch.randint(0, CLASSES, (n,), generator=g))
        vocab = sizes.scaled({"vocab_size": VOCAB})["vocab_size"]
        ids = torch.randint(2, vocab, (n, T), generator=g)  # 0, 1: pad / special ids
        if self.kind == "classify":
            return ids, torch.randint(0, CLASSES, (n,), generator=g)
        return ids, torch.randint(0, vocab, (n, T), generator=g)


BUILDERS = {"causal": {**text.CAUSAL, **adapters.ADAPTED_CAUSAL},
            "classify": {**text.CLASSIFIERS, **adapters.ADAPTED_CLASSIFIERS},
            "image": vision.IMAGES}
"""kind -> {name: builder}: the tiny models (``text.py``, ``vision.py``) and their PEFT
adapters (``adapters.py``)."""

PROBLEMS = {name: Problem(name, kind) for kind, table in BUILDERS.items() for name in table}

FLOAT32_INSIDE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "lora_llama", "mamba", "t5",
                  "mixtral", "mamba2", "deberta"}
"""Models whose RMSNorm (DeBERTa: LayerNorm) computes in float32 whatever the model's dtype
(Hugging Face's ``hidden_states.to(torch.float32)``): even in float64 their answers carry
float32 rounding, which a method's different order of operations (ghost's second backward
pass) changes by ~1e-8 relative, so they are checked to ``RTOL_FLOAT32_INSIDE``."""

REFUSED = {
    "bloom": {"vmap": "vmap"},
    "deberta": {"vmap": "vmap"},  # transformers' warn_if_padding_and_no_attention_mask
    "loha_bert": {"vmap": "vmap"},
}
"""name -> {method or "all": a word the error message must contain}."""

__all__ = ["PROBLEMS", "REFUSED", "Problem", "label_loss", "next_token_loss"]
