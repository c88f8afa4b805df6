"""The layer rules, one file per layer family, each holding one ``LayerRule`` (``_rule.py``).

Every module in this folder is imported (``workbench.plugins``; a name starting with "_" is
skipped), so a new layer family is one new file ending in ``register_rule(LayerRule(...))``;
the table below is a reading aid.

| layer                                  | file         | grad rule        | norm routes         |
|----------------------------------------|--------------|------------------|---------------------|
| Linear (any leading dims); fast sum    | linear.py    | b_iᵀ a_i summed  | norm product, gram, |
| by behaviour: o = a W + c (GPT-2)      | linear.py    | A_iᵀ B_i         |   materialise       |
| Conv1d / Conv2d / Conv3d               | conv.py      | unfold, grouped, | gram (unfolded or   |
|   (conv_geometry, conv_grads,          |              |   depthwise      |   shifted),         |
|   conv_gram, conv_chunks: its parts)   |              |                  |   materialise       |
| Embedding; fast sum (a subclass: its   | embedding.py | scatter-add b_i  | segment sum         |
|   F.embedding lookup, per_sample/tied) |              |                  |                     |
| LayerNorm, GroupNorm, RMSNorm,         | norms.py     | b_i ⊙ â_i summed | none: fast gradient |
|   InstanceNorm1d/2d/3d                 |              |                  |   clipping          |
| by behaviour: o = A(a) + B(a) ⊙ w + β  | affine.py    | b_i ⊙ B(a_i)     | none                |
| by behaviour: o = conv(a, W') + c,     | std_conv.py  | Jᵀ of the conv   | none: fast gradient |
|   W' each filter standardised (BiT)    |              |   rule's g'_i    |   clipping          |
| by behaviour: o = act(γ ⊙ â + β) in a  | norm_        | the parent's     | none                |
|   norm subclass (BiT's GroupNorm+act)  |  activation  |   rule on Jᵀ b   |                     |
| a parameter broadcast into the batch   | broadcast.py | b_i summed to p  | broadcast sum       |
|   (ViT's cls_token.expand, x + pos)    |              |                  |                     |
"""

from workbench.plugins import import_submodules
from workbench.rules._rule import (
    MATERIALISE,
    RULES,
    LayerRule,
    Route,
    fast_reweighted,
    fast_weight_grads,
    find_layer_rule,
    register_rule,
    unregister_rule,
)

__all__ = ["MATERIALISE", "RULES", "LayerRule", "Route", "fast_reweighted", "fast_weight_grads",
           "find_layer_rule", "register_rule", "unregister_rule"]

import_submodules(__name__, __path__)
