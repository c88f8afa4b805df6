"""PEFT adapters on the table's tiny models: the families DP fine-tuning meets.

Under DP, fine-tuning mostly trains adapters (Yu et al. 2022, "Differentially Private
Fine-tuning of Language Models", arXiv 2110.06500): the base model frozen, only the adapter's
parameters clipped and noised. ``peft.get_peft_model`` freezes the base and adds them; each
builder here covers a way the adapter's parameters reach the output that the plain
``lora_llama`` of ``text.py`` does not:

- ``lora_gpt2``: LoRA on GPT-2's ``Conv1D`` (``fan_in_fan_out``: W stored (d, p), o = x W + c),
  h = Conv1D(x) + (α/r) B A x, the adapters' own Linear rules (Hu et al. 2021, arXiv
  2106.09685, Eq. 3);
- ``dora_bert``: DoRA (Liu et al. 2024, arXiv 2402.09353, Eq. 5), a magnitude m scaling the
  column-normalised adapted weight, h = (m / ||W + BA||_c) ⊙ (W x + B A x) with the norm
  detached (peft's §4.3 choice), on BERT for classification with ``modules_to_save`` on the
  head (a trainable copy of the classifier);
- ``prompt_tuning_gpt2``: prompt tuning (Lester et al. 2021, arXiv 2104.08691), v virtual
  token embeddings P (v, d) shared by the batch, ``P.repeat(n, 1, 1)`` concatenated before
  every sample's token embeddings: g_i^P = ∂ℓ_i/∂P, the Embedding's rule at that ``cat``
  (``per_sample/concat.py``; the logits of the virtual positions cut);
- ``loha_bert``: LoHa (Hyeon-Woo et al. 2022, arXiv 2108.06098), ΔW = (w1a w1b) ⊙ (w2a w2b)
  built inside a ``torch.autograd.Function`` no hook sees (``per_sample/unseen.py``);
- ``vblora_gpt2``: VB-LoRA (Li et al. 2024, arXiv 2405.15179), A and B assembled from top-k
  vectors of one bank shared by every adapted layer: one ``ParameterDict`` registered under
  every layer (``per_sample/functional.slot_values``).

The adapters' parameters are moved off their initial values (LoRA's B = 0 makes A's gradient
zero, DoRA's m = ||W||_c and LoHa's w2 init make others trivially zero or one), so every
parameter's per-sample gradient is checked for a non-trivial value.

Notation: x (n, T, d) activations, W (p, d) the frozen weight, A (r, d), B (p, r), r rank,
α scale, v virtual tokens.
"""

import importlib

import torch
from torch import nn

from workbench.realzoo.imports import import_transformers
from workbench.realzoo.text import Logits, encoder, gpt2


def _peft():
    import_transformers()  # torchvision's ops first (imports.py): peft imports transformers
    return importlib.import_module("peft")


def adapted(base: Logits, config) -> Logits:
    """``base`` with its Hugging Face model wrapped by ``peft.get_peft_model(config)``, the
    adapters' parameters moved by 0.1 N(0, 1) (global generator: ``Problem.build`` seeds it)."""
    base.hf = _peft().get_peft_model(base.hf, config)
    with torch.no_grad():
        for p in base.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return base


class PromptLogits(Logits):
    """``Logits`` of a prompt-tuned causal model: the virtual tokens' logits cut, (n, T, V)."""

    def forward(self, ids):
        return self.hf(input_ids=ids).logits[:, -ids.shape[1]:]


def lora_gpt2() -> nn.Module:
    peft = _peft()
    return adapted(gpt2(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_proj"],
                                           fan_in_fan_out=True))


def dora_bert() -> nn.Module:
    peft = _peft()
    return adapted(encoder("Bert"), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["query", "value"], use_dora=True,
        task_type="SEQ_CLS"))  # modules_to_save: the classifier


def prompt_tuning_gpt2() -> nn.Module:
    peft = _peft()
    model = adapted(gpt2(), peft.PromptTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM"))
    return PromptLogits(model.hf)


def loha_bert() -> nn.Module:
    peft = _peft()
    return adapted(encoder("Bert"), peft.LoHaConfig(r=2, target_modules=["query", "value"],
                                                    task_type="SEQ_CLS"))


def vblora_gpt2() -> nn.Module:
    peft = _peft()
    return adapted(gpt2(), peft.VBLoRAConfig(r=2, num_vectors=8, vector_length=4,
                                             target_modules=["c_attn", "mlp.c_proj"],
                                             fan_in_fan_out=True))  # two layers share the bank


ADAPTED_CAUSAL = {"lora_gpt2": lora_gpt2, "prompt_tuning_gpt2": prompt_tuning_gpt2,
                  "vblora_gpt2": vblora_gpt2}
"""name -> builder of a PEFT-adapted ids -> (n, T, V) logits model (next-token loss)."""

ADAPTED_CLASSIFIERS = {"dora_bert": dora_bert, "loha_bert": loha_bert}
"""name -> builder of a PEFT-adapted ids -> (n, K) logits model (cross-entropy on a label)."""

__all__ = ["ADAPTED_CAUSAL", "ADAPTED_CLASSIFIERS", "PromptLogits", "adapted", "dora_bert",
           "lora_gpt2", "loha_bert", "prompt_tuning_gpt2", "vblora_gpt2"]
