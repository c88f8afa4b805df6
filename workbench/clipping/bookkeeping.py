"""Book-keeping: the clipped sum from the *same* backward pass that gave the norms.

Bu, Wang, Zha, Karypis 2023 (arXiv 2210.00038, §3) observe that ghost clipping's second
backward pass recomputes what the first one already had: each layer's activations a and
backprops b. Because a layer's per-sample gradient is linear in its backprop,

    Σ_i c_i g_i(a_i, b_i) = Σ_i g_i(a_i, c_i b_i)

so the clipped sum of a layer is its *ordinary* parameter gradient with the backprops
reweighted per sample; for ``nn.Linear`` that is one matrix product (Bu et al. Eq. 3)

    Σ_i c_i B_iᵀ A_i = (c ⊙ B)ᵀ A          (p, d)

The backward pass that gives the backprops does not retain the graph: as in a plain step,
what autograd saved inside the layers (attention maps, GELU inputs) is freed as the pass goes,
and only each layer's inputs a and backprops b are kept, which is what peak memory is made of
(bench e2e, tiny_gpt, b = 32, T = 128: about 1.3x a plain step's peak; ghost clipping, which
retains the graph but holds no layer's b past its norm, about the same).
Each layer's clipped sum is then computed from (a, c ⊙ b) alone: for ``nn.Linear`` the one
matmul above; for any other layer PyTorch's own weight-gradient kernel, by re-running the layer
alone on its stored inputs and asking autograd for the gradient with grad_outputs = c ⊙ b.
Each call's backprops are freed once used. The loop itself is the one clipping engine's
(``engine.clipped_sum``, mode ``"bookkeeping"``), the optimizer's too.

Notation: n batch, a activations, b backprops, c clip factors (n,).
"""

from workbench.checks import check_max_grad_norm
from workbench.clipping.engine import clipped_sum
from workbench.clipping.ghost import record, squared_norms, verify_norms
from workbench.clipping.nonfinite import refuse_nonfinite


def bookkeeping_clipped_sum(model, loss_fn, inputs, targets, max_grad_norm, check=True):
    """{name: Σ_i c_i g_i} from one forward and one backward pass (plus local weight grads)."""
    C = check_max_grad_norm(max_grad_norm)
    rec = record(model, loss_fn, inputs, targets, retain_graph=False, check=check)
    if rec.signature is not None:  # the norms are the engine's; verify them first
        verify_norms(model, rec, squared_norms(rec, rec.exact)[0])
    sums, norms, _ = clipped_sum(rec, C, "bookkeeping", exact=rec.exact)
    refuse_nonfinite(norms)  # the engine masked them; the functional API names them
    return {name: sums[id(p)] if id(p) in sums else p.new_zeros(p.shape)
            for name, p in rec.params.items()}


__all__ = ["bookkeeping_clipped_sum"]
