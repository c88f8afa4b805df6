"""Built-in grad samplers, one file per layer family; importing this registers them all.

Every module in this folder is imported (``workbench.plugins``), so a new layer family is one
new file with ``@register_grad_sampler(MyLayer)``; the table below is a reading aid.

| layer                                   | file          | rule                                 |
|-----------------------------------------|---------------|--------------------------------------|
| Linear (any leading dims)               | linear.py     | b_iᵀ a_i summed over positions       |
| Conv1d / Conv2d / Conv3d                | conv.py       | unfold, then the Linear rule         |
| Embedding                               | embedding.py  | scatter-add of b_i into rows of a_i  |
| LayerNorm, GroupNorm, InstanceNorm*d,   | norms.py      | b_i ⊙ â_i summed (â: normalised a)   |
| RMSNorm                                 |               |                                      |
| by behaviour: o = A(a) + B(a) ⊙ w (+ β) | affine.py     | b_i ⊙ B(a_i) summed; HF RMSNorms,    |
|   (probe of the layer's own forward)    |               | T5LayerNorm, timm LayerNorm(2d)      |
| by behaviour: o = a W + c (GPT-2 Conv1D)| linear.py     | A_iᵀ B_i                             |
"""

from workbench.plugins import import_submodules

import_submodules(__name__, __path__)


__all__: list[str] = []  # the files here register themselves; nothing to import
