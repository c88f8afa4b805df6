"""Book-keeping: the clipped sum from the *same* backward pass that gave the norms.

Bu, Wang, Zha, Karypis 2023 (arXiv 2210.00038, §3) observe that ghost clipping's second
backward pass recomputes what the first one already had: each layer's activations a and
backprops b. Because a layer's per-sample gradient is linear in its backprop,

    Σ_i c_i g_i(a_i, b_i) = Σ_i g_i(a_i, c_i b_i)

so the clipped sum of a layer is its *ordinary* parameter gradient with the backprops
reweighted per sample; for ``nn.Linear`` that is one matrix product (Bu et al. Eq. 3)

    Σ_i c_i B_iᵀ A_i = (c ⊙ B)ᵀ A          (p, d)

We compute it for every layer with PyTorch's own weight-gradient kernel, by a local autograd
call from the layer's output edge to its parameters with grad_outputs = c ⊙ b: it visits
only that layer's node (the layer's inputs do not depend on its own parameters), so the
network is not traversed a second time. Parameters used in several calls were materialised
for their norms (``ghost.squared_norms``); their clipped sum is Σ_i c_i g_i from those.

Notation: n batch, a activations, b backprops, c clip factors (n,).
"""

import torch

from workbench.clipping.flat import clip_factors
from workbench.clipping.ghost import record, squared_norms


def bookkeeping_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm):
    """{name: Σ_i c_i g_i} from one forward and one backward pass (plus local weight grads)."""
    rec = record(model, loss_fn, inputs, targets, retain_graph=True)
    squares, materialised = squared_norms(rec)
    c = clip_factors(squares.sqrt(), max_grad_norm)  # (n,)
    sums: dict[int, torch.Tensor] = {}

    def add(p, g):
        sums[id(p)] = g if id(p) not in sums else sums[id(p)] + g

    for _, layer, call in rec.calls():
        own = [p for p in layer.parameters(recurse=False)
               if p.requires_grad and id(p) not in materialised]
        if not own:
            continue
        b = call.backprops
        weighted = c.to(b.dtype).view(-1, *[1] * (b.dim() - 1)) * b  # c_i b_i
        call.backprops = b = None  # no longer needed: free it before the local backward
        grads = torch.autograd.grad([call.edge], own, grad_outputs=[weighted],
                                    retain_graph=True, allow_unused=True)
        for p, g in zip(own, grads):
            if g is not None:
                add(p, g)
    with torch.no_grad():
        for key, g in materialised.items():
            sums[key] = torch.tensordot(c.to(g.dtype), g, dims=1)  # Σ_i c_i g_i
    return {name: sums.get(id(p), torch.zeros_like(p)) for name, p in rec.params.items()}
