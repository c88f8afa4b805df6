"""Built-in grad samplers, one file per layer family; importing this registers them all.

| layer                                   | file          | rule                                 |
|-----------------------------------------|---------------|--------------------------------------|
| Linear (any leading dims)               | linear.py     | b_iᵀ a_i summed over positions       |
| Conv1d / Conv2d / Conv3d                | conv.py       | unfold, then the Linear rule         |
| Embedding                               | embedding.py  | scatter-add of b_i into rows of a_i  |
| LayerNorm, GroupNorm, InstanceNorm*d,   | norms.py      | b_i ⊙ â_i summed (â: normalised a)   |
| RMSNorm                                 |               |                                      |
"""

from workbench.per_sample.samplers import conv, embedding, linear, norms  # noqa: F401
