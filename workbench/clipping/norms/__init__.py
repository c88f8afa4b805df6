"""Built-in norm samplers; importing this registers them.

Every module in this folder is imported (``workbench.plugins``), so a new norm sampler is one
new file with ``@register_norm_sampler(MyLayer)``; the table below is a reading aid.

| layer                  | file          | rule                                                  |
|------------------------|---------------|-------------------------------------------------------|
| Linear                 | linear.py     | ||b_i|| ||a_i||, <A_i A_iᵀ, B_i B_iᵀ>, or materialise  |
| Conv1d / 2d / 3d       | conv.py       | unfold, then the Linear rule with T = output positions |
| Embedding              | embedding.py  | per-sample segment sums over equal indices             |

Everything else (LayerNorm, GroupNorm, InstanceNorm, RMSNorm, custom layers): fast gradient
clipping, i.e. the layer's per-sample gradient is materialised, normed and dropped.
"""

from workbench.plugins import import_submodules

import_submodules(__name__, __path__)


__all__: list[str] = []  # the files here register themselves; nothing to import
