"""The one table of per-sample methods: every ``method=`` of the workbench is named here.

A method is how the per-sample gradients g_i of a batch reach the clipped sum
Σ_i min(1, C / ||g_i||) g_i (Abadi et al. 2016, arXiv 1607.00133, Algorithm 1): by
*materialising* them as (n, *shape) tensors, or from each layer's activations a and
backprops b alone (ghost clipping, Li et al. 2022, arXiv 2110.05679; book-keeping, Bu, Wang,
Zha, Karypis 2023, arXiv 2210.00038). Every other tuple of names (``per_sample.METHODS``,
``clipping.CLIP_METHODS``, ``clipping.engine.MODES``, ``dpsgd.MODES``, ...) is derived here.

| method      | materialises | functional API                  | optimizer                 |
|-------------|--------------|---------------------------------|---------------------------|
| microbatch  | yes          | gradients, norms, clipped sum   | yes                       |
| vmap        | yes          | gradients, norms, clipped sum   | yes                       |
| einsum      | yes          | gradients, norms, clipped sum   | yes                       |
| ghost       | no           | norms, clipped sum (2 backward) | alias of bookkeeping      |
| bookkeeping | no           | clipped sum (1 backward)        | yes                       |

In the optimizer the user's own backward pass has run before ``step``, so "ghost" (whose
second backward pass needs the graph) and "bookkeeping" are one code path there;
``OPTIMIZER_ALIASES`` names it once (the old spelling "ghost" warns: ``deprecation.py``).

>>> [m.name for m in TABLE if m.optimizer]
['microbatch', 'vmap', 'einsum', 'bookkeeping']
"""

from dataclasses import dataclass

__all__ = [
    "CLIP_METHODS", "MATERIALISING", "Method", "NORM_METHODS", "OPTIMIZER_ALIASES",
    "OPTIMIZER_METHODS", "PER_SAMPLE_METHODS", "TABLE", "describe",
]


@dataclass(frozen=True)
class Method:
    """One per-sample method: its name, what it computes, where it is accepted."""

    name: str
    materialises: bool  # (n, *shape) per-sample gradients exist at some point
    gradients: bool  # wb.per_sample_gradients(method=name)
    norms: bool  # wb.per_sample_grad_norms(method=name)
    clipped_sum: bool  # wb.clipped_grad_sum(method=name)
    optimizer: bool  # DPOptimizer / make_private(method=name) under this name
    description: str


TABLE = (
    Method("microbatch", True, True, True, True, True,
           "a loop over samples, one backward pass each: the slow, obviously correct twin"),
    Method("vmap", True, True, True, True, True,
           "torch.func vmap(grad(...)) over the batch"),
    Method("einsum", True, True, True, True, True,
           "hooks record (a, b); each layer's grad rule builds its (n, *shape) gradients"),
    Method("ghost", False, False, True, True, False,
           "norms from (a, b) without the gradients; the clipped sum by a second backward"),
    Method("bookkeeping", False, False, False, True, True,
           "norms from (a, b); the clipped sum from the same (a, b) with c_i b_i"),
)

PER_SAMPLE_METHODS = tuple(m.name for m in TABLE if m.gradients)
MATERIALISING = tuple(m.name for m in TABLE if m.materialises)
NORM_METHODS = tuple(m.name for m in TABLE if m.norms)
CLIP_METHODS = tuple(m.name for m in TABLE if m.clipped_sum)
OPTIMIZER_METHODS = tuple(m.name for m in TABLE if m.optimizer)
OPTIMIZER_ALIASES = {"ghost": "bookkeeping"}  # one code path once the user's backward has run


def describe(name: str) -> str:
    """The table's line for ``name`` (KeyError naming the known methods otherwise)."""
    for m in TABLE:
        if m.name == name:
            return m.description
    raise KeyError(f"no per-sample method {name!r}; the methods: {[m.name for m in TABLE]}")
